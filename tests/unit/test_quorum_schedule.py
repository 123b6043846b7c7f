"""The quorum mode's data order: exactly once per epoch however the membership changes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.data.sampler import global_batches
from elastic_train.quorum.schedule import QuorumSchedule


@given(
    num_samples=st.integers(8, 300),
    global_batch=st.integers(1, 16),
    step=st.integers(0, 60),
    world=st.integers(1, 16),
)
def test_any_membership_covers_the_steps_global_batch_exactly_once(
    num_samples: int, global_batch: int, step: int, world: int
) -> None:
    if world > global_batch or num_samples < global_batch:
        return
    schedule = QuorumSchedule(num_samples, global_batch, seed=3)
    shares = [schedule.share(step, world, r) for r in range(world)]
    epoch, batch = schedule.position(step)
    expected = global_batches(num_samples, global_batch, 3, epoch)[batch].tolist()
    assert [i for s in shares for i in s.indices] == expected  # a partition, in order
    assert max(len(s.indices) for s in shares) - min(len(s.indices) for s in shares) <= 1
    # DDP averages the W weighted means: sum_r w_r / W = 1, so the update is the batch's mean.
    assert sum(s.weight for s in shares) == pytest.approx(world)


@settings(max_examples=60)
@given(
    data=st.data(),
    num_samples=st.integers(16, 200),
    global_batch=st.integers(2, 12),
)
def test_failed_attempts_redone_over_new_memberships_commit_every_sample_once_per_epoch(
    data: st.DataObject, num_samples: int, global_batch: int
) -> None:
    """A run where some attempts fail (discarded) and are redone with another quorum size."""
    schedule = QuorumSchedule(num_samples, global_batch, seed=11)
    epochs = 2
    committed: dict[int, Counter[int]] = {e: Counter() for e in range(epochs)}
    for step in range(epochs * schedule.batches_per_epoch):
        for _failed in range(data.draw(st.integers(0, 2))):
            world = data.draw(st.integers(1, global_batch))
            _ = [schedule.share(step, world, r) for r in range(world)]  # trained, then discarded
        world = data.draw(st.integers(1, global_batch))
        for r in range(world):
            share = schedule.share(step, world, r)
            committed[share.epoch].update(share.indices)
    for epoch in range(epochs):
        assert all(count == 1 for count in committed[epoch].values()), "a sample trained twice in an epoch"
        assert len(committed[epoch]) == schedule.batches_per_epoch * global_batch


def test_a_membership_larger_than_the_global_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot share a global batch of 4"):
        QuorumSchedule(100, 4, seed=0).share(0, 5, 0)
