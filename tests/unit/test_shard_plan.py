"""The shard plan of sharded checkpoints: every element in exactly one piece, in its place, at any
world size; reading pieces saved at one world size into another's boxes is the identity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from elastic_train.checkpoint.shard_plan import Box, covers_exactly_once, dim0_plan, dim0_rows, reads_for

shapes = st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=4).map(tuple)
worlds = st.integers(min_value=1, max_value=64)


def pieces(array: np.ndarray, boxes: list[Box]) -> list[np.ndarray]:
    """What each rank saves: its box of the global array."""
    return [array[b.relative_to(Box.whole(array.shape))].copy() for b in boxes]


def load(target: Box, saved_boxes: list[Box], saved: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """What a loading rank assembles for ``target`` from the saved pieces, as the loader does."""
    out = np.full(target.lengths, -1, dtype=dtype)
    for read in reads_for(target, saved_boxes):
        out[read.target_slices] = saved[read.piece][read.source_slices]
    return out


@settings(max_examples=300, deadline=None)
@given(shape=shapes, world=worlds)
def test_the_dim0_plan_covers_every_element_exactly_once(shape: tuple[int, ...], world: int) -> None:
    plan = dim0_plan(shape, world)
    assert len(plan) == world
    assert covers_exactly_once(shape, plan)
    # The rows go to ranks in order, as torch.chunk hands them out.
    starts = [b.offsets[0] for b in plan if not b.empty]
    assert starts == sorted(starts)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(min_value=0, max_value=200), world=worlds)
def test_the_dim0_plan_is_torch_chunk_and_fsdp2s_shard0(rows: int, world: int) -> None:
    tensor = torch.arange(rows)
    # Shard(0)._split_tensor is what fully_shard uses for its parameters' local pieces.
    local, _ = Shard(0)._split_tensor(tensor, world, with_padding=False, contiguous=True)
    for rank in range(world):
        start, length = dim0_rows(rows, world, rank)
        assert local[rank].tolist() == list(range(start, start + length)), (rows, world, rank)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, saved_at=worlds, loaded_at=worlds)
def test_pieces_saved_at_one_world_size_load_exactly_at_another_and_back(
    shape: tuple[int, ...], saved_at: int, loaded_at: int
) -> None:
    array = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    saved_boxes = dim0_plan(shape, saved_at)
    saved = pieces(array, saved_boxes)
    target_boxes = dim0_plan(shape, loaded_at)
    loaded = [load(box, saved_boxes, saved, array.dtype) for box in target_boxes]
    for box, got in zip(target_boxes, loaded, strict=True):
        assert np.array_equal(got, array[box.relative_to(Box.whole(shape))])  # every element in its place
    back = [load(box, target_boxes, loaded, array.dtype) for box in saved_boxes]
    for original, again in zip(saved, back, strict=True):
        assert np.array_equal(original, again)


@settings(max_examples=100, deadline=None)
@given(shape=shapes, world=worlds)
def test_a_whole_tensor_loads_into_any_rank_s_box_and_any_box_into_a_whole(shape: tuple[int, ...], world: int) -> None:
    """A DDP checkpoint (whole tensors) into FSDP boxes, and FSDP pieces into a whole tensor."""
    array = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    whole = [Box.whole(shape)]
    for box in dim0_plan(shape, world):
        assert np.array_equal(load(box, whole, [array], array.dtype), array[box.relative_to(whole[0])])
    plan = dim0_plan(shape, world)
    assert np.array_equal(load(whole[0], plan, pieces(array, plan), array.dtype), array)


def test_a_missing_piece_is_named_not_zero_filled() -> None:
    plan = dim0_plan((5, 3), 2)
    with pytest.raises(ValueError, match="hold 6 of the 15 elements"):
        reads_for(Box.whole((5, 3)), plan[1:])


def test_overlapping_or_outside_pieces_do_not_cover() -> None:
    assert not covers_exactly_once((4,), [Box((0,), (3,)), Box((2,), (2,))])  # element 2 twice
    assert not covers_exactly_once((4,), [Box((0,), (3,))])  # element 3 nowhere
    assert not covers_exactly_once((4,), [Box((0,), (5,))])  # outside
    assert covers_exactly_once((), [Box.whole(())])  # a scalar, whole
    with pytest.raises(ValueError, match="0-d"):
        dim0_plan((), 2)


def test_boxes_round_trip_through_json() -> None:
    box = Box((3, 0), (2, 7))
    assert Box.from_json(box.to_json()) == box
    with pytest.raises(ValueError, match="negative"):
        Box((-1,), (2,))
