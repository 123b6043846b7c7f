"""Quorum mode's network surface (issue 17, points 6 and 7): no pickle on the wire, signed heals,
listeners on the job's interface, a Lighthouse that is this job's own, replica ids with the job."""

from __future__ import annotations

import argparse
import io
import math
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.errors import UsageError
from elastic_train.quorum import identity
from elastic_train.quorum.launch import Agent
from elastic_train.quorum.lighthouse import Lighthouse, LighthousePortTaken
from elastic_train.quorum.names import JOB_VAR, SECRET_VAR
from elastic_train.quorum.replica import ReplicaConfig, _state_transport
from elastic_train.quorum.transport import (
    SIGNATURE_HEADER,
    StateTransferError,
    body_signature,
    decode_state,
    encode_parts,
    encode_state,
)

SECRET = "s3cret-of-this-job-0123"
TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JOB_VAR, "job-a")
    monkeypatch.setenv(SECRET_VAR, SECRET)


def transport(**overrides: Any) -> Any:
    """A replica's state transfer, built as ``Replica`` builds it (on loopback)."""
    config = ReplicaConfig("http://127.0.0.1:1", 0, hostname="127.0.0.1", timeout_s=10.0, **overrides)
    return _state_transport(config)


# ------------------------------------------------------------------------------ exact codec
def assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Same Python types all the way down, bitwise-equal tensors (dtype, shape, bytes)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert (
            a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            == b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
        assert_identical(getattr(a, "_metadata", None), getattr(b, "_metadata", None), f"{where}._metadata")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), where


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
tensors = st.builds(
    lambda dtype, shape, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 3), max_size=3),
    st.integers(0, 2**31),
)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
keys = st.text(max_size=6) | st.integers(-5, 5) | st.tuples(st.integers(0, 3), st.text(max_size=2))
trees = st.recursive(
    scalars | tensors,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3).map(OrderedDict)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_state_tree_round_trips_exactly_with_its_python_types_and_tensor_bits(tree: Any) -> None:
    assert_identical(tree, decode_state(encode_state(tree)))


def trained_state() -> dict[str, Any]:
    """torchft's wrapping of a real replica's state after a few AdamW steps (what it sends)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    for _ in range(3):
        model(torch.randn(6, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    progress = {"epoch": 1, "history": [{"loss": 0.25, "acc": None}], "timeline": "ab" * 8}
    user = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "progress": progress,
    }
    return {"user": user, "torchft": {"step": 3, "batches_committed": 6}}


def test_a_real_model_adamw_and_scheduler_state_round_trips_bitwise_and_loads(job_env: None) -> None:
    state = trained_state()
    optim_state = state["user"]["optimizer"]["state"]
    assert all(isinstance(k, int) for k in optim_state)  # the int keys JSON alone would lose
    sender, receiver = transport(), transport()
    try:
        sender.send_checkpoint([1], 3, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    finally:
        sender.shutdown(), receiver.shutdown()
    assert_identical(state, got)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model.load_state_dict(got["user"]["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(got["user"]["optimizer"])


def test_tied_tensors_and_views_round_trip_and_what_is_served_is_the_state_when_staged(job_env: None) -> None:
    weight = torch.arange(12.0).reshape(3, 4)
    state = {"user": {"tied": {"a": weight, "b": weight, "column": weight[:, 1]}}, "torchft": {"step": 2}}
    sender, receiver = transport(), transport()
    try:
        sender.send_checkpoint([1], 2, state, TIMEOUT)
        weight.add_(100)  # the trainer goes on after staging
        got = receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)
    finally:
        sender.shutdown(), receiver.shutdown()
    assert torch.equal(got["user"]["tied"]["a"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(got["user"]["tied"]["b"], got["user"]["tied"]["a"])
    assert torch.equal(got["user"]["tied"]["column"], torch.tensor([1.0, 5.0, 9.0]))


def test_a_state_that_json_cannot_carry_is_refused_naming_where_it_is() -> None:
    with pytest.raises(TypeError, match=r"state\['user'\]\['extra'\]\['seen'\] is a set"):
        encode_state({"user": {"extra": {"seen": {1, 2}}}})


# ----------------------------------------------------------------- no pickle from the network
class FakePeer:
    """An HTTP server answering every GET with ``body`` (and ``signature``, when given)."""

    def __init__(self, body: bytes, signature: str | None = None) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                if signature is not None:
                    self.send_header(SIGNATURE_HEADER, signature)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.metadata = f"http://127.0.0.1:{self.server.server_address[1]}/state/"


class Exploit:
    """Unpickling it creates ``path``: proof that a receiver ran the peer's code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (subprocess.call, (["touch", str(self.path)],))


@pytest.fixture
def crafted_pickle(tmp_path: Path) -> Iterator[tuple[bytes, Path]]:
    """torchft's own wire format (what its HTTPTransport unpickles), carrying ``Exploit``."""
    from torchft.checkpointing._serialization import _streaming_save

    marker = tmp_path / "pwned"
    payload = {"user": {"model": Exploit(marker)}, "torchft": {"step": 1, "batches_committed": 1}}
    out = io.BytesIO()
    _streaming_save(payload, out)
    yield out.getvalue(), marker


