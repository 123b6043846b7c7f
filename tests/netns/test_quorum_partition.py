"""Quorum mode across a real network partition: two nodes in network namespaces of their own on
a private bridge, the Lighthouse on node a. Node b's link goes down (packets vanish, nothing is
closed: the survivor's collective can only time out), then comes back.

* The trainer (``--ft quorum``, one worker per replica group): node a must go on alone within
  ``--peer-timeout`` plus a quorum, without a restart; node b must come back into the quorum by
  healing from node a once the network heals; every epoch's samples exactly once.
* Replica groups of two workers, DDP inside a group, one group per node: in the trainer
  (``--procs-per-replica 2`` under the quorum agent) and in a custom loop (examples/char_lm.py
  under torchrun). The group on node a commits alone, never restarted; the group on node b,
  whose own workers still reach each other, heals back in worker by worker; every sample
  exactly once and equal final weights.

Needs root and iproute2 (skips without, fails in CI: ELASTIC_TRAIN_REQUIRE_NETNS=1).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from elastic_train.quorum.lighthouse import Lighthouse, LighthouseConfig
from elastic_train.quorum.names import JOB_VAR, SECRET_VAR
from elastic_train.testing.netns import Host, bridged_hosts, require_netns
from tests.helpers import BIN, ROOT, TOKEN_VAR, base_env, kill_tagged
from tests.launch import test_quorum_groups as groups_test
from tests.launch.test_quorum_groups import SURVIVOR, VICTIM, Groups, K, commits
from tests.launch.test_quorum_trainer import RUN, STEPS, Job, _time, assert_exactly_once, events
from tests.launch.test_quorum_trainer_groups import GROUP_WORKER, worker_events, worker_log

pytestmark = pytest.mark.timeout(300)
PORT = 29510


@pytest.fixture
def hosts() -> Iterator[dict[str, Host]]:
    require_netns()
    with bridged_hosts(["a", "b"]) as made:
        yield made


def start(
    job: Job,
    host: Host,
    rank: int,
    lighthouse: list[str],
    epochs: int,
    per_node: Sequence[str] = ("--nproc-per-node", "1"),
) -> subprocess.Popen[bytes]:
    epochs_at = RUN.index("--epochs") + 1
    run = [*RUN[:epochs_at], str(epochs), *RUN[epochs_at + 1 :]]
    command = host.command(
        [
            str(BIN / "python"), "-m", "elastic_train.quorum.launch", "--nnodes", "2", "--node-rank", str(rank),
            "--run-id", job.env["ELASTIC_TRAIN_TEST_TOKEN"],
            *per_node, *lighthouse, "-m", "elastic_train", *run,
            "--log-dir", str(job.base / "logs"), "--checkpoint-dir", str(job.base / "ckpt"),
        ]
    )  # fmt: skip
    # Where names do not resolve to the bridge: advertise the address, and bind gloo to the veth.
    env = {**job.env, "ELASTIC_TRAIN_QUORUM_HOST": host.addr, "GLOO_SOCKET_IFNAME": host.ifname}
    out = (job.base / f"{host.name}.out").open("wb")
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return proc


def time_to_cut(node_a: list[dict[str, Any]], node_b: list[dict[str, Any]], both: int, together: int = 10) -> bool:
    """Whether a cut now lands where the test means it to: both nodes have trained ``together``
    steps in one quorum (world ``both``), and node a stands mid-epoch. "Step 15 reached" is not
    enough: node a trains alone while node b starts, and b's first record is its heal to a's
    step. A cut in an epoch's evaluation round meets that round's own bound (30 s: the whole
    validation set may be quiet that long), not --peer-timeout. Steps are reported every 5
    (``committed``), so the window ends 15 steps before the epoch's end."""
    joined = [int(r["step"]) for r in node_b if r.get("event") == "quorum_changed" and r.get("world") == both]
    steps = [int(r["step"]) for r in node_a if isinstance(r.get("step"), int)]
    if not joined or not steps:
        return False
    step = max(steps)
    return step >= joined[0] + together and 5 <= step % STEPS <= STEPS - 15


