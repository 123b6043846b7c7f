"""FSDP2 on CPU (gloo) at an uneven world size, in one group of 3 ranks:

* each rank's parameter pieces are exactly the boxes of ``shard_plan.dim0_plan`` (rows 5 and 7
  do not divide by 3: the last piece is short or empty), hold the right values, and the ranks'
  boxes together cover each tensor exactly once;
* the built-in ViT sharded per encoder block trains like one process on the whole global batch
  (same initial weights, same samples, SGD with momentum), to float32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import spawn_ranks

WORLD, STEPS, GLOBAL_BATCH, SIZE, CLASSES = 3, 3, 9, 16, 10


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, 3, SIZE, SIZE, generator=g), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def train(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    # SGD: the update is linear in the gradient, so a wrong average shows and rounding does not
    # grow (Adam divides tiny gradients by their own size).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def check_boxes(rank: int, world: int) -> None:
    import torch.distributed as dist

    from elastic_train.checkpoint.dtensor_boxes import global_shape, local_box
    from elastic_train.checkpoint.shard_plan import Box, covers_exactly_once, dim0_plan
    from elastic_train.distributed.fsdp import mesh_for, shard_model

    torch.manual_seed(0)  # the same full weights on every rank, to compare the pieces against
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard_model(model, mesh_for(torch.device("cpu"), world), blocks=[model[0], model[2]])
    for name, param in model.named_parameters():
        shape = global_shape(param)
        box = local_box(param)
        assert box == dim0_plan(shape, world)[rank], (name, box)
        local = param.to_local()  # type: ignore[operator]
        assert tuple(local.shape) == box.lengths
        assert torch.equal(local, full[name][box.relative_to(Box.whole(shape))]), name
        mine = torch.tensor([*box.offsets, *box.lengths])  # tensors, not pickled objects
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        dims = len(shape)
        boxes = [Box(tuple(t[:dims].tolist()), tuple(t[dims:].tolist())) for t in every]
        assert covers_exactly_once(shape, boxes), (name, boxes)
    assert local_box(torch.zeros(3, 2)) == Box.whole((3, 2))  # a plain tensor is whole


def fsdp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from elastic_train.distributed.fsdp import mesh_for, shard_model
    from elastic_train.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        check_boxes(rank, world)
        torch.manual_seed(0)
        model = shard_model(build_model("vit", CLASSES, SIZE), mesh_for(torch.device("cpu"), world))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        share = GLOBAL_BATCH // world
        train(
            model, [(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for x, y in batches()]
        )
        full = {name: p.full_tensor() for name, p in model.named_parameters()}  # type: ignore[operator]
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_fsdp2_at_three_ranks_shards_by_the_plan_and_trains_like_one_process(tmp_path: Path) -> None:
    from elastic_train.models import build_model

    out = tmp_path / "fsdp.pt"
    spawn_ranks(fsdp_worker, WORLD, (str(out),), timeout=200)
    torch.manual_seed(0)
    reference = build_model("vit", CLASSES, SIZE)
    before = {k: v.detach().clone() for k, v in reference.named_parameters()}
    train(reference, batches())
    sharded = torch.load(out, weights_only=True)
    assert sharded.keys() == dict(reference.named_parameters()).keys()
    worst = max((sharded[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
    moved = max((before[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
    assert worst < 1e-5 and moved > 1e-4, (worst, moved)  # trained, and alike to rounding
