"""Tensors to and from one safetensors blob, with one copy each way.

A heal moves the whole replica state (weights and optimizer moments: 685 MB for AlexNet with
AdamW), and the survivor waits while it is staged. ``safetensors.torch.save`` copied every tensor
twice on its way into the blob (0.87 s for 685 MB on the 2-core machine) and ``load`` once more on
the way out. This writes the same format (an 8-byte little-endian header length, a JSON header of
``dtype``, ``shape`` and ``data_offsets``, the raw bytes; ``safetensors.torch.load`` reads it and
the tests check that both ways) by copying each tensor's bytes once into a preallocated buffer,
and reads it by copying each tensor's bytes once out of the received buffer into a tensor of its
own (no tensor shares storage with another: an optimizer that loads them keeps them). Only the
layout ``pack`` writes is read back: an unknown dtype, a shape or offset that is not a whole
number, an offset outside the buffer, a size that does not match the shape, a gap, an overlap or
bytes that no tensor covers raise ``ValueError``. (The transport reads a blob only after its
signature checked out; these checks keep a bug from becoming a wrong tensor.)
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import Any

import torch

from elastic_train.checkpoint.tensor_io import DTYPE_NAMES, layout

_LENGTH = struct.Struct("<Q")
# safetensors' names for torch's dtypes: the checkpoint's, and the few more the format carries.
CODES: dict[torch.dtype, str] = {
    **DTYPE_NAMES,
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
}
DTYPES = {code: dtype for dtype, code in CODES.items()}
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


def pack(tensors: dict[str, torch.Tensor]) -> memoryview:
    """The safetensors blob of ``tensors`` (CPU, contiguous): a snapshot, taken when this
    returns. Larger elements first, so every tensor starts aligned to its size. ``TypeError``
    names a tensor the format cannot carry."""
    for name, t in tensors.items():
        if t.dtype not in CODES or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(
                f"tensor {name} ({t.dtype}, {t.device.type}, contiguous: {t.is_contiguous()}) cannot go into a "
                f"safetensors blob: it carries contiguous CPU tensors of {', '.join(map(str, CODES))}"
            )
    prefix, chunks = layout(tensors, {}, CODES)  # the checkpoint writer's layout, into memory
    out = torch.empty(len(prefix) + sum(c.nbytes for c in chunks), dtype=torch.uint8)
    out[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    at = len(prefix)
    for chunk in chunks:
        if chunk.nbytes:
            out[at : at + chunk.nbytes].copy_(torch.frombuffer(chunk, dtype=torch.uint8))
        at += chunk.nbytes
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
    header = json.loads(bytes(blob[_LENGTH.size : base]), parse_constant=_no_constant)
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
        if not 0 <= begin <= end <= total - base or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit {shape} of {dtype} in the blob")
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except RuntimeError as exc:  # a shape whose strides overflow (its size was checked above)
            raise ValueError(f"tensor {name!r}: shape {shape}: {exc}") from None
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


def _no_constant(name: str) -> Any:
    raise ValueError(f"a tensor blob's header holds {name}")


def _whole(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 62  # a JSON true is a bool, not an int, here


def _entry(name: str, entry: Any) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    """An entry exactly as ``pack`` writes it: a known dtype, a list of whole numbers, two offsets."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise ValueError(f"tensor {name!r}: not a known dtype ({str(entry)[:80]})")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise ValueError(f"tensor {name!r}: shape {str(shape)[:80]} is not a list of whole numbers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(v) for v in offsets):
        raise ValueError(f"tensor {name!r}: data_offsets {str(offsets)[:80]} are not two whole numbers")
    return DTYPES[entry["dtype"]], shape, (offsets[0], offsets[1])
