"""Sharding invariants of the world-size-independent sampler, as hypothesis properties."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.data.sampler import (
    EvalBatchSampler,
    GlobalBatchSampler,
    epoch_permutation,
    eval_shard,
    global_batches,
    rank_slice,
)


@st.composite
def layouts(draw: st.DrawFn, max_world: int = 8) -> tuple[int, int, int, int, int]:
    """(num_samples, global_batch, world_size, seed, epoch) with global_batch % world_size == 0."""
    world = draw(st.integers(1, max_world))
    global_batch = world * draw(st.integers(1, 12))
    num_samples = draw(st.integers(global_batch, 400))
    return num_samples, global_batch, world, draw(st.integers(0, 2**31)), draw(st.integers(0, 50))


def rank_batches(n: int, g: int, w: int, seed: int, epoch: int, start: int = 0) -> list[list[list[int]]]:
    """[rank][step] -> indices, through the real sampler."""
    out = []
    for r in range(w):
        sampler = GlobalBatchSampler(n, g, w, r, seed)
        sampler.set_epoch(epoch, start)
        out.append([[i for e, i in batch if e == epoch] for batch in sampler])
    return out


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


@given(layouts(), st.integers(1, 8))
def test_global_batches_are_identical_for_every_world_size(layout: tuple[int, ...], other_world: int) -> None:
    n, g, w, seed, epoch = layout
    g2 = g * other_world  # a global batch both world sizes divide
    if g2 > n:
        n = g2
    base = rank_batches(n, g2, 1, seed, epoch)[0]
    for world in (w, other_world):
        per_rank = rank_batches(n, g2, world, seed, epoch)
        assert all(len(rank) == len(base) for rank in per_rank), "ranks disagree on the number of steps"
        for step, expected in enumerate(base):
            # Concatenating the ranks' slices in rank order rebuilds the global batch exactly.
            assert [i for rank in per_rank for i in rank[step]] == expected


@given(layouts(), st.data())
def test_resume_at_any_step_and_any_world_size_covers_the_epoch_exactly_once(
    layout: tuple[int, ...], data: st.DataObject
) -> None:
    n, g, w, seed, epoch = layout
    steps = n // g
    cut = data.draw(st.integers(0, steps), label="batches consumed before the restart")
    new_world = data.draw(st.sampled_from([d for d in range(1, 9) if g % d == 0]), label="new world size")
    before = [i for rank in rank_batches(n, g, w, seed, epoch) for batch in rank[:cut] for i in batch]
    after = [i for rank in rank_batches(n, g, new_world, seed, epoch, start=cut) for batch in rank for i in batch]
    assert Counter(before + after) == Counter(global_batches(n, g, seed, epoch).flatten().tolist())


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
        assert all(len(b) == g // w and all(e == epoch for e, _ in b) for b in batches)


def test_max_steps_per_epoch_truncates_to_the_first_global_batches() -> None:
    full = global_batches(100, 10, 0, 3)
    capped = global_batches(100, 10, 0, 3, max_steps=4)
    assert torch.equal(capped, full[:4])


def test_bad_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        GlobalBatchSampler(100, 10, 3, 0, 0)
    with pytest.raises(ValueError, match="cannot fill"):
        GlobalBatchSampler(5, 8, 2, 0, 0)
    with pytest.raises(ValueError):
        rank_slice(torch.arange(10), 3, 0)
    sampler = GlobalBatchSampler(100, 10, 2, 0, 0)
    with pytest.raises(ValueError, match="start batch"):
        sampler.set_epoch(0, 11)
