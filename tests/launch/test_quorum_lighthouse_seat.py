"""Quorum mode survives the loss or freeze of the node its Lighthouse runs on
(``--lighthouse-etcd``: the Lighthouse's seat is a lease in a three-member etcd).

Two agents ("nodes") of one replica each on loopback. Node 0 holds the seat and runs the
Lighthouse; mid-epoch at world 2 its whole node is SIGKILLed, or frozen (SIGSTOP of the agent,
its worker and its Lighthouse). Node 1 must take the seat, start a Lighthouse of its own and
train on without a restart of its worker; every epoch's samples exactly once. A frozen node 0,
thawed while node 1 trains, must find its seat lost and kill its Lighthouse (the fence), and its
replica comes back by healing through node 1's Lighthouse. The control: the same kill with a
Lighthouse that does not move (``--lighthouse-port`` on node 0) ends node 1's training, as
docs/fault-tolerance.md says. Needs etcd (skips without it, unless ELASTIC_TRAIN_REQUIRE_ETCD=1).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_train.testing.etcd import EtcdMember, etcd_cluster, require_etcd
from elastic_train.testing.processes import pid_alive
from tests.helpers import free_port
from tests.launch.test_quorum_trainer import STEPS, Job, assert_exactly_once, events
from tests.launch.test_quorum_trainer import job as job

pytestmark = pytest.mark.timeout(300)
TTL = 3
# Long enough for the seat to move (TTL + ~1.5 s) and a thawed node to heal back in, and for node 1
# to join well before the step each test acts at: while node 1's agent starts, node 0 trains alone
# (~0.1 s a step at RUN's global batch of 16; in a fresh-clone CI run node 1 joined at step 79).
EPOCHS = 8
LONGER = ("--epochs", str(EPOCHS))
TERM = re.compile(r"took the Lighthouse seat \(term (\d+)\)")
SEAT = re.compile(r"Lighthouse at \S+ \(pid (\d+)\), bound to \S+, holding its seat")


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[EtcdMember]]:
    require_etcd()
    (tmp_path / "etcd-cluster").mkdir()
    with etcd_cluster(tmp_path / "etcd-cluster") as cluster:
        yield cluster


def seated_pids(text: str) -> list[int]:
    return [int(pid) for pid in SEAT.findall(text)]


def test_the_lighthouses_node_frozen_the_other_node_takes_its_seat_and_trains_on_and_the_thawed_node_heals_back(
    job: Job, members: list[EtcdMember]
) -> None:
    # A frozen node answers nothing and closes nothing (a node SIGKILLed whole would close its
    # sockets, the easier case: measured during development, docs/fault-tolerance.md); the cut-off
    # node is tests/netns/test_quorum_seat_partition.py.
    endpoints = ",".join(m.client for m in members)
    ports = [free_port(), free_port()]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--run-id", f"seat-{ports[0]}"]
    seat = ["--lighthouse-etcd", endpoints, "--lighthouse-ttl", str(TTL)]
    node0 = job.start(
        *common, *seat, "--node-rank", "0", "--lighthouse-port", str(ports[0]), name="node0", flags=LONGER
    )
    job.until("node 0 holding the seat and training", lambda: job.committed_steps(0) >= 3)
    assert seated_pids(node0.out.read_text()), job.output()
    node1 = job.start(
        *common, *seat, "--node-rank", "1", "--lighthouse-port", str(ports[1]), name="node1", flags=LONGER
    )
    job.until("node 1 healed into the quorum", lambda: bool(events(job, 1, "healed")))
    joined = events(job, 1, "healed")[0]
    # Mid-epoch (the evaluation round at an epoch's end waits longer for a frozen peer, by design).
    target = joined["to_step"] + 5
    if target % STEPS < 5:
        target = target // STEPS * STEPS + 5
    elif target % STEPS > STEPS - 10:
        target = (target // STEPS + 1) * STEPS + 5
    assert target < (EPOCHS - 3) * STEPS, f"node 1 joined too late: {joined}"
    job.until("progress at world 2", lambda: job.committed_steps(1) >= target)
    (lighthouse0,) = seated_pids(node0.out.read_text())
    worker1 = node1.pid(1)
    hit = time.time()
    os.killpg(node0.proc.pid, signal.SIGSTOP)
    os.kill(lighthouse0, signal.SIGSTOP)  # in a session of its own: a frozen host freezes it too
    job.until("node 1 holding the seat", lambda: bool(seated_pids(node1.out.read_text())), timeout=TTL + 15)
    job.until(
        "node 1 committing alone",
        lambda: any(e["world"] == 1 for e in events(job, 1, "quorum_changed", hit)),
        timeout=60,
    )
    alone = next(e for e in events(job, 1, "quorum_changed", hit) if e["world"] == 1)
    print(f"\nfreeze: node 1's first commit alone {alone['seconds_since_commit']:.2f} s after its last at world 2")
    job.until("node 1 training on", lambda: job.committed_steps(1) >= alone["step"] + 3)
    assert node1.pid(1) == worker1, "node 1's worker was restarted: the survivor must train on"
    # The thaw: node 0's first look at the clock kills its Lighthouse; its replica, far behind,
    # rejoins through node 1's and heals in place. (Before quorum ids carried the Lighthouse's
    # term, that rejoin cost ~25 s and a worker restart: quorum.term.)
    thawed = time.monotonic()
    os.kill(lighthouse0, signal.SIGCONT)
    os.killpg(node0.proc.pid, signal.SIGCONT)
    job.until("node 0 fencing its Lighthouse", lambda: not pid_alive(lighthouse0), timeout=10)
    print(f"freeze: node 0's Lighthouse killed {time.monotonic() - thawed:.2f} s after the thaw")
    # The agent kills its Lighthouse first and says so after (a fence waits for nothing, not even
    # a write to its console): the line may land a moment after the process is gone.
    job.until("node 0 saying it lost the seat", lambda: "lost the Lighthouse seat" in node0.out.read_text(), timeout=10)
    job.until("node 0's replica healing back in", lambda: bool(events(job, 0, "healed", hit)), timeout=90)
    assert job.wait(node0) == 0, job.output()
    assert node0.workers()[-1][2] == 0, "node 0's worker restarted: a thawed replica heals in place"
    assert job.wait(node1) == 0, job.output()
    assert node1.workers() == [(1, worker1, 0)], "node 1's worker was restarted: the survivor trains on"
    assert_exactly_once(job.base, epochs=EPOCHS)


def test_without_a_seat_the_lighthouses_node_lost_ends_the_training(job: Job) -> None:
    """The control: node 0's own Lighthouse (no etcd) dies with node 0; node 1 cannot go on."""
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--run-id", f"noseat-{port}", "--max-restarts", "0"]
    # The shortest watchdog quorum mode allows: node 1's quorum wait (0.45 x 12 s) ends sooner.
    quick = ("--hang-timeout", "12")
    node0 = job.start(*common, "--node-rank", "0", "--lighthouse-port", str(port), name="node0", flags=quick)
    job.until("node 0 training", lambda: job.committed_steps(0) >= 3)
    node1 = job.start(
        *common, "--node-rank", "1", "--lighthouse", f"http://127.0.0.1:{port}", name="node1", flags=quick
    )
    job.until("node 1 healed into the quorum", lambda: bool(events(job, 1, "healed")))
    os.killpg(node0.proc.pid, signal.SIGKILL)
    assert job.wait(node1, timeout=150) != 0, job.output()
    assert not (job.base / "ckpt" / "latest").exists() or not assert_finished(job)


