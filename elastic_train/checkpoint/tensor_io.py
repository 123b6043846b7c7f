"""Writing and reading safetensors shards fast, with checksums, never through pickle.

Writing: the safetensors layout (8-byte little-endian header length, JSON header padded to 8
bytes, then the raw tensor bytes back to back) is streamed straight from each tensor's memory to
the file, with sha256 and xxh3-128 computed over the same bytes on the way: no intermediate
serialised copy of the shard. The result is read by the official ``safetensors`` parser.

Reading: ``safetensors.torch.load_file`` maps the file; meanwhile one thread per file checks its
size and xxh3-128, so every byte is verified before the tensors are trusted. (sha256 is the
slower, cryptographic check that ``python -m elastic_train.ckpt verify`` runs.)
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import safetensors.torch
import torch

from elastic_train.checkpoint.format import CheckpointInvalid, FileEntry, check_entry, read_retrying
from elastic_train.checkpoint.storage import atomic_file, io_retry

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_CHUNK = 16 << 20


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def layout(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype_names: dict[torch.dtype, str] = DTYPE_NAMES
) -> tuple[bytes, list[memoryview]]:
    """The safetensors prefix (length and header) and each tensor's bytes, in file order.
    ``dtype_names``: the dtypes allowed and their safetensors names (the heal's blob takes a few more)."""
    # Wider dtypes first keeps every tensor naturally aligned after the 8-byte aligned header.
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    chunks, offset = [], 0
    for name in names:
        t = tensors[name]
        if t.dtype not in dtype_names:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        raw = _raw(t)
        header[name] = {
            "dtype": dtype_names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
        chunks.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, chunks


def _pieces(prefix: bytes, chunks: list[memoryview]) -> Iterator[memoryview]:
    yield memoryview(prefix)
    for chunk in chunks:
        for start in range(0, chunk.nbytes, _CHUNK):
            yield chunk[start : start + _CHUNK]


@io_retry
def write_shard(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    before_rename: Callable[[], None] | None = None,
) -> FileEntry:
    """Write ``tensors`` as a safetensors file durably (temp, fsync, rename, fsync dir)."""
    prefix, chunks = layout(tensors, metadata)
    with atomic_file(path, before_rename) as out:
        for piece in _pieces(prefix, chunks):
            out.write(piece)
    return out.entry()


def _load_file(path: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors of one file but those in ``skip`` (pieces of sharded tensors, read later by
    box: safetensors maps the file and copies only what is asked for). safetensors' OSErrors
    carry the errno only in their text ("... (os error 5)"): given it back, so that a transient
    one is retried like any read."""
    try:
        if not skip:
            return safetensors.torch.load_file(str(path))
        with safetensors.safe_open(str(path), framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys() if key not in skip}  # noqa: SIM118
    except FileNotFoundError:
        raise
    except OSError as exc:
        found = re.search(r"os error (\d+)", str(exc))
        if exc.errno is None and found:
            raise OSError(int(found.group(1)), str(exc)) from exc
        raise


def read_shards(
    folder: Path, files: dict[str, FileEntry], skip: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``'s shards but the keys in ``skip``, each file verified (size,
    xxh3) in parallel, read or not. A storage error is retried (``read_retrying``), then raised
    as ``CheckpointUnreadable``."""
    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        checks = [pool.submit(check_entry, folder / name, entry) for name, entry in files.items()]
        try:
            for name in files:
                path = folder / name
                try:
                    tensors.update(read_retrying(path, partial(_load_file, path, skip)))
                except FileNotFoundError:
                    raise CheckpointInvalid(f"{path} is missing") from None
                except CheckpointInvalid:
                    raise
                except Exception as exc:  # any parse failure means a bad file
                    raise CheckpointInvalid(f"{path}: unreadable safetensors ({exc})") from None
        finally:
            for check in checks:
                check.result()  # re-raises CheckpointInvalid with the file name
    return tensors