def test_a_partitioned_node_is_left_behind_and_heals_back_in_when_the_network_returns(
    hosts: dict[str, Host], tmp_path: Path
) -> None:
    a, b = hosts["a"], hosts["b"]
    # Two nodes, one job: one secret for both agents (it signs the state a healing replica fetches).
    job = Job(tmp_path, base_env({"ELASTIC_TRAIN_QUORUM_SECRET": secrets.token_hex(16)}))
    node_a = start(job, a, 0, ["--lighthouse-port", str(PORT)], epochs=6)
    node_b = start(job, b, 1, ["--lighthouse", f"http://{a.addr}:{PORT}"], epochs=6)
    try:
        job.until("both nodes training, mid-epoch", lambda: time_to_cut(job.log(0), job.log(1), both=2))
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
    assert alone["seconds_since_commit"] < 6.0, alone  # --peer-timeout (1 s) + a quorum, one step included
    healed = [e for e in events(job, 1, "healed", back)]
    assert healed, f"node b rejoined without healing:\n{(tmp_path / 'b.out').read_text()[-3000:]}"
    assert not events(job, 1, "resumed", back), "node b healed from node a, not from a checkpoint"
    history = assert_exactly_once(tmp_path, epochs=6)
    assert len(history) == 6


def test_a_partitioned_trainer_replica_group_is_left_behind_and_heals_back_in_worker_by_worker(
    hosts: dict[str, Host], tmp_path: Path
) -> None:
    """The built-in trainer's replica groups: one group of K workers (DDP inside) per node."""
    a, b = hosts["a"], hosts["b"]
    job = Job(tmp_path, base_env({"ELASTIC_TRAIN_QUORUM_SECRET": secrets.token_hex(16)}))
    per_node = ("--nproc-per-node", "1", "--procs-per-replica", str(K))
    node_a = start(job, a, 0, ["--lighthouse-port", str(PORT)], epochs=6, per_node=per_node)
    node_b = start(job, b, 1, ["--lighthouse", f"http://{a.addr}:{PORT}"], epochs=6, per_node=per_node)
    ranks = range(K)
    try:
        job.until(
            "both groups training, mid-epoch",
            lambda: time_to_cut(worker_log(job, 0, 0), worker_log(job, 1, 0), both=2 * K),
            timeout=150,
        )
        cut = b.set_link(False)

        def alone(rank: int) -> list[dict[str, object]]:
            return [e for e in worker_events(job, 0, rank, "quorum_changed", cut) if e["world"] == K]

        job.until("node a's group alone", lambda: all(alone(r) for r in ranks))
        time.sleep(3)
        back = b.set_link(True)
        job.until(
            "node b's group healed back in",
            lambda: all(worker_events(job, 1, r, "healed", back) for r in ranks),
            timeout=120,
        )
        assert node_a.wait(timeout=180) == 0, (tmp_path / "a.out").read_text()[-3000:]
        assert node_b.wait(timeout=60) == 0, (tmp_path / "b.out").read_text()[-3000:]
    finally:
        for proc in (node_a, node_b):
            if proc.poll() is None:
                proc.kill()
        kill_tagged(job.env[TOKEN_VAR])
    # Neither group restarted: node a's lost one discarded attempt and a quorum, node b's workers
    # (which still reached each other) healed in place.
    assert len(GROUP_WORKER.findall((tmp_path / "a.out").read_text())) == K
    assert len(GROUP_WORKER.findall((tmp_path / "b.out").read_text())) == K, (tmp_path / "b.out").read_text()[-3000:]
    for rank in ranks:
        first = alone(rank)[0]
        assert first["seconds_since_commit"] < 6.0, first  # --peer-timeout (1 s) + a quorum, one step included
        assert not worker_events(job, 1, rank, "resumed", back), "node b healed from node a, not a checkpoint"
    assert len(assert_exactly_once(tmp_path, epochs=6)) == 6
    done = {(g, r): worker_events(job, g, r, "done")[-1]["weights_sha256"] for g in (0, 1) for r in ranks}
    assert all(done[(0, r)] == done[(1, r)] for r in ranks), done
    alone_at = min(_time(alone(r)[0]) for r in ranks)
    together = [e for e in worker_events(job, 0, 0, "quorum_changed", back) if e["world"] == 2 * K]
    assert together, f"node a's group never logged a quorum of both groups again\n{job.output()}"
    print(
        f"\npartitioned trainer group: node a's group alone {alone_at - cut:.2f}s after the cut; both groups "
        f"together {_time(together[0]) - back:.2f}s after the link came back, without a restart"
    )


