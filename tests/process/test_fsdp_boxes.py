"""FSDP2 on CPU (gloo) at an uneven world size: each rank's parameter pieces are exactly the boxes
of ``shard_plan.dim0_plan``, and the pieces of all ranks together are the whole tensor."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import spawn_ranks

WORLD = 3  # rows 5 and 7 do not divide by 3: the last piece is short or empty


def boxes_worker(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic_train.checkpoint.dtensor_boxes import global_shape, local_box
    from elastic_train.checkpoint.shard_plan import Box, covers_exactly_once, dim0_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same full weights on every rank, to compare the pieces against
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (world,))  # an explicit CPU mesh: see torch-elastic facts
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for name, param in model.named_parameters():
            shape = global_shape(param)
            box = local_box(param)
            assert box == dim0_plan(shape, world)[rank], (name, box)
            local = param.to_local()
            assert tuple(local.shape) == box.lengths
            assert torch.equal(local, full[name][box.relative_to(Box.whole(shape))]), name
            mine = torch.tensor([*box.offsets, *box.lengths])  # tensors, not pickled objects
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            dims = len(shape)
            boxes = [Box(tuple(t[:dims].tolist()), tuple(t[dims:].tolist())) for t in every]
            assert covers_exactly_once(shape, boxes), (name, boxes)
        assert local_box(torch.zeros(3, 2)) == Box.whole((3, 2))  # a plain tensor is whole
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp2_pieces_at_three_ranks_are_the_plans_boxes() -> None:
    spawn_ranks(boxes_worker, WORLD, (), timeout=100)
