"""Reading boxes of sharded tensors from safetensors pieces: exact at any pair of world sizes
(1..4, uneven rows, a scalar, bf16), only what overlaps, and damage named, never zero-filled."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint.box_reader import SavedPiece, read_box, verify_files
from elastic_train.checkpoint.format import CheckpointInvalid, FileEntry
from elastic_train.checkpoint.shard_plan import Box, dim0_plan
from elastic_train.checkpoint.tensor_io import write_shard

TENSORS = {
    "w": torch.randn(7, 5, generator=torch.Generator().manual_seed(0)),
    "b": torch.arange(5, dtype=torch.int64),
    "e": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "s": torch.tensor(3.5),  # a scalar: saved whole, by rank 0
    "z": torch.zeros(0, 4),  # no rows at all
}


def plan(name: str, world: int) -> list[Box]:
    """Each rank's box; a scalar is not sharded: rank 0 alone holds it, whole."""
    shape = tuple(TENSORS[name].shape)
    return dim0_plan(shape, world) if shape else [Box.whole(shape)]


def save(folder: Path, world: int) -> tuple[dict[str, list[SavedPiece]], dict[str, FileEntry]]:
    """What ``world`` ranks write: rank r's pieces in file r, with their boxes."""
    folder.mkdir(parents=True)
    pieces: dict[str, list[SavedPiece]] = {name: [] for name in TENSORS}
    entries = {}
    for rank in range(world):
        local = {}
        for name, tensor in TENSORS.items():
            boxes = plan(name, world)
            if rank >= len(boxes):
                continue
            box = boxes[rank]
            local[name] = tensor[box.relative_to(Box.whole(tuple(tensor.shape)))].contiguous()
            pieces[name].append(SavedPiece(f"shard-{rank}.safetensors", name, box))
        entries[f"shard-{rank}.safetensors"] = write_shard(folder / f"shard-{rank}.safetensors", local, {})
    return pieces, entries


@pytest.mark.parametrize(("saved_at", "loaded_at"), list(itertools.product((1, 2, 3, 4), repeat=2)))
def test_every_box_at_any_world_size_is_read_exactly(tmp_path: Path, saved_at: int, loaded_at: int) -> None:
    pieces, entries = save(tmp_path / "ckpt", saved_at)
    verify_files(tmp_path / "ckpt", entries, entries)
    for name, tensor in TENSORS.items():
        for box in plan(name, loaded_at):
            got = read_box(tmp_path / "ckpt", pieces[name], box, tensor.dtype)
            want = tensor[box.relative_to(Box.whole(tuple(tensor.shape)))]
            assert got.dtype == tensor.dtype and torch.equal(got, want), (name, box)


def test_a_box_reads_only_the_files_that_overlap_it(tmp_path: Path) -> None:
    pieces, _ = save(tmp_path / "ckpt", 4)
    (tmp_path / "ckpt" / "shard-3.safetensors").unlink()  # rows 6..7 of w: not needed for rows 0..3
    first_half = dim0_plan((7, 5), 2)[0]
    assert torch.equal(read_box(tmp_path / "ckpt", pieces["w"], first_half, torch.float32), TENSORS["w"][:4])


def test_damage_is_named_and_nothing_is_zero_filled(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    pieces, entries = save(folder, 2)
    with pytest.raises(CheckpointInvalid, match="hold 20 of the 35 elements"):
        read_box(folder, pieces["w"][:1], Box.whole((7, 5)), torch.float32)
    wrong = [SavedPiece(p.file, p.key, Box(p.box.offsets, (p.box.lengths[0], 4))) for p in pieces["w"]]
    with pytest.raises(CheckpointInvalid, match="has shape"):
        read_box(folder, wrong, Box((0, 0), (7, 4)), torch.float32)
    with pytest.raises(CheckpointInvalid, match=r"the manifest says torch\.float64"):
        read_box(folder, pieces["w"], Box.whole((7, 5)), torch.float64)
    path = folder / "shard-1.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointInvalid, match=r"shard-1\.safetensors: checksum mismatch"):
        verify_files(folder, entries, entries)
    with pytest.raises(CheckpointInvalid, match="not listed in the manifest"):
        verify_files(folder, ["shard-9.safetensors"], entries)