@pytest.mark.timeout(300)
def test_a_partitioned_replica_group_is_left_behind_and_heals_back_in_worker_by_worker(
    hosts: dict[str, Host], tmp_path: Path
) -> None:
    a, b = hosts["a"], hosts["b"]
    env = base_env({JOB_VAR: f"groups-{secrets.token_hex(4)}", SECRET_VAR: secrets.token_hex(16)})
    config = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=400, join_timeout_ms=100)
    lighthouse = Lighthouse(
        config, host=a.addr, port=PORT, log=tmp_path / "lighthouse.log", env=env, prefix=a.command([])
    )
    steps = 60
    lighthouse.start()
    job = Groups(base=tmp_path, lighthouse=lighthouse, env=env, agents={})
    try:
        job.start(SURVIVOR, "ddp", "--steps", str(steps), host=a)
        job.start(VICTIM, "ddp", "--steps", str(steps), host=b)
        job.until("both groups training together", lambda: job.together_past(8), timeout=150)
        cut = b.set_link(False)
        job.until(
            "the group on node a committing alone",
            lambda: any(c["time"] > cut and c["world"] == K for c in commits(job.log(SURVIVOR))),
            timeout=60,
        )
        alone_at = time.time()
        time.sleep(3)
        back = b.set_link(True)
        job.until(
            "both groups together again",
            lambda: any(c["time"] > back and c["world"] == 2 * K for c in commits(job.log(SURVIVOR))),
            timeout=120,
        )
        together_at = time.time()
        codes = job.wait(timeout=150)
    finally:
        kill_tagged(env[TOKEN_VAR])
        lighthouse.stop()
    assert codes == {SURVIVOR: 0, VICTIM: 0}, job.output()
    workers = [(g, r) for g in (SURVIVOR, VICTIM) for r in range(K)]
    logs = {(g, r): job.log(g, r) for g, r in workers}
    for r in range(K):  # the group on node a never restarted, and went on alone
        assert [e["restart_count"] for e in logs[(SURVIVOR, r)] if e["event"] == "start"] == [0]
    assert alone_at - cut < 8.0, f"the group on node a went on alone only {alone_at - cut:.1f}s after the cut"
    restarts = 0
    for r in range(K):  # each worker of node b's group healed from its counterpart after the network came back
        log = logs[(VICTIM, r)]
        heals = [e for e in log if e["event"] == "heal" and e["time"] > cut]
        assert heals, f"worker {r} of node b's group rejoined without healing:\n{job.output()}"
        restarts = max(restarts, max(e["restart_count"] for e in log if e["event"] == "start"))
    assert restarts == 0, f"node b's group restarted {restarts}x: it should have healed in place\n{job.output()}"
    groups_test.assert_exactly_once(logs, cut, steps)
    groups_test.assert_finished_equal(logs, steps)
    print(
        f"\npartitioned group: node a's group committed alone {alone_at - cut:.2f}s after the cut; both "
        f"together {together_at - back:.2f}s after the link came back, without a restart"
    )
