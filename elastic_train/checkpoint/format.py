"""The on-disk checkpoint format: names, the manifest, and verification. No torch here.

A checkpoint is a folder ``step-<N:08d>/`` holding one ``shard-<r:05d>-of-<W:05d>.safetensors``
per rank and ``manifest.json``. It counts only once ``manifest.json`` exists and verifies: the
manifest is written last, after every shard is durable, and lists each file's size and sha256.
See docs/checkpoint-format.md.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

FORMAT = "elastic-train-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


class CheckpointInvalid(Exception):
    """A checkpoint folder that must not be trusted; the message names the file and the fault."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str  # cryptographic; checked by `python -m elastic_train.ckpt verify`
    xxh3: str  # xxh3-128, ~10x faster; checked on every load


@dataclass
class Manifest:
    """Everything that is not a tensor, plus the index of the tensors and files."""

    step: int
    epoch: int  # epochs completed
    batch_in_epoch: int  # global batches of epoch `epoch` already trained on
    world_size: int
    files: dict[str, FileEntry]
    tensors: dict[str, str]  # tensor key -> file holding it
    fingerprint: dict[str, Any]  # settings a resumed run must share (model, data, global batch, ...)
    trainer: dict[str, Any]  # scheduler, scaler, early stop, history, optimizer param groups, ...
    config: dict[str, Any]
    versions: dict[str, str]
    run_id: str = ""
    created: float = 0.0
    finished: bool = False  # saved after the last epoch: nothing left to train
    format: str = FORMAT
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointInvalid(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointInvalid(f"{source}: not an elastic-train manifest")
        if raw.get("version") != VERSION:
            raise CheckpointInvalid(f"{source}: format version {raw.get('version')} (this build reads {VERSION})")
        try:
            raw["files"] = {name: FileEntry(**entry) for name, entry in raw["files"].items()}
            return cls(**raw)
        except (TypeError, KeyError, AttributeError) as exc:
            raise CheckpointInvalid(f"{source}: malformed manifest ({exc})") from None


def file_digests(path: Path, sha256: bool) -> tuple[int, str, str]:
    """Size, xxh3-128 and (if asked) sha256 of a file, read through a memory map."""
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return 0, xxhash.xxh3_128(b"").hexdigest(), hashlib.sha256(b"").hexdigest() if sha256 else ""
        with mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                fast = xxhash.xxh3_128(view).hexdigest()
                slow = hashlib.sha256(view).hexdigest() if sha256 else ""
            finally:
                view.release()
    return size, fast, slow


def check_entry(path: Path, entry: FileEntry, sha256: bool = False) -> None:
    """Raise ``CheckpointInvalid`` naming ``path`` unless size and checksums match the manifest."""
    if not path.is_file():
        raise CheckpointInvalid(f"{path} is missing")
    size = path.stat().st_size
    if size != entry.size:
        raise CheckpointInvalid(f"{path} has {size} bytes, the manifest says {entry.size} (truncated?)")
    _, fast, slow = file_digests(path, sha256)
    if fast != entry.xxh3:
        raise CheckpointInvalid(f"{path}: checksum mismatch (xxh3), the file is corrupt")
    if sha256 and slow != entry.sha256:
        raise CheckpointInvalid(f"{path}: sha256 mismatch, the file is corrupt")


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is missing (an incomplete save)") from None
    except OSError as exc:
        raise CheckpointInvalid(f"{path}: {exc}") from None
    manifest = Manifest.from_json(text, path)
    if step_of(folder) not in (None, manifest.step):
        raise CheckpointInvalid(f"{path}: step {manifest.step} does not match the folder name")
    return manifest


def verify(folder: Path, sha256: bool = False) -> Manifest:
    """The manifest, after checking every file it lists (size, xxh3; sha256 too if asked).
    Raises ``CheckpointInvalid`` naming the file."""
    manifest = read_manifest(folder)
    for name, entry in manifest.files.items():
        check_entry(folder / name, entry, sha256)
    missing = {f for f in manifest.tensors.values() if f not in manifest.files}
    if missing:
        raise CheckpointInvalid(f"{folder / MANIFEST}: tensors point at unlisted files {sorted(missing)}")
    return manifest


def step_folders(root: Path) -> list[Path]:
    """``step-*`` folders under ``root``, newest first (committed or not)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)


def latest_target(root: Path) -> Path | None:
    """Where ``latest`` points (None if absent); a dangling link still returns its target."""
    link = root / LATEST
    if not link.is_symlink():
        return None
    return root / link.readlink()
