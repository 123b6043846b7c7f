"""Sharding invariants of the world-size-independent sampler, as hypothesis properties.

Any world size W from 1 to the global batch G: ranks take contiguous shares that differ by at
most one sample, and the global batches do not depend on W.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.data.sampler import (
    EvalBatchSampler,
    GlobalBatchSampler,
    Share,
    epoch_permutation,
    eval_shard,
    global_batches,
    loss_weight,
    per_process_batch,
    split_evenly,
)

MAX_WORLD = 64


@st.composite
def layouts(draw: st.DrawFn, max_world: int = MAX_WORLD) -> tuple[int, int, int, int, int]:
    """(num_samples, global_batch, world_size, seed, epoch) with world_size <= global_batch."""
    world = draw(st.integers(1, max_world))
    global_batch = draw(st.integers(world, world + 40))
    num_samples = draw(st.integers(global_batch, 4 * global_batch + 10))
    return num_samples, global_batch, world, draw(st.integers(0, 2**31)), draw(st.integers(0, 50))


def rank_batches(n: int, g: int, w: int, seed: int, epoch: int, start: int = 0) -> list[list[list[int]]]:
    """[rank][step] -> indices, through the real sampler."""
    out = []
    for r in range(w):
        sampler = GlobalBatchSampler(n, g, w, r, seed)
        sampler.set_epoch(epoch, start)
        out.append([[i for e, i in batch if e == epoch] for batch in sampler])
    return out


def trained_global_batches(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """[step] -> the global batch, as the ranks' shares concatenated in rank order."""
    steps = {len(rank) for rank in per_rank}
    assert len(steps) == 1, "ranks disagree on the number of steps"
    return [[i for rank in per_rank for i in rank[step]] for step in range(steps.pop())]


@given(layouts())
def test_every_index_of_the_epoch_is_trained_exactly_once_across_ranks_and_steps(layout: tuple[int, ...]) -> None:
    n, g, w, seed, epoch = layout
    per_rank = rank_batches(n, g, w, seed, epoch)
    counts = Counter(i for rank in per_rank for batch in rank for i in batch)
    steps = n // g
    assert all(c == 1 for c in counts.values()), "an index repeated within an epoch"
    assert len(counts) == steps * g
    # What is not trained on is the dropped tail of the permutation: fewer than one global batch.
    assert set(counts) == set(epoch_permutation(n, seed, epoch)[: steps * g].tolist())
    assert n - len(counts) < g


@given(layouts(), st.data())
def test_global_batches_are_identical_for_every_world_size(layout: tuple[int, ...], data: st.DataObject) -> None:
    n, g, w, seed, epoch = layout
    other = data.draw(st.integers(1, min(g, MAX_WORLD)), label="another world size")
    expected = global_batches(n, g, seed, epoch).tolist()
    for world in (w, other):
        # Concatenating the ranks' slices in rank order rebuilds every global batch exactly.
        assert trained_global_batches(rank_batches(n, g, world, seed, epoch)) == expected


@given(layouts())
@settings(max_examples=50)
def test_shares_are_contiguous_in_rank_order_and_differ_by_at_most_one(layout: tuple[int, ...]) -> None:
    n, g, w, seed, epoch = layout
    batches = global_batches(n, g, seed, epoch).tolist()
    sizes = []
    position = 0
    for r in range(w):
        sampler = GlobalBatchSampler(n, g, w, r, seed)
        sampler.set_epoch(epoch)
        share = sampler.share
        assert share.start == position, "shares must tile the global batch in rank order"
        position = share.stop
        sizes.append(len(share))
        for step, batch in enumerate(sampler):
            assert [i for _, i in batch] == batches[step][share.start : share.stop]
    assert position == g
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    # The first G % W ranks take the extra sample, as the validation shards do.
    assert sizes == sorted(sizes, reverse=True) and sizes.count(max(sizes)) == (g % w or w)
    assert per_process_batch(g, w) == Share(min(sizes), max(sizes))


@given(st.integers(1, 500), st.integers(1, MAX_WORLD))
def test_split_evenly_tiles_any_total_over_any_number_of_parts(total: int, parts: int) -> None:
    blocks = [split_evenly(total, parts, p) for p in range(parts)]
    assert [i for b in blocks for i in b] == list(range(total))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert blocks == [eval_shard(total, parts, p) for p in range(parts)], "validation shards use the same split"


@pytest.mark.parametrize(
    ("batch", "world", "text"), [(64, 3, "21-22"), (64, 4, "16"), (64, 64, "1"), (64, 1, "64"), (10, 4, "2-3")]
)
def test_per_process_batch_reads_as_one_number_or_a_range(batch: int, world: int, text: str) -> None:
    assert str(per_process_batch(batch, world)) == text


@given(layouts(), st.data())
def test_loss_weights_make_the_ranks_average_the_global_batch_mean(
    layout: tuple[int, ...], data: st.DataObject
) -> None:
    _, g, w, _, _ = layout
    losses = data.draw(st.lists(st.floats(0, 10), min_size=g, max_size=g), label="per-sample losses")
    ranks_mean = 0.0  # what DDP computes: the average over ranks of each rank's weighted mean
    for r in range(w):
        share = split_evenly(g, w, r)
        mine = losses[share.start : share.stop]
        ranks_mean += loss_weight(len(mine), g, w) * (sum(mine) / len(mine)) / w
    assert math.isclose(ranks_mean, sum(losses) / g, rel_tol=1e-9, abs_tol=1e-12)


