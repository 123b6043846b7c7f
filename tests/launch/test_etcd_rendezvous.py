"""Restart mode over a replicated rendezvous: torch's etcd-v2 backend on a three-member etcd
(``python -m elastic_train.etcd_member``), agents started by jobs/elastic-agent.sh with
``ET_RDZV_BACKEND=etcd``. The rendezvous must outlive the loss of the member every agent talks
to, together with a node: the survivor re-forms through the other members, a replacement node
joins through them, and every sample is trained exactly once on one checkpoint lineage.

Needs Debian's etcd-server and python-etcd; skips without them, unless
ELASTIC_TRAIN_REQUIRE_ETCD=1 (set by .ci/run): then it fails.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastic_train.testing.agents import Agent, all_events, event_time, wait_for
from elastic_train.testing.etcd import etcd_cluster, require_etcd
from tests.impolite import RUN, assert_exactly_once_and_one_lineage, committed, outputs, report

pytestmark = pytest.mark.timeout(300)
# Long enough that the survivor trains alone for a while and the replacement joins before the end.
LONG = [*RUN, "--epochs", "3", "--hang-timeout", "60"]


@pytest.fixture(autouse=True)
def etcd_here() -> None:
    require_etcd()


def world_sizes_after(base: Path, since: float) -> list[int]:
    return [e["world_size"] for e in all_events(base, "first_step") if event_time(e) > since]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_losing_the_etcd_member_and_a_node_at_once_is_survived_exactly_once(
    tmp_path: Path, agents: list[Agent], fault: str
) -> None:
    # killed: its sockets close, python-etcd moves on at once. frozen (SIGSTOP): connections hang
    # until the agent's etcd read timeout (ET_ETCD_READ_TIMEOUT, 5 s), then it moves on.
    with etcd_cluster(tmp_path) as members:
        endpoints = ",".join(m.client for m in members)
        env = {"ET_RDZV_BACKEND": "etcd"}
        agents += [Agent(n, tmp_path, endpoints, "etcd-loss", LONG, env=env) for n in ("a", "b")]
        wait_for(lambda: committed(tmp_path, 4), 120, "a checkpoint at step 4")
        # Both agents picked the first member: it is the one whose loss matters.
        assert all(f"rendezvous etcd-v2 {members[0].client}" in a.output for a in agents), outputs(*agents)
        lost_at = members[0].kill() if fault == "killed" else members[0].freeze()
        agents[1].kill_node()
        wait_for(lambda: 1 in world_sizes_after(tmp_path, lost_at), 90, "the survivor training alone")
        shrink_s = min(event_time(e) for e in all_events(tmp_path, "first_step") if event_time(e) > lost_at) - lost_at
        joined = Agent("c", tmp_path, endpoints, "etcd-loss", LONG, env=env)  # its pick skips the dead member
        agents.append(joined)
        assert agents[0].wait(240) == 0 and joined.wait(60) == 0, outputs(agents[0], joined)
    grown = [e for e in all_events(tmp_path, "first_step") if e["world_size"] == 2 and event_time(e) > joined.started]
    regrow_s = round(event_time(grown[0]) - joined.started, 1) if grown else None
    report(f"etcd member {fault} and node lost", shrink_s=round(shrink_s, 1), regrow_s=regrow_s)
    assert f"rendezvous etcd-v2 {members[1].client}" in joined.output, joined.output[-2000:]
    assert grown, "the replacement node never joined the survivor"
    # A node loss's cost plus, frozen, the read timeout; far beyond it would mean a wait on torch's
    # 60 s default or a restart budget spent.
    assert shrink_s < 45, f"the survivor trained alone only {shrink_s:.1f} s after the loss"
    assert_exactly_once_and_one_lineage(tmp_path, LONG)


def test_without_replication_the_same_loss_ends_the_survivor_with_a_failure(
    tmp_path: Path, agents: list[Agent]
) -> None:
    # The control: one member, the store's host, lost with the node. The survivor's agent cannot
    # re-form and exits non-zero; the checkpoints stay for the requeue.
    with etcd_cluster(tmp_path, size=1) as (member,):
        env = {"ET_RDZV_BACKEND": "etcd"}
        agents += [Agent(n, tmp_path, member.client, "etcd-single", LONG, env=env) for n in ("a", "b")]
        wait_for(lambda: committed(tmp_path, 4), 120, "a checkpoint at step 4")
        lost_at = member.kill()
        agents[1].kill_node()
        code = agents[0].wait(120)
    report("the only etcd member and a node lost", survivor_exit=code, ended_after_s=round(time.time() - lost_at, 1))
    assert code != 0, outputs(agents[0])
    assert 1 not in world_sizes_after(tmp_path, lost_at), "the survivor trained on without a rendezvous"
    assert committed(tmp_path, 4), "a checkpoint was lost"


def test_an_agent_given_no_live_member_fails_naming_them(tmp_path: Path) -> None:
    with etcd_cluster(tmp_path) as members:
        endpoints = ",".join(m.client for m in members)
        for member in members:
            member.kill()
        env = {"ET_RDZV_BACKEND": "etcd", "ET_JOIN_TIMEOUT": "2"}
        agent = Agent("a", tmp_path, endpoints, "etcd-none", RUN, env=env)
        try:
            code = agent.wait(60)
        finally:
            agent.cleanup()
    assert code != 0
    assert f"no etcd member of {endpoints} answered" in agent.output, agent.output[-2000:]
