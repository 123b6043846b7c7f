"""Impolite node faults with real torchrun agents: a frozen node, a network partition, its healing.

A killed process closes its sockets and its peers fail at once; these faults close nothing. The
survivor's gloo collective blocks until its step watchdog (``--hang-timeout``) ends the worker,
its agent re-rendezvouses without the silent node, and training resumes from the newest
checkpoint at the smaller size. Every test ends with each epoch's samples trained exactly once
(the per-epoch sample digests equal an uninterrupted run's) and one checkpoint lineage
(``assert_one_lineage``), and prints the time from the fault to the first step at the smaller
size (docs/fault-tolerance.md, "Failures").

The partition tests put each node (agent and worker), and the rendezvous store, in a network
namespace of its own on a private bridge (tests/netns.py). They need root and iproute2 and skip
without them, unless ELASTIC_TRAIN_REQUIRE_NETNS=1 (set by .ci/run): then they fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.elastic_harness import (
    Agent,
    all_events,
    assert_one_lineage,
    event_time,
    first_step_after,
    rendezvous_store,
    wait_for,
)
from tests.helpers import cli, flags
from tests.netns import Host, bridged_hosts, ip, netns_problem
from tests.test_checkpoint_resume import dirs, epoch_metrics

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(240)]

HANG_TIMEOUT = 15  # small, to keep the tests short; the default is chosen in docs/fault-tolerance.md
RUN = flags(
    batch_size=32,
    max_steps_per_epoch=24,
    epochs=2,
    target_accuracy=1.0,
    patience=0,
    checkpoint_every=2,
    keep_last=1000,  # keep every checkpoint, so that all of them are verified at the end
    hang_timeout=HANG_TIMEOUT,
)
# Long enough after the shrink for the healed node to get through to the store again (TCP's
# retransmission backoff on its stale connection: up to ~25 s here) and rejoin before the end.
HEAL_EPOCHS = 5
HEAL_RUN = [*RUN, "--epochs", str(HEAL_EPOCHS)]
# Detection (hang timeout + one watchdog poll), the restart, the rendezvous without the silent
# node (3 s of missed keep-alives + 5 s last call), a worker's start-up and checkpoint load.
SHRINK_BOUND_S = HANG_TIMEOUT + 45


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.cleanup()


@pytest.fixture(scope="module")
def netns_available() -> None:
    """Skip (or fail, in CI) where namespaces cannot be made: before the reference run starts."""
    problem = netns_problem()
    if problem is not None:
        if os.environ.get("ELASTIC_TRAIN_REQUIRE_NETNS") == "1":
            pytest.fail(f"ELASTIC_TRAIN_REQUIRE_NETNS=1 but {problem}")
        pytest.skip(problem)


@pytest.fixture
def hosts(netns_available: None) -> Iterator[dict[str, Host]]:
    """Namespaces for the store and two nodes, on a private bridge; deleted after the test."""
    with bridged_hosts(["store", "a", "b"]) as made:
        yield made


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run, as long as the longest test: the samples of an epoch depend neither
    on the world size nor on the number of epochs that follow it."""
    base = tmp_path_factory.mktemp("impolite-reference")
    done = cli([*HEAL_RUN, *dirs(base)], timeout=240)
    assert done.returncode == 0, done.output
    return base


def samples(base: Path, epochs: int | None = None) -> list[tuple[int, int, str]]:
    """(epoch, samples trained, digest of their indices) of the first ``epochs`` epochs."""
    return [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(base)][:epochs]


def committed(base: Path, step: int) -> bool:
    return any(e["step"] >= step for e in all_events(base, "checkpoint_committed"))


def rank0_node_and_other(agents: list[Agent]) -> tuple[Agent, Agent]:
    """The node running rank 0 (it hosts the workers' store and writes the manifests), the other."""
    first, second = agents
    return (first, second) if 0 in first.worker_ranks() else (second, first)


def seconds_to_train_alone(base: Path, fault_at: float) -> float:
    """Seconds from the fault to the first finished step at world size 1 (waits for it)."""
    wait_for(lambda: first_step_after(base, fault_at, 1) is not None, SHRINK_BOUND_S + 30, "a step at world size 1")
    at = first_step_after(base, fault_at, 1)
    assert at is not None
    return at - fault_at


def exit_code(agent: Agent, timeout: float) -> int | None:
    """The agent's exit code once it ends, or None if it is still running after ``timeout``."""
    try:
        return agent.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def report(what: str, **values: object) -> None:
    """The measurement, for docs/fault-tolerance.md (shown with ``pytest -s`` or on failure)."""
    print(f"\nmeasured, {what}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


def outputs(*agents: Agent) -> str:
    return "\n".join(f"--- agent {a.name}\n{a.output[-3000:]}" for a in agents)


def assert_exactly_once_and_one_lineage(base: Path, reference: Path, epochs: int) -> None:
    assert samples(base) == samples(reference, epochs), "a sample was skipped or repeated across the fault"
    assert_one_lineage(base)


LISTEN = "import socket, sys; s = socket.create_server((sys.argv[1], 5000)); print('listening', flush=True); s.accept()"
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 5000), timeout=2)"


