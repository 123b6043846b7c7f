"""Which box of the global tensor this rank holds: the bridge from DTensors to ``shard_plan``.

FSDP2 parameters (and the optimizer moments made from them) are DTensors: a local piece plus a
device mesh and placements. A sharded save writes ``to_local()`` and records ``local_box``; a
plain tensor (DDP, a buffer, a scalar) is whole. The offsets come from torch's own placement
arithmetic, not from a re-derivation: whatever split torch uses, the manifest says where each
saved element belongs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from elastic_train.checkpoint.shard_plan import Box


def local_box(tensor: torch.Tensor) -> Box:
    """The box of the global tensor that ``tensor``'s local piece holds on this rank."""
    if not isinstance(tensor, DTensor):
        return Box.whole(tuple(tensor.shape))
    shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(tensor.to_local().shape):
        raise ValueError(f"a DTensor's local piece {tuple(tensor.to_local().shape)} is not its placement's {shape}")
    return Box(tuple(int(o) for o in offsets), tuple(int(n) for n in shape))


def global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in tensor.shape)  # a DTensor's shape is the global one


def writes_piece(tensor: torch.Tensor) -> bool:
    """Whether this rank saves its piece: on a mesh dimension where the tensor is replicated
    (HSDP's replica dimension) only coordinate 0 writes, so that the saved pieces cover the
    tensor exactly once. A plain tensor: always (the caller decides who writes whole tensors)."""
    if not isinstance(tensor, DTensor):
        return True
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return False
    return all(c == 0 for c, p in zip(coordinate, tensor.placements, strict=True) if p.is_replicate())
