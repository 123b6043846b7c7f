"""Tensors to and from one safetensors blob, with one copy each way.

A heal moves the whole replica state (weights and optimizer moments: 685 MB for AlexNet with
AdamW), and the survivor waits while it is staged. ``safetensors.torch.save`` copied every tensor
twice on its way into the blob (0.87 s for 685 MB on the 2-core machine) and ``load`` once more on
the way out. This writes the same format (an 8-byte little-endian header length, a JSON header of
``dtype``, ``shape`` and ``data_offsets``, the raw bytes; ``safetensors.torch.load`` reads it and
the tests check that both ways) by copying each tensor's bytes once into a preallocated buffer,
and reads it by copying each tensor's bytes once out of the received buffer into a tensor of its
own (no tensor shares storage with another: an optimizer that loads them keeps them). Only what
``pack`` writes is read back: a dtype it does not know, an offset outside the buffer, a size that
does not match the shape or bytes that no tensor covers raise ``ValueError``.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import Any

import torch

_LENGTH = struct.Struct("<Q")
# safetensors' names for the dtypes a replica's state holds; anything else takes the library's path.
CODES: dict[torch.dtype, str] = {
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
}
DTYPES = {code: dtype for dtype, code in CODES.items()}
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


def packable(tensors: dict[str, torch.Tensor]) -> bool:
    return all(t.dtype in CODES and t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())


def pack(tensors: dict[str, torch.Tensor]) -> memoryview:
    """The safetensors blob of ``tensors`` (CPU, contiguous, dtypes in ``CODES``): a snapshot,
    taken when this returns. Larger elements first, so every tensor starts aligned to its size."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + _LENGTH.size) % 8)  # the data starts 8-aligned, as safetensors pads
    base = _LENGTH.size + len(text)
    out = torch.empty(base + offset, dtype=torch.uint8)
    out[:base].copy_(torch.frombuffer(bytearray(_LENGTH.pack(len(text)) + text), dtype=torch.uint8))
    for name in order:
        t = tensors[name]
        begin, end = header[name]["data_offsets"]
        if end > begin:
            out[base + begin : base + end].copy_(t.reshape(-1).view(torch.uint8))
    return out.numpy().data  # the buffer itself, no copy


def unpack(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a blob ``pack`` wrote, each copied into storage of its own."""
    total = len(blob)
    if total < _LENGTH.size:
        raise ValueError(f"a tensor blob of {total} bytes has no header")
    (length,) = _LENGTH.unpack_from(blob, 0)
    base = _LENGTH.size + length
    if length > MAX_HEADER or base > total:
        raise ValueError(f"a tensor blob's header claims {length} bytes; {total - _LENGTH.size} follow")
    header = json.loads(bytes(blob[_LENGTH.size : base]))
    if not isinstance(header, dict):
        raise ValueError("a tensor blob's header is not a JSON object")
    header.pop("__metadata__", None)
    with warnings.catch_warnings():  # a read-only buffer (bytes): only read here, never written
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(blob, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    spans: list[tuple[int, int]] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        dtype, shape, (begin, end) = _entry(name, entry)
        if not 0 <= begin <= end <= total - base or end - begin != math.prod(shape) * _size(dtype):
            raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit {shape} of {dtype} in the blob")
        tensor = torch.empty(shape, dtype=dtype)
        if end > begin:
            tensor.reshape(-1).view(torch.uint8).copy_(data[base + begin : base + end])
        tensors[name] = tensor
        spans.append((begin, end))
    covered = 0
    for begin, end in sorted(spans):
        if begin != covered:
            raise ValueError(f"a tensor blob's data has a gap or an overlap at byte {covered}")
        covered = end
    if covered != total - base:
        raise ValueError(f"a tensor blob carries {total - base - covered} bytes no tensor names")
    return tensors


class UnknownDtype(ValueError):
    """A blob holding a dtype ``pack`` never writes: one the safetensors library wrote."""


def _entry(name: str, entry: Any) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    if isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and entry["dtype"] not in DTYPES:
        raise UnknownDtype(f"tensor {name!r} is {entry['dtype']}")
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(v) for v in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"tensor {name!r}: not a known dtype, shape and offsets ({exc})") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {name!r}: negative dimension in {shape}")
    return dtype, shape, (begin, end)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
