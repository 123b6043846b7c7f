"""A saved tensor, placed the way the loading run holds it: whole, or this rank's box of it.

A checkpoint holds each tensor either whole (a DDP run's replicated state, a buffer, a scalar)
or in pieces (a sharded run's: format 4's ``Manifest.sharded``). A loading run holds each one
whole (DDP) or as a DTensor whose local part is a box of it (FSDP2), at any world size. Every
combination goes through ``placed``: it reads exactly the target box, from the whole tensor
already in memory or from the slices of the saved pieces that overlap it (``box_reader``), and
wraps it like the target. So a rank never reads another rank's part of a sharded checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from elastic_train.checkpoint.box_reader import SavedPiece, read_box
from elastic_train.checkpoint.format import CheckpointInvalid, Manifest
from elastic_train.checkpoint.shard_plan import Box
from elastic_train.checkpoint.tensor_io import DTYPE_NAMES

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor's module (~0.3 s of every
    start-up): a process that never imported it holds none."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def saved_shape(manifest: Manifest, tensors: dict[str, torch.Tensor], key: str) -> tuple[int, ...]:
    if key in tensors:
        return tuple(tensors[key].shape)
    if key in manifest.sharded:
        return tuple(manifest.sharded[key].shape)
    raise KeyError(key)


def saved_box(
    folder: Path, manifest: Manifest, tensors: dict[str, torch.Tensor], key: str, target: Box
) -> torch.Tensor:
    """The ``target`` box of saved tensor ``key`` (a view when the tensor was saved whole)."""
    whole = tensors.get(key)
    if whole is not None:
        if not target.within(tuple(whole.shape)):
            raise CheckpointInvalid(f"{folder}: {key} has shape {tuple(whole.shape)}, which holds no box {target}")
        return whole[target.relative_to(Box.whole(tuple(whole.shape)))]
    entry = manifest.sharded.get(key)
    if entry is None:
        raise KeyError(key)
    dtype = DTYPES.get(entry.dtype)
    if dtype is None:
        raise CheckpointInvalid(f"{folder}: {key} has dtype {entry.dtype}, which this build cannot read")
    pieces = [SavedPiece(p.file, key, Box(tuple(p.offsets), tuple(p.lengths))) for p in entry.pieces]
    return read_box(folder, pieces, target, dtype)


def placed(
    folder: Path, manifest: Manifest, tensors: dict[str, torch.Tensor], key: str, like: torch.Tensor | None
) -> torch.Tensor:
    """Saved tensor ``key`` as ``like`` holds it: a DTensor of the same global shape gets its
    local box on its device, mesh and placements; anything else (a plain tensor, None, another
    shape, which the strict load then names) gets the whole tensor, on the CPU."""
    shape = saved_shape(manifest, tensors, key)
    if like is None or not is_dtensor(like) or tuple(like.shape) != shape:
        return saved_box(folder, manifest, tensors, key, Box.whole(shape))
    from torch.distributed.tensor import DTensor

    from elastic_train.checkpoint.dtensor_boxes import local_box

    assert isinstance(like, DTensor)
    local = saved_box(folder, manifest, tensors, key, local_box(like))
    local = local.to(device=like.to_local().device).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
