"""The heal's tensor blob (elastic_train/quorum/tensor_blob.py) and its chunked signature
(transport.body_signature): the safetensors format both ways, one copy each way, a snapshot when
packed, tensors that own their storage, malformed blobs refused, and a signature that depends on
the bytes only, not on how they were split."""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load as library_load
from safetensors.torch import save as library_save

from elastic_train.quorum import transport
from elastic_train.quorum.tensor_blob import CODES, pack, unpack

DTYPES = sorted(CODES, key=str)
shapes = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text("abcdefgh._", min_size=1, max_size=6), unique=True, max_size=6))
    out = {}
    for name in names:
        dtype, shape = draw(st.sampled_from(DTYPES)), draw(shapes)
        raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),))
        data = raw.to(torch.uint8)
        if dtype == torch.bool:
            data = data % 2
        out[name] = data.view(dtype)[: torch.Size(shape).numel()].reshape(shape).clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


@given(tensor_dicts())
def test_pack_and_unpack_round_trip_bitwise_and_speak_safetensors_both_ways(tensors: dict[str, torch.Tensor]) -> None:
    blob = pack(tensors)
    same(tensors, unpack(blob))
    same(tensors, library_load(bytes(blob)))  # what we write, the library reads
    same(tensors, unpack(library_save(tensors)))  # and the other way


def test_what_is_packed_is_the_state_when_packed_and_unpacked_tensors_own_their_storage() -> None:
    weight = torch.arange(6.0)
    blob = pack({"w": weight, "m": torch.ones(3, dtype=torch.float64), "flag": torch.tensor(True)})
    weight.add_(100)  # the survivor trains on after staging
    got = unpack(blob)
    assert torch.equal(got["w"], torch.arange(6.0))
    pointers = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(pointers) == 3, "tensors share storage: an optimizer loading them would keep one buffer"
    got["w"].add_(1)  # writable, and independent of the received buffer
    assert torch.equal(unpack(blob)["w"], torch.arange(6.0))


def blob_with(header: dict[str, object], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("blob", "says"),
    [
        (b"\x01", "has no header"),
        (struct.pack("<Q", 1000) + b"{}", "header claims 1000 bytes"),
        (blob_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "do not fit"),
        (blob_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "do not fit"),
        (
            blob_with(
                {
                    "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                    "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
                },
                b"\0" * 3,
            ),
            "gap or an overlap",
        ),
        (blob_with({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 5), "3 bytes no tensor"),
        (blob_with({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""), "not a list of whole"),
        (blob_with({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 0]}}, b""), "not a list of whole"),
        (blob_with({"a": {"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}}, b"\0\0"), "not a list of whole"),
        (blob_with({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"), "not a list of whole"),
        (blob_with({"a": {"dtype": "U8", "shape": [1], "data_offsets": ["0", 1]}}, b"\0"), "not two whole numbers"),
        (blob_with({"a": {"dtype": "C128", "shape": [], "data_offsets": [0, 16]}}, b"\0" * 16), "not a known dtype"),
        (blob_with({"a": {"dtype": "U8", "shape": [0, 2**61, 2**61], "data_offsets": [0, 0]}}, b""), "shape"),
        (struct.pack("<Q", 8) + b"Infinity", "holds Infinity"),
        (blob_with([], b""), "not a JSON object"),  # type: ignore[arg-type]
    ],
)
def test_a_malformed_blob_is_refused_naming_the_problem(blob: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        unpack(blob)


def test_a_tensor_the_format_cannot_carry_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"tensor odd \(torch.complex128"):
        pack({"fine": torch.zeros(2), "odd": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(TypeError, match="contiguous: False"):
        pack({"t": torch.zeros(3, 4).t()})
    with pytest.raises(TypeError, match=r"state\['user'\]\['z'\] is a torch.complex128 tensor"):  # and where
        transport.encode_state({"user": {"z": torch.zeros(1, dtype=torch.complex128)}})


@pytest.fixture(scope="module")
def small_chunks() -> Iterator[None]:
    """Chunks of 7 bytes: many of them, some spanning parts (the same for every example)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport, "CHUNK", 7)
        yield


@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=4))
def test_the_signature_depends_on_the_bytes_not_on_how_they_are_split(
    small_chunks: None, data: bytes, cuts: list[int]
) -> None:
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    parts = [data[a:b] for a, b in itertools.pairwise(bounds)]
    whole = transport.body_signature(b"secret", 3, data)
    assert transport.body_signature(b"secret", 3, *parts) == whole
    assert transport.body_signature(b"secret", 4, data) != whole
    assert transport.body_signature(b"other", 3, data) != whole
    if data:
        flipped = bytes([data[0] ^ 1]) + data[1:]
        assert transport.body_signature(b"secret", 3, flipped) != whole
    assert transport.body_signature(b"secret", 3, data + b"\0") != whole
