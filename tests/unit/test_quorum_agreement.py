"""The position check of quorum mode (``elastic_train.quorum.agreement``): what travels in the
attempt's SUM collective comes back exactly, and any difference between participants is seen."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic_train.checkpoint.manager import new_timeline
from elastic_train.quorum.agreement import (
    FIELDS,
    MAX_EXACT,
    LineChoice,
    QuorumPosition,
    check,
    decode,
    empty_block,
    expected_commits,
    position_block,
    timeline_key,
)

timelines = st.one_of(st.just(""), st.text("0123456789abcdef", min_size=1, max_size=16))
positions = st.builds(
    QuorumPosition,
    commits=st.integers(0, MAX_EXACT - 1),
    train_step=st.integers(0, MAX_EXACT - 1),
    epoch=st.integers(0, MAX_EXACT - 1),
    evaluating=st.booleans(),
    lineage=st.integers(0, MAX_EXACT - 1),
    timeline=timelines,
    tip=st.integers(0, (1 << 64) - 1),  # term-carrying quorum ids (``quorum.term``) reach 2^63
)


def summed(rows: list[QuorumPosition]) -> torch.Tensor:
    world = len(rows)
    total = torch.zeros_like(position_block(rows[0], 0, world))
    for rank, position in enumerate(rows):
        total += position_block(position, rank, world)
    return total


@given(st.lists(positions, min_size=1, max_size=9))
def test_every_participants_position_survives_the_sum_exactly(rows: list[QuorumPosition]) -> None:
    assert decode(summed(rows), len(rows)) == rows


@given(positions, st.integers(1, 8), st.data())
def test_any_one_field_of_any_participant_that_differs_is_a_disagreement(
    base: QuorumPosition, world: int, data: st.DataObject
) -> None:
    odd = data.draw(st.integers(0, world - 1))
    other = data.draw(positions.filter(lambda p: p != base))
    rows = [base] * world
    rows[odd] = other
    found = check(decode(summed(rows), world), rank=odd)
    if world == 1:
        assert found is None
        return
    assert found is not None
    # Participant 0 is the reference: when it is the odd one, every other participant differs.
    assert found.differing == ((odd,) if odd else tuple(range(1, world)))


def test_equal_positions_agree() -> None:
    position = QuorumPosition(56, 55, 1, False, 12345, new_timeline())
    assert check(decode(summed([position] * 3), 3), rank=2) is None


def test_a_missing_or_doubled_row_is_refused_not_misread() -> None:
    position = QuorumPosition(3, 3, 0, False, 7, "ab")
    block = summed([position, position])
    with pytest.raises(ValueError, match="no participant or by two"):
        decode(block * torch.tensor([1.0] * FIELDS + [0.0] * FIELDS, dtype=torch.float64), 2)  # participant 1 silent
    with pytest.raises(ValueError):
        decode(block * 2, 2)


def test_the_manager_step_counts_every_batch_and_every_evaluation_round() -> None:
    batches = 40
    # A continuous run: after epoch 1's 40 batches (40 commits) and its evaluation round (one more).
    assert expected_commits(train_step=batches, epoch=0) == 40
    assert expected_commits(train_step=batches, epoch=1) == 41
    assert expected_commits(train_step=55, epoch=1) == 56


@given(
    st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(1, 99))),
    st.integers(1, MAX_EXACT - 1),
    timelines,
)
def test_participant_0s_line_choice_reaches_everyone_exactly(
    checkpoint: tuple[int, int] | None, lineage: int, timeline: str
) -> None:
    choice = LineChoice(checkpoint, lineage, timeline)
    total = choice.block() + empty_block() + empty_block()
    assert LineChoice.from_block(total) == choice
    assert LineChoice.from_block(empty_block()) is None


def test_timelines_travel_as_themselves_or_as_a_stable_hash() -> None:
    t = new_timeline()
    assert timeline_key(t) == t
    assert timeline_key("not-hex timeline") == timeline_key("not-hex timeline") != "not-hex timeline"
    assert len(timeline_key("x" * 40)) == 16