@given(st.integers(1, MAX_WORLD), st.integers(1, 40))
def test_equal_shares_are_not_reweighted(world: int, per_rank: int) -> None:
    # Exactly 1.0, so evenly split runs keep bitwise-identical gradients.
    assert loss_weight(per_rank, world * per_rank, world) == 1.0


def resumed_run(n: int, g: int, seed: int, epoch: int, cut: int, before: int, after: int) -> list[list[int]]:
    """The global batches trained: ``cut`` steps at world size ``before``, the rest at ``after``."""
    first = trained_global_batches(rank_batches(n, g, before, seed, epoch))[:cut]
    return first + trained_global_batches(rank_batches(n, g, after, seed, epoch, start=cut))


@pytest.mark.parametrize(("before", "after"), [(4, 3), (3, 4)])
@given(layout=layouts(max_world=1), data=st.data())
@settings(max_examples=50)
def test_mid_epoch_resume_between_3_and_4_ranks_trains_the_uninterrupted_sequence(
    before: int, after: int, layout: tuple[int, ...], data: st.DataObject
) -> None:
    n, g, _, seed, epoch = layout
    g, n = g + 3, n + 3  # at least 4 samples per global batch
    cut = data.draw(st.integers(0, n // g), label="batches consumed before the restart")
    assert resumed_run(n, g, seed, epoch, cut, before, after) == global_batches(n, g, seed, epoch).tolist()


@given(layouts(), st.data())
def test_resume_at_any_step_and_any_world_size_trains_the_uninterrupted_sequence(
    layout: tuple[int, ...], data: st.DataObject
) -> None:
    n, g, w, seed, epoch = layout
    cut = data.draw(st.integers(0, n // g), label="batches consumed before the restart")
    new_world = data.draw(st.integers(1, min(g, MAX_WORLD)), label="new world size")
    trained = resumed_run(n, g, seed, epoch, cut, w, new_world)
    # The same global batches in the same order: every sample of the epoch exactly once.
    assert trained == global_batches(n, g, seed, epoch).tolist()


@given(st.integers(2, 300), st.integers(0, 2**31), st.integers(0, 100))
def test_each_epoch_is_a_new_shuffle_of_the_same_samples(n: int, seed: int, epoch: int) -> None:
    a, b = epoch_permutation(n, seed, epoch), epoch_permutation(n, seed, epoch + 1)
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(n))
    assert torch.equal(a, epoch_permutation(n, seed, epoch)), "same (seed, epoch) must give the same order"


def test_consecutive_epochs_are_shuffled_differently() -> None:
    orders = {tuple(epoch_permutation(1000, 42, e).tolist()) for e in range(5)}
    assert len(orders) == 5


@given(st.integers(0, 500), st.integers(1, 8), st.integers(1, 64))
def test_validation_shards_are_disjoint_complete_and_unpadded(n: int, world: int, batch: int) -> None:
    shards = [eval_shard(n, world, r) for r in range(world)]
    flat = [i for s in shards for i in s]
    assert flat == list(range(n)), "shards must tile the validation set in order, each index once"
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for r in range(world):
        batches = list(EvalBatchSampler(n, batch, world, r))
        assert [i for b in batches for i in b] == list(shards[r])
        assert all(1 <= len(b) <= batch for b in batches)
        assert len(batches) == len(EvalBatchSampler(n, batch, world, r))


@given(layouts())
@settings(max_examples=50)
def test_sampler_length_matches_what_it_yields_and_items_carry_the_epoch(layout: tuple[int, ...]) -> None:
    n, g, w, seed, epoch = layout
    for r in range(w):
        sampler = GlobalBatchSampler(n, g, w, r, seed)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == n // g
        assert all(len(b) == len(split_evenly(g, w, r)) and all(e == epoch for e, _ in b) for b in batches)


def test_max_steps_per_epoch_truncates_to_the_first_global_batches() -> None:
    full = global_batches(100, 10, 0, 3)
    capped = global_batches(100, 10, 0, 3, max_steps=4)
    assert torch.equal(capped, full[:4])


def test_bad_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="cannot give each of 4 ranks a sample"):
        GlobalBatchSampler(100, 3, 4, 0, 0)
    with pytest.raises(ValueError, match="cannot give"):
        per_process_batch(3, 4)
    with pytest.raises(ValueError, match="cannot fill"):
        GlobalBatchSampler(5, 8, 2, 0, 0)
    sampler = GlobalBatchSampler(100, 10, 3, 0, 0)  # 10 over 3 ranks: no longer refused
    assert len(next(iter(sampler))) == 4
    with pytest.raises(ValueError, match="start batch"):
        sampler.set_epoch(0, 11)


@settings(max_examples=40, deadline=None)
@given(layouts(max_world=8), st.integers(1, 3))
def test_the_tests_sample_plan_is_what_every_world_sizes_ranks_digest_together(
    layout: tuple[int, int, int, int, int], epochs: int
) -> None:
    """tests/helpers.planned_samples, the oracle of the node-loss and partition tests, equals the
    SUM of every rank's own digest over each epoch at any world size."""
    from elastic_train.metrics import MetricSums
    from tests.helpers import planned_samples

    num_samples, global_batch, world, seed, _ = layout
    got = []
    for epoch in range(epochs):
        total = MetricSums(torch.device("cpu"))
        samples = 0
        for rank in range(world):
            sampler = GlobalBatchSampler(num_samples, global_batch, world, rank, seed)
            sampler.set_epoch(epoch)
            for batch in sampler:
                indices = torch.tensor([i for _, i in batch], dtype=torch.int64)
                total.add_indices(indices)
                samples += len(batch)
        got.append((epoch + 1, samples, total.digest_hex()))
    assert got == planned_samples(num_samples, global_batch, epochs, seed=seed)