def assert_finished(job: Job) -> bool:
    from elastic_train.checkpoint.manager import load

    return bool(load((job.base / "ckpt" / "latest").resolve()).manifest.finished)


def test_the_seats_lighthouse_killed_alone_is_replaced_under_a_new_term_without_a_worker_restart(
    job: Job, members: list[EtcdMember]
) -> None:
    """A Lighthouse process that dies while its node lives: the seat is given up and taken again
    (by either agent) with a new term, so the new process's quorum ids are its own; both replicas
    train on through it without a restart."""
    endpoints = ",".join(m.client for m in members)
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--run-id", f"seat-lh-{free_port()}"]
    seat = ["--lighthouse-etcd", endpoints, "--lighthouse-ttl", str(TTL)]
    node0 = job.start(*common, *seat, "--node-rank", "0", name="node0", flags=LONGER)
    job.until("node 0 holding the seat and training", lambda: job.committed_steps(0) >= 3)
    node1 = job.start(*common, *seat, "--node-rank", "1", name="node1", flags=LONGER)
    job.until("node 1 healed into the quorum", lambda: bool(events(job, 1, "healed")))
    job.until("progress at world 2", lambda: job.committed_steps(1) >= events(job, 1, "healed")[0]["to_step"] + 10)
    (lighthouse0,) = seated_pids(node0.out.read_text())
    terms = lambda: [int(t) for n in (node0, node1) for t in TERM.findall(n.out.read_text())]  # noqa: E731
    first = terms()
    hit = time.time()
    os.kill(lighthouse0, signal.SIGKILL)
    job.until("a new term", lambda: len(terms()) > len(first), timeout=TTL + 15)
    assert max(terms()) > max(first), terms()
    job.until(
        "both replicas committing together again",
        lambda: any(e["world"] == 2 for e in events(job, 1, "committed", hit + 1)),
        timeout=60,
    )
    assert job.wait(node0) == 0 and job.wait(node1) == 0, job.output()
    assert [w[2] for w in node0.workers() + node1.workers()] == [0, 0], f"a worker restarted\n{job.output()}"
    assert_exactly_once(job.base, epochs=EPOCHS)


