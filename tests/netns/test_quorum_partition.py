"""Quorum mode across a real network partition: two nodes (agent and worker each) in network
namespaces of their own on a private bridge, the Lighthouse on node a. Node b's link goes down
(packets vanish, nothing is closed: the survivor's collective can only time out), then comes back.

Node a must go on alone within ``--peer-timeout`` plus a quorum, without a restart; node b must
come back into the quorum by healing from node a once the network heals; every epoch's samples
exactly once. Needs root and iproute2 (skips without, fails in CI: ELASTIC_TRAIN_REQUIRE_NETNS=1).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_train.testing.netns import Host, bridged_hosts, netns_problem
from tests.helpers import BIN, ROOT, base_env
from tests.launch.test_quorum_trainer import RUN, Job, assert_exactly_once, events

pytestmark = pytest.mark.timeout(300)
PORT = 29510


@pytest.fixture
def hosts() -> Iterator[dict[str, Host]]:
    problem = netns_problem()
    if problem is not None:
        if os.environ.get("ELASTIC_TRAIN_REQUIRE_NETNS") == "1":
            pytest.fail(f"ELASTIC_TRAIN_REQUIRE_NETNS=1 but {problem}")
        pytest.skip(problem)
    with bridged_hosts(["a", "b"]) as made:
        yield made


def start(job: Job, host: Host, rank: int, lighthouse: list[str], epochs: int) -> subprocess.Popen[bytes]:
    epochs_at = RUN.index("--epochs") + 1
    run = [*RUN[:epochs_at], str(epochs), *RUN[epochs_at + 1 :]]
    command = host.command(
        [
            str(BIN / "python"), "-m", "elastic_train.quorum.launch", "--nnodes", "2", "--node-rank", str(rank),
            "--run-id", job.env["ELASTIC_TRAIN_TEST_TOKEN"],
            "--nproc-per-node", "1", *lighthouse, "-m", "elastic_train", *run,
            "--log-dir", str(job.base / "logs"), "--checkpoint-dir", str(job.base / "ckpt"),
        ]
    )  # fmt: skip
    # Where names do not resolve to the bridge: advertise the address, and bind gloo to the veth.
    env = {**job.env, "ELASTIC_TRAIN_QUORUM_HOST": host.addr, "GLOO_SOCKET_IFNAME": host.ifname}
    out = (job.base / f"{host.name}.out").open("wb")
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return proc


def test_a_partitioned_node_is_left_behind_and_heals_back_in_when_the_network_returns(
    hosts: dict[str, Host], tmp_path: Path
) -> None:
    a, b = hosts["a"], hosts["b"]
    # Two nodes, one job: one secret for both agents (it signs the state a healing replica fetches).
    job = Job(tmp_path, base_env({"ELASTIC_TRAIN_QUORUM_SECRET": secrets.token_hex(16)}))
    node_a = start(job, a, 0, ["--lighthouse-port", str(PORT)], epochs=6)
    node_b = start(job, b, 1, ["--lighthouse", f"http://{a.addr}:{PORT}"], epochs=6)
    try:
        job.until("both nodes training", lambda: job.committed_steps(0) >= 15 and job.committed_steps(1) >= 15)
        cut = b.set_link(False)
        job.until("node a alone", lambda: any(e["world"] == 1 for e in events(job, 0, "quorum_changed", cut)))
        alone = next(e for e in events(job, 0, "quorum_changed", cut) if e["world"] == 1)
        time.sleep(3)
        back = b.set_link(True)
        job.until(
            "node b back in the quorum",
            lambda: any(e["world"] == 2 for e in events(job, 0, "quorum_changed", back)),
            timeout=120,
        )
        assert node_a.wait(timeout=180) == 0, (tmp_path / "a.out").read_text()[-3000:]
        node_b.wait(timeout=60)
    finally:
        for proc in (node_a, node_b):
            if proc.poll() is None:
                proc.kill()
    # Node a never restarted: the partition cost it one discarded attempt and a quorum.
    assert (tmp_path / "a.out").read_text().count("worker pid") == 1
    assert alone["seconds_since_commit"] < 6.0, alone  # --peer-timeout (2 s) + a quorum, one step included
    healed = [e for e in events(job, 1, "healed", back)]
    assert healed, f"node b rejoined without healing:\n{(tmp_path / 'b.out').read_text()[-3000:]}"
    assert not events(job, 1, "resumed", back), "node b healed from node a, not from a checkpoint"
    history = assert_exactly_once(tmp_path, epochs=6)
    assert len(history) == 6
