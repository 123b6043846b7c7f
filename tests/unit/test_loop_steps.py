"""LoopSteps for a custom loop (issue 19): restart mode's steps are the trainer's sampler plan.

A loop written against ``LoopSteps`` must train, in restart mode, exactly the samples the
built-in trainer's ``GlobalBatchSampler`` gives each rank (so the two ways in cannot drift), and
resume where its checkpoint says; quorum mode cuts the same global batches (``QuorumSchedule``,
tests/unit/test_quorum_schedule.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import elastic_train as et


@given(
    num_samples=st.integers(1, 300),
    global_batch=st.integers(1, 40),
    world=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    epochs=st.integers(1, 3),
)
def test_restart_steps_cut_the_samplers_batches_for_every_rank_step_by_step(
    num_samples: int, global_batch: int, world: int, seed: int, epochs: int
) -> None:
    if num_samples < global_batch or world > global_batch:
        return
    schedule = et.QuorumSchedule(num_samples, global_batch, seed)
    for rank in range(world):
        steps = et.RestartSteps(schedule, et.DistEnv(rank=rank, world_size=world), torch.device("cpu"))
        sampler = et.GlobalBatchSampler(num_samples, global_batch, world, rank, seed)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch, expected in enumerate(sampler):
                attempt = steps.begin_step()
                assert (attempt.world, attempt.rank) == (world, rank)
                assert (attempt.share.epoch, attempt.share.batch) == (epoch, batch)
                assert list(attempt.share.indices) == [i for _, i in expected]
                assert attempt.share.weight == sampler.loss_weight(len(expected))
                assert steps.commit(lambda: None)


def test_restart_steps_commit_applies_once_and_resume_continues_at_the_checkpoints_step() -> None:
    schedule = et.QuorumSchedule(100, 10, seed=3)
    steps = et.RestartSteps(schedule, et.DistEnv(rank=1, world_size=3), torch.device("cpu"))
    applied: list[int] = []
    assert steps.begin_step().step == 0
    assert steps.commit(lambda: applied.append(steps.committed_steps)) and applied == [0]
    assert steps.committed_steps == 1
    steps.resume_at(17)
    attempt = steps.begin_step()
    assert attempt.step == 17 and (attempt.share.epoch, attempt.share.batch) == (1, 7)
    assert attempt.share == schedule.share(17, 3, 1) and attempt.heal is None
    with pytest.raises(ValueError, match=">= 0"):
        steps.resume_at(-1)


@pytest.mark.usefixtures("world_of_one")
def test_restart_steps_average_the_extras_over_the_group_and_keep_their_dtype() -> None:
    steps = et.RestartSteps(et.QuorumSchedule(8, 4, 0), et.DistEnv(), torch.device("cpu"))
    loss_sum = torch.tensor(3.5, dtype=torch.float32)
    counts = torch.tensor([2.0, 5.0], dtype=torch.float64)
    assert steps.average_gradients([], extras=[loss_sum, counts])
    assert loss_sum.dtype == torch.float32 and float(loss_sum) == 3.5
    assert counts.tolist() == [2.0, 5.0]
    assert isinstance(steps.wrap(torch.nn.Linear(2, 2)), torch.nn.parallel.DistributedDataParallel)
