"""Where each piece of a sharded tensor lives: boxes, plans, and what a reader needs. No torch here.

A sharded tensor (an FSDP2 parameter, its optimizer moments) is saved by each rank as the piece
it holds: a *box* of the global tensor, given by an offset and a length per dimension. The
manifest records every tensor's global shape and dtype and each saved box, so that a load at any
world size computes, for the box it must fill, which saved boxes overlap it and which slice of
each to read (``reads_for``): no rank ever holds more than its own piece plus what it reads.

FSDP2 shards dimension 0 as ``torch.chunk`` does (``Shard(0)``): pieces of ``ceil(n / W)`` rows,
the last ones shorter or empty (5 rows on 4 ranks: 2, 2, 1, 0). ``dim0_plan`` reproduces it;
``tests/unit/test_shard_plan.py`` checks that every plan covers every element exactly once at
any world size and that a save at one world size read back at another is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a tensor: ``offsets[d] <= i_d < offsets[d] + lengths[d]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"a box needs one offset per length: {self.offsets} vs {self.lengths}")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise ValueError(f"negative offset or length in {self}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.lengths) and all(e <= s for e, s in zip(self.ends(), shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when they share no element."""
        if len(other.offsets) != len(self.offsets):
            raise ValueError(f"boxes of different ranks: {self} and {other}")
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = tuple(min(a, b) for a, b in zip(self.ends(), other.ends(), strict=True))
        if any(e <= s for s, e in zip(starts, ends, strict=True)):
            return None
        box = Box(starts, tuple(e - s for s, e in zip(starts, ends, strict=True)))
        return None if box.empty else box

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices of the array that holds ``outer`` (which contains it)."""
        return tuple(
            slice(o - base, o - base + n) for o, n, base in zip(self.offsets, self.lengths, outer.offsets, strict=True)
        )

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}

    @classmethod
    def from_json(cls, raw: dict[str, list[int]]) -> Box:
        return cls(tuple(int(v) for v in raw["offsets"]), tuple(int(v) for v in raw["lengths"]))


def dim0_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s rows under ``Shard(0)`` (``torch.chunk``'s split)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    chunk = -(-rows // world_size) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def dim0_plan(shape: Sequence[int], world_size: int) -> list[Box]:
    """Each rank's box of a tensor of ``shape`` sharded on dimension 0. A 0-d tensor cannot be
    sharded (FSDP2 keeps scalars whole): the caller saves it as one whole box."""
    if not shape:
        raise ValueError("a 0-d tensor has no dimension 0 to shard: save it whole (Box.whole(()))")
    boxes = []
    for rank in range(world_size):
        start, length = dim0_rows(shape[0], world_size, rank)
        boxes.append(Box((start, *(0 for _ in shape[1:])), (length, *shape[1:])))
    return boxes


def covers_exactly_once(shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Whether ``boxes`` lie inside ``shape``, overlap nowhere, and together hold every element."""
    pieces = [b for b in boxes if not b.empty]
    if not all(b.within(shape) for b in pieces):
        return False
    if sum(b.numel for b in pieces) != math.prod(shape):
        return False
    return all(a.intersect(b) is None for i, a in enumerate(pieces) for b in pieces[i + 1 :])


@dataclass(frozen=True)
class Read:
    """Copy ``source[source_slices]`` (a saved piece) into ``target[target_slices]``."""

    piece: int  # index into the saved pieces
    source_slices: tuple[slice, ...]
    target_slices: tuple[slice, ...]


def reads_for(target: Box, saved: Sequence[Box]) -> list[Read]:
    """The reads that fill ``target`` from the ``saved`` pieces of the same tensor.

    Raises ``ValueError`` naming the first element no saved piece holds: a checkpoint whose
    pieces do not cover what a rank needs is incomplete, never silently zero-filled."""
    reads = []
    covered = 0
    for i, piece in enumerate(saved):
        if piece.empty:
            continue
        common = target.intersect(piece)
        if common is None:
            continue
        reads.append(Read(i, common.relative_to(piece), common.relative_to(target)))
        covered += common.numel
    if covered != target.numel:
        raise ValueError(f"the saved pieces hold {covered} of the {target.numel} elements of {target}")
    return reads