@pytest.mark.netns
def test_bridged_hosts_reach_each_other_until_a_link_is_cut_and_leave_nothing_behind(netns_available: None) -> None:
    def connects(src: Host, dst: Host) -> bool:
        command = src.command([sys.executable, "-c", CONNECT, dst.addr])
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0

    with bridged_hosts(["a", "b"]) as made:
        a, b = made["a"], made["b"]
        server = subprocess.Popen(b.command([sys.executable, "-c", LISTEN, b.addr]), stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        b.set_link(up=False)
        assert not connects(a, b), "a cut link still carried traffic"
        b.set_link(up=True)
        # The failed neighbour (ARP) entry of the cut lingers a few seconds: retry, as TCP does.
        wait_for(lambda: connects(a, b), 30, "traffic over the healed link")
        assert server.wait(timeout=30) == 0, "the listener never saw the connection"
        sleeper = subprocess.Popen(b.command(["sleep", "300"]))
        assert sleeper.pid in b.pids()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL, "a process inside a namespace outlived it"
    assert not [n for n in (a.netns, b.netns) if n in ip("netns", "list")], "namespaces left behind"


def test_a_frozen_node_is_dropped_and_the_survivor_trains_every_sample_exactly_once(
    tmp_path: Path, agents: list[Agent], reference: Path
) -> None:
    with rendezvous_store(tmp_path) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "frozen-node", RUN) for n in ("a", "b")]
        wait_for(lambda: committed(tmp_path, 4), 120, "a checkpoint at step 4")
        frozen, survivor = rank0_node_and_other(agents)
        frozen_at = frozen.freeze()  # agent and worker: no socket closes, no process exits
        shrink_s = seconds_to_train_alone(tmp_path, frozen_at)
        thawed_at = frozen.thaw()  # a stale node is back mid-run: it must not fork the timeline
        survivor_code = survivor.wait(120)
        frozen_code = exit_code(frozen, 45)  # it rejoins and finishes, or gives up; else killed
    grow = first_step_after(tmp_path, thawed_at, 2)
    report(
        "frozen node",
        shrink_s=round(shrink_s, 1),
        regrow_after_thaw_s=None if grow is None else round(grow - thawed_at, 1),
        frozen_node_exit=frozen_code,
    )
    assert survivor_code == 0, outputs(survivor, frozen)
    assert any(event_time(e) > frozen_at for e in all_events(tmp_path, "hang_detected")), "no watchdog fired"
    assert shrink_s < SHRINK_BOUND_S, f"the survivor trained alone {shrink_s:.1f}s after the freeze"
    assert_exactly_once_and_one_lineage(tmp_path, reference, epochs=2)


@pytest.mark.netns
def test_a_partitioned_node_is_dropped_and_the_survivor_trains_every_sample_exactly_once(
    tmp_path: Path, agents: list[Agent], hosts: dict[str, Host], reference: Path
) -> None:
    with rendezvous_store(tmp_path, hosts["store"]) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "partition", RUN, host=hosts[n]) for n in ("a", "b")]
        wait_for(lambda: committed(tmp_path, 4), 120, "a checkpoint at step 4")
        cut, survivor = rank0_node_and_other(agents)
        cut_at = hosts[cut.name].set_link(up=False)
        shrink_s = seconds_to_train_alone(tmp_path, cut_at)
        survivor_code = survivor.wait(120)
        cut_code = cut.exited()  # None: still waiting for a store it cannot reach (killed at the end)
    report("partition", shrink_s=round(shrink_s, 1), cut_node_exit=cut_code)
    assert survivor_code == 0, outputs(survivor, cut)
    assert shrink_s < SHRINK_BOUND_S, f"the survivor trained alone {shrink_s:.1f}s after the cut"
    assert_exactly_once_and_one_lineage(tmp_path, reference, epochs=2)


@pytest.mark.netns
def test_a_partition_that_heals_after_the_shrink_never_forks_the_checkpoint_lineage(
    tmp_path: Path, agents: list[Agent], hosts: dict[str, Host], reference: Path
) -> None:
    with rendezvous_store(tmp_path, hosts["store"]) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "partition-heals", HEAL_RUN, host=hosts[n]) for n in ("a", "b")]
        wait_for(lambda: committed(tmp_path, 4), 120, "a checkpoint at step 4")
        cut, survivor = rank0_node_and_other(agents)
        cut_at = hosts[cut.name].set_link(up=False)
        shrink_s = seconds_to_train_alone(tmp_path, cut_at)
        healed_at = hosts[cut.name].set_link(up=True)
        survivor_code = survivor.wait(120)
        returned_code = exit_code(cut, 60)
    grow = first_step_after(tmp_path, healed_at, 2)
    report(
        "partition heals",
        shrink_s=round(shrink_s, 1),
        regrow_after_heal_s=None if grow is None else round(grow - healed_at, 1),
        returned_node_exit=returned_code,
    )
    assert survivor_code == 0, outputs(survivor, cut)
    assert returned_code is not None, f"the returned node neither rejoined to the end nor gave up\n{outputs(cut)}"
    if grow is not None:  # it rejoined as a new member, so it trained to the end with the survivor
        assert returned_code == 0, outputs(cut)
    assert shrink_s < SHRINK_BOUND_S, f"the survivor trained alone {shrink_s:.1f}s after the cut"
    assert_exactly_once_and_one_lineage(tmp_path, reference, epochs=HEAL_EPOCHS)
