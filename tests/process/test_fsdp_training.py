"""FSDP2 on CPU (gloo): the built-in ViT sharded per encoder block trains like one process on
the whole global batch (same initial weights, same samples, SGD with momentum), to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import spawn_ranks

STEPS, GLOBAL_BATCH, SIZE, CLASSES = 3, 8, 16, 10


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


def fsdp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from elastic_train.distributed.fsdp import mesh_for, shard_model
    from elastic_train.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
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


@pytest.mark.timeout(180)
def test_fsdp2_vit_at_two_ranks_trains_like_one_process_on_the_global_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from elastic_train.models import build_model

    out = tmp_path / "fsdp.pt"
    spawn_ranks(fsdp_worker, 2, (str(out),), timeout=150)
    torch.manual_seed(0)
    reference = build_model("vit", CLASSES, SIZE)
    before = {k: v.detach().clone() for k, v in reference.named_parameters()}
    train(reference, batches())
    sharded = torch.load(out, weights_only=True)
    assert sharded.keys() == dict(reference.named_parameters()).keys()
    worst = max((sharded[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
    moved = max((before[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
    assert worst < 1e-5 and moved > 1e-4, (worst, moved)  # trained, and alike to rounding