def test_participant_0_killed_after_its_claim_the_survivor_voids_the_claim_and_trains_on(
    job: Job, members: list[EtcdMember]
) -> None:
    """The line record's commonest failure: participant 0 (node 0's replica) is SIGKILLed right
    after its claim of step S reached etcd, before any participant applied it. Node 1's next
    quorum stands where the claim came from: it voids the claim and commits step S itself,
    without a restart; node 0's worker restarts and heals from node 1 (``quorum.line``)."""
    endpoints = ",".join(m.client for m in members)
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--run-id", f"seat-void-{free_port()}"]
    seat = ["--lighthouse-etcd", endpoints, "--lighthouse-ttl", str(TTL)]
    step = 4 * STEPS + STEPS // 2  # mid-epoch 5: node 1 has long joined (asserted below)
    job.env["ELASTIC_TRAIN_FAULTS"] = f"kill_after_claim:rank=0:step={step}"
    node0 = job.start(*common, *seat, "--node-rank", "0", name="node0", flags=LONGER)
    del job.env["ELASTIC_TRAIN_FAULTS"]
    job.until("node 0 holding the seat and training", lambda: job.committed_steps(0) >= 3)
    node1 = job.start(*common, *seat, "--node-rank", "1", name="node1", flags=LONGER)
    job.until("node 1 healed into the quorum", lambda: bool(events(job, 1, "healed")))
    assert events(job, 1, "healed")[0]["to_step"] < step - 5, "node 1 joined too late for the test's step"
    worker1 = node1.pid(1)
    # Voided by node 1's quorum alone, or (should node 0's replacement rejoin first) by the two.
    voids = lambda: events(job, 1, "line_claim_voided") + events(job, 0, "line_claim_voided")  # noqa: E731
    job.until("the claim voided", lambda: bool(voids()), timeout=90)
    voided = voids()[0]
    commits = step + (step - 1) // STEPS  # the Manager step: batches and evaluation rounds
    assert voided["step"] == step - 1 and voided["voided"].startswith(f"step {commits} "), voided
    job.until("node 0's replica healing back in", lambda: len(events(job, 0, "healed")) >= 1, timeout=90)
    assert job.wait(node0) == 0 and job.wait(node1) == 0, job.output()
    assert node1.workers() == [(1, worker1, 0)], "node 1's worker was restarted: the survivor trains on"
    assert [w[2] for w in node0.workers()] == [0, 1], "node 0's worker must have died once (the fault)"
    assert_exactly_once(job.base, epochs=EPOCHS)