def test_a_peer_serving_a_crafted_pickle_is_refused_unread(job_env: None, crafted_pickle: tuple[bytes, Path]) -> None:
    body, marker = crafted_pickle
    peer = FakePeer(body)
    receiver = transport()
    try:
        with pytest.raises(StateTransferError, match="not signed with this job's secret"):
            receiver.recv_checkpoint(0, peer.metadata, 1, TIMEOUT)
    finally:
        receiver.shutdown(), peer.server.shutdown()
    assert not marker.exists(), "the receiver unpickled the peer's payload"


def test_even_a_pickle_signed_with_the_job_secret_is_never_unpickled(
    job_env: None, crafted_pickle: tuple[bytes, Path]
) -> None:
    body, marker = crafted_pickle
    peer = FakePeer(body, body_signature(SECRET.encode(), 1, body))
    receiver = transport()
    try:
        with pytest.raises(StateTransferError, match="not an elastic-train state"):
            receiver.recv_checkpoint(0, peer.metadata, 1, TIMEOUT)
    finally:
        receiver.shutdown(), peer.server.shutdown()
    assert not marker.exists()


def test_a_state_larger_than_a_signature_chunk_round_trips(job_env: None) -> None:
    # 40 MB: three of the signature's 16 MB chunks, hashed on the pool on both sides.
    state = {"user": {"w": torch.randn(10_000_000), "b": torch.ones(3, dtype=torch.bfloat16)}, "torchft": {"step": 7}}
    sender, receiver = transport(), transport()
    try:
        sender.send_checkpoint([1], 7, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
    finally:
        sender.shutdown(), receiver.shutdown()
    assert_identical(state, got)


class TruncatingPeer:
    """Serves a real signed state's head and tree, announces the whole body, sends half the
    tensors' bytes and closes: a peer dying mid-transfer."""

    def __init__(self, body: tuple[bytes, memoryview], signature: str) -> None:
        head, blob = body
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.metadata = f"http://127.0.0.1:{self.listener.getsockname()[1]}/state/"

        def serve() -> None:
            conn, _ = self.listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(
                    f"HTTP/1.1 200 OK\r\nContent-Length: {len(head) + len(blob)}\r\n"
                    f"{SIGNATURE_HEADER}: {signature}\r\n\r\n".encode()
                )
                conn.sendall(head + bytes(blob[: len(blob) // 2]))

        threading.Thread(target=serve, daemon=True).start()


def test_a_transfer_cut_short_is_refused_as_truncated_not_as_a_wrong_secret(job_env: None) -> None:
    body = encode_parts({"user": {"w": torch.arange(1000.0)}, "torchft": {"step": 4}})
    peer = TruncatingPeer(body, body_signature(SECRET.encode(), 4, *body))
    receiver = transport()
    try:
        with pytest.raises(StateTransferError, match=r"was truncated: \d+ of \d+ bytes came"):
            receiver.recv_checkpoint(0, peer.metadata, 4, TIMEOUT)
    finally:
        receiver.shutdown(), peer.listener.close()


# ------------------------------------------------------------------------ the job's secret
def test_a_client_without_the_job_secret_gets_403_and_no_state(job_env: None) -> None:
    sender = transport()
    try:
        sender.send_checkpoint([1], 3, trained_state(), TIMEOUT)
        url = f"{sender.metadata()}3"
        for headers in ({}, {SIGNATURE_HEADER: "0" * 64}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            assert refused.value.code == 403
            assert b"param_groups" not in refused.value.read()
        other_job = transport(secret="another-job-secret-xyz")
        with pytest.raises(StateTransferError, match="403: it does not share this job's secret"):
            other_job.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        other_job.shutdown()
    finally:
        sender.shutdown()


def test_a_healer_asking_before_its_source_staged_the_state_waits_for_it(job_env: None) -> None:
    sender, receiver = transport(), transport()
    try:
        threading.Timer(0.5, sender.send_checkpoint, ([1], 4, {"user": {}, "torchft": {"step": 4}}, TIMEOUT)).start()
        assert receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)["torchft"] == {"step": 4}
    finally:
        sender.shutdown(), receiver.shutdown()


def test_a_replica_without_a_job_id_or_secret_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (JOB_VAR, SECRET_VAR, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match=JOB_VAR):
        transport(secret=SECRET)
    with pytest.raises(UsageError, match=f"{SECRET_VAR} is unset"):
        transport(job="job-a")


# ---------------------------------------------------------------- the job's interface only
def test_the_state_server_listens_on_the_job_interface_not_every_interface(job_env: None) -> None:
    served = transport()
    try:
        assert served._server.server_address[0] == "127.0.0.1"
    finally:
        served.shutdown()
    assert identity.bind_address("localhost", {}) == "127.0.0.1"
    assert identity.bind_address("node7", {"ELASTIC_TRAIN_QUORUM_BIND": "10.0.0.7"}) == "10.0.0.7"


def test_a_one_node_launch_gives_its_workers_loopback_a_job_id_and_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ELASTIC_TRAIN_QUORUM_HOST", SECRET_VAR, "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(nproc_per_node=2, procs_per_replica=1, nnodes=1, node_rank=0, max_restarts=1, run_id=None)
    first, second = Agent(args, [], "http://127.0.0.1:1"), Agent(args, [], "http://127.0.0.1:1")
    env = first.environ(first.slots[1])
    assert env["ELASTIC_TRAIN_QUORUM_HOST"] == "127.0.0.1"
    assert env[JOB_VAR] == first.run_id and len(env[SECRET_VAR]) >= identity.MIN_SECRET_CHARS
    assert first.environ(first.slots[0])[SECRET_VAR] == env[SECRET_VAR]  # one job, one secret
    assert second.secret != first.secret and second.run_id != first.run_id  # per launch


# ------------------------------------------------------------------ replica ids with the job
def test_replica_ids_carry_the_job_and_keep_the_group_as_trailing_digits(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchft.manager import extract_trailing_digits

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv(JOB_VAR, raising=False)
    config = ReplicaConfig("http://127.0.0.1:1", 12)
    member = identity.member_id(config.name, config.job, config.replica_group, group_size=4)
    assert member == "replica@4242@4_12" and config.replica_id == "replica_12"
    torchft_id = f"{member}:0b6c-uuid"  # as the Lighthouse reports it
    assert extract_trailing_digits(torchft_id.split(":")[0]) == 12
    assert identity.job_of(torchft_id) == "4242" and identity.group_size_of(torchft_id) == 4
    assert identity.job_id({JOB_VAR: "my_job:1@x"}) == "my-job-1-x"  # no separators leak in
    assert identity.job_id({"TORCHELASTIC_RUN_ID": "none"}) == ""  # torchrun's default is no identity


def test_a_quorum_holding_another_jobs_replica_is_refused_before_any_heal() -> None:
    quorum = SimpleNamespace(replica_ids=["replica@job-a@1_0:u1", "replica@job-b@1_1:u2"])
    client = SimpleNamespace(_quorum=lambda **kwargs: quorum, should_commit=lambda: True)
    manager = SimpleNamespace(_client=client)
    identity.guard_quorum(manager, "job-a", "replica@job-a@1_0", "http://127.0.0.1:1")
    with pytest.raises(identity.ForeignReplicaError, match=r"replica@job-b@1_1:u2 \(another job\)"):
        manager._client._quorum(step=3)
    quorum.replica_ids = ["replica@job-a@1_0:u1", "replica@job-a@1_1:u3"]
    assert manager._client._quorum(step=3) is quorum and manager._client.should_commit()


def test_a_quorum_mixing_group_sizes_is_refused_naming_the_odd_group() -> None:
    # Group 1 was started with another --nproc-per-node: its worker 1 would average with this
    # group's worker 1, which holds another shard, and the global batch would be cut wrongly.
    quorum = SimpleNamespace(replica_ids=["replica@job-a@2_0:u1", "replica@job-a@3_1:u2"])
    manager = SimpleNamespace(_client=SimpleNamespace(_quorum=lambda **kwargs: quorum))
    identity.guard_quorum(manager, "job-a", "replica@job-a@2_0", "http://127.0.0.1:1")
    with pytest.raises(identity.GroupSizeError, match=r"group of 2 workers.*replica@job-a@3_1:u2 \(3 workers\)"):
        manager._client._quorum(step=0)
    assert issubclass(identity.GroupSizeError, UsageError)  # exit 2, not retried
    quorum.replica_ids = ["replica@job-a@2_0:u1", "replica@job-a@2_1:u2"]
    assert manager._client._quorum(step=0) is quorum


# ---------------------------------------------------------------------- the Lighthouse's port
@pytest.fixture
def foreign_listener() -> Iterator[int]:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield int(other.getsockname()[1])


def test_a_lighthouse_port_another_process_listens_on_is_refused_naming_the_fix(foreign_listener: int) -> None:
    lighthouse = Lighthouse(port=foreign_listener)
    with pytest.raises(
        LighthousePortTaken, match=rf"port {foreign_listener} .* in use by process \d+.*--lighthouse-port"
    ):
        lighthouse.start()
    assert lighthouse.proc is None  # nothing was started


def test_a_lighthouse_whose_port_was_taken_after_it_died_is_not_restarted_in_a_loop(
    foreign_listener: int, capsys: pytest.CaptureFixture[str]
) -> None:
    server = Lighthouse(port=foreign_listener)
    server.proc = subprocess.Popen(["true"])  # the job's Lighthouse, dead
    server.proc.wait()
    args = argparse.Namespace(nproc_per_node=1, procs_per_replica=1, nnodes=1, node_rank=0, max_restarts=1, run_id="r")
    agent = Agent(args, [], server.address, server)
    agent.supervise_lighthouse()
    agent.supervise_lighthouse()
    out = capsys.readouterr().out
    assert agent.server is None and out.count("could not start the Lighthouse again") == 1
    assert f"port {foreign_listener}" in out
