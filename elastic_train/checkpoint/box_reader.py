"""Reading one rank's box of a sharded tensor from the pieces other ranks saved.

A load at another world size (or from a DDP checkpoint's whole tensors into FSDP pieces) needs,
per tensor, only the part of each saved piece that overlaps its own box (``shard_plan.reads_for``).
safetensors maps each file and hands out slices, so a rank holds its box and one slice at a
time, never a whole saved piece, let alone the whole state. Every file a rank reads from is
verified first (size and xxh3 over the whole file, streamed): a slice is never trusted from a
file that may be damaged elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elastic_train.checkpoint.format import CheckpointInvalid, FileEntry, check_entry, read_retrying
from elastic_train.checkpoint.shard_plan import Box, reads_for
from elastic_train.checkpoint.tensor_io import DTYPE_NAMES


@dataclass(frozen=True)
class SavedPiece:
    """One saved piece of a tensor: in ``file`` under ``key``, holding ``box`` of the global tensor."""

    file: str
    key: str
    box: Box


def verify_files(folder: Path, files: Iterable[str], entries: dict[str, FileEntry]) -> None:
    """Check each named file against the manifest's entry (``CheckpointInvalid`` names the file)."""
    for name in sorted(set(files)):
        if name not in entries:
            raise CheckpointInvalid(f"{folder / name} is read by the plan but not listed in the manifest")
        check_entry(folder / name, entries[name])


def read_box(folder: Path, pieces: Sequence[SavedPiece], target: Box, dtype: torch.dtype) -> torch.Tensor:
    """The ``target`` box of a tensor, assembled from the saved ``pieces`` that overlap it.

    Raises ``CheckpointInvalid`` when the pieces do not hold every element of the box (never
    zero-filled) or a piece's stored shape or dtype is not what the manifest says."""
    try:
        plan = reads_for(target, [p.box for p in pieces])
    except ValueError as exc:
        raise CheckpointInvalid(f"{folder}: {exc}") from None
    out = torch.empty(target.lengths, dtype=dtype)
    with ExitStack() as files:
        opened: dict[str, Any] = {}
        for read in plan:
            piece = pieces[read.piece]
            path = folder / piece.file
            if piece.file not in opened:
                opened[piece.file] = files.enter_context(
                    read_retrying(path, lambda p=path: safe_open(str(p), framework="pt"))  # type: ignore[misc]
                )
            handle = opened[piece.file]
            stored = handle.get_slice(piece.key)
            shape, kind = tuple(stored.get_shape()), stored.get_dtype()
            if shape != piece.box.lengths:
                raise CheckpointInvalid(f"{path}: {piece.key} has shape {shape}, the manifest says {piece.box.lengths}")
            if kind != DTYPE_NAMES.get(dtype):
                raise CheckpointInvalid(f"{path}: {piece.key} is {kind}, the manifest says {dtype}")
            if not read.source_slices:  # a 0-d tensor: no slicing
                out.copy_(handle.get_tensor(piece.key))
            else:
                out[read.target_slices] = stored[read.source_slices]
    return out
