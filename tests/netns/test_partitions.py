"""A network partition with real torchrun agents, and its healing.

Each node (agent and worker), and the rendezvous store, lives in a network namespace of its own
on a private bridge (elastic_train/testing/netns.py); a partition brings a node's only link down:
packets vanish, nothing is closed (tests/impolite.py has the shared story). These tests need root
and iproute2 and skip without them, unless ELASTIC_TRAIN_REQUIRE_NETNS=1 (set by .ci/run): then
they fail.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_train.testing.agents import Agent, first_step_after, rendezvous_store, wait_for
from elastic_train.testing.netns import Host, bridged_hosts, ip, require_netns
from tests.impolite import (
    HEAL_RUN,
    RUN,
    SHRINK_BOUND_S,
    assert_exactly_once_and_one_lineage,
    committed,
    exit_code,
    outputs,
    rank0_node_and_other,
    report,
    seconds_to_train_alone,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def netns_available() -> None:
    """Skip (or fail, in CI) where namespaces cannot be made: before any agent starts."""
    require_netns()


@pytest.fixture
def hosts(netns_available: None) -> Iterator[dict[str, Host]]:
    """Namespaces for the store and two nodes, on a private bridge; deleted after the test."""
    with bridged_hosts(["store", "a", "b"]) as made:
        yield made


LISTEN = "import socket, sys; s = socket.create_server((sys.argv[1], 5000)); print('listening', flush=True); s.accept()"
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 5000), timeout=2)"


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
        # `ip netns exec` enters the namespace right after it starts: wait for that, not a fixed time.
        wait_for(lambda: sleeper.pid in b.pids(), 10, "the sleeper inside namespace b")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL, "a process inside a namespace outlived it"
    assert not [n for n in (a.netns, b.netns) if n in ip("netns", "list")], "namespaces left behind"


def test_a_partitioned_node_is_dropped_and_the_survivor_trains_every_sample_exactly_once(
    tmp_path: Path, agents: list[Agent], hosts: dict[str, Host]
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
    assert_exactly_once_and_one_lineage(tmp_path, RUN)


def test_a_partition_that_heals_after_the_shrink_never_forks_the_checkpoint_lineage(
    tmp_path: Path, agents: list[Agent], hosts: dict[str, Host]
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
    assert_exactly_once_and_one_lineage(tmp_path, HEAL_RUN)
