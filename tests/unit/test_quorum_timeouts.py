"""Quorum mode's bounds (``elastic_train.quorum.timeouts``): inside the watchdog, fitted to the job."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_train.errors import UsageError
from elastic_train.quorum.timeouts import MIN_HEAL_S, MIN_QUORUM_S, PHASE_SHARE, WaitBound, phase_bounds


@given(st.floats(min_value=(MIN_QUORUM_S + MIN_HEAL_S) / PHASE_SHARE, max_value=1e6))
def test_a_quorum_wait_plus_a_heal_always_ends_inside_the_watchdogs_limit(hang: float) -> None:
    bounds = phase_bounds(hang)
    assert bounds.quorum_s >= MIN_QUORUM_S and bounds.heal_s >= MIN_HEAL_S - 1e-9
    assert bounds.quorum_s + bounds.heal_s <= PHASE_SHARE * hang + 1e-9 < hang


def test_a_watchdog_too_short_for_a_quorum_and_a_heal_is_refused_naming_the_fix() -> None:
    with pytest.raises(UsageError, match=r"--hang-timeout 8 .*pass --hang-timeout 11 or more"):
        phase_bounds(8)
    assert phase_bounds(0).quorum_s > 0  # no watchdog: fixed bounds


def test_the_first_wait_of_a_membership_is_measured_then_the_bound_follows_it() -> None:
    bound = WaitBound(floor_s=2.0, ceiling_s=30.0)
    assert bound.seconds() == 30.0  # nothing measured: up to the ceiling
    bound.record(2.2)  # a slow link: 2.2 s per average
    assert bound.seconds() == pytest.approx(2.0 + 2 * 2.2)
    bound.failed(bound.seconds())  # ran into its bound: a busier moment
    assert bound.seconds() == pytest.approx(2 * (2.0 + 2 * 2.2))
    bound.failed(0.01)  # a dead peer's closed socket: nothing to learn
    assert bound.seconds() == pytest.approx(2 * (2.0 + 2 * 2.2))
    bound.record(0.1)
    assert bound.seconds() == pytest.approx(2.0 + 2 * 2.2)  # the slowest recent wait still counts
    bound.new_membership()
    assert bound.seconds() == 30.0


def test_a_peer_timeout_longer_than_the_watchdog_allows_is_refused() -> None:
    with pytest.raises(UsageError, match="lower --peer-timeout or raise --hang-timeout"):
        WaitBound(floor_s=40.0, ceiling_s=30.0)
