"""A frozen node with real torchrun agents: SIGSTOP of a node's agent and worker (a kernel stall,
a paused VM). Nothing exits and no socket closes; the survivor's watchdog ends the wait, the job
shrinks, and the thawed node must not fork the timeline (tests/impolite.py has the shared story).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_train.testing.agents import Agent, all_events, event_time, first_step_after, rendezvous_store, wait_for
from tests.impolite import (
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


def test_a_frozen_node_is_dropped_and_the_survivor_trains_every_sample_exactly_once(
    tmp_path: Path, agents: list[Agent]
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
    assert_exactly_once_and_one_lineage(tmp_path, RUN)
