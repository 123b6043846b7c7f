"""FSDP2 wrapping: which modules become their own sharded unit, and the call that shards them.

``fully_shard`` (FSDP2, DTensor parameters sharded on dimension 0) is applied to each *block*
and then to the root, as torchtitan does per transformer block: a block's parameters are
gathered just before its forward and freed after it, so peak memory holds the sharded model
plus about one block in full. The default blocks are the repeated layers of a model: the
children of every ``nn.Sequential`` / ``nn.ModuleList`` made of two or more modules of one
class that hold parameters (a ViT's encoder blocks, a ResNet's BasicBlocks). A plug-in task
names its own when that guess is wrong.

The mesh is always explicit: on a machine with GPUs, ``fully_shard`` over a gloo group without
a CPU mesh moves the model to CUDA and crashes (pytorch/pytorch#132471).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers of ``model``, outermost first; nested repeats inside a block are left
    to that block's unit (one level of units is what FSDP2 needs for its memory bound)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = list(module.children())
        kinds = {type(child) for child in children}
        if len(children) >= 2 and len(kinds) == 1 and all(_holds_parameters(c) for c in children):
            blocks.extend(children)
            inside.update(id(m) for child in children for m in child.modules())
    return blocks


def mesh_for(device: torch.device, world_size: int) -> DeviceMesh:
    """A one-dimensional mesh over the whole world, of ``device``'s type (``cpu`` for gloo)."""
    return init_device_mesh(device.type, (world_size,))


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: Sequence[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """``fully_shard`` each block, then the root (in place; returns ``model``). ``param_dtype``:
    the compute dtype of gathered parameters (bf16 under ``--amp`` on GPUs); gradients are
    reduced and the optimizer steps in float32 either way."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in default_blocks(model) if blocks is None else blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reshard_all(model: nn.Module) -> None:
    """Free every gathered parameter: after a forward without backward (evaluation) the root
    keeps its parameters gathered, and its ``named_parameters`` would then be the gathered
    plain tensors, not the sharded ones the optimizer and a checkpoint hold."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
