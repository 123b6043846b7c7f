"""A worker's own part of a model's and optimizer's state, for a heal between replica groups.

Under FSDP2 inside a replica group, each worker holds one shard of every parameter (a DTensor);
the worker of the same group rank in every other group holds the same shard. A heal moves each
worker's local shards only, from that peer, and loads them into the DTensors in place: nothing
is gathered. A plain tensor (DDP, or a buffer) is its own local part. DTensor is imported only
when used.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")


def is_sharded(value: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This worker's local shard of a DTensor (a view: writing it writes the DTensor), else the tensor."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined,no-any-return]


def local_state(state: T) -> T:
    """``state`` with every DTensor replaced by its local shard: what a heal moves per worker."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: local_shard(v) if isinstance(v, torch.Tensor) else v, state)  # type: ignore[no-any-return]


@torch.no_grad()
def load_module_shards(module: nn.Module, incoming: dict[str, torch.Tensor]) -> None:
    """Copy a peer's local shards into this worker's (same group rank: same shard shapes)."""
    current = module.state_dict()
    if set(incoming) != set(current):
        raise ValueError(f"the peer's module state has other keys: {sorted(set(incoming) ^ set(current))[:5]}")
    for key, value in incoming.items():
        target = local_shard(current[key])
        if target.shape != value.shape:
            raise ValueError(f"{key}: the peer's shard is {tuple(value.shape)}, this worker's {tuple(target.shape)}")
        target.copy_(value)


def load_optimizer_shards(optimizer: torch.optim.Optimizer, incoming: dict[str, Any]) -> None:
    """Load a peer's optimizer state whose sharded moments arrive as local shards: each becomes
    a DTensor again, placed like the parameter it belongs to."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in incoming["state"].items():
        param = params[int(index)]
        if is_sharded(param):
            values = {
                key: DTensor.from_local(
                    v, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
                )
                if isinstance(v, torch.Tensor) and v.shape == param.to_local().shape and v.dim() > 0
                else v
                for key, v in values.items()
            }
        state[index] = values
    optimizer.load_state_dict({**incoming, "state": state})
