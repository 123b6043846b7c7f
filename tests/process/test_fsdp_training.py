"""FSDP2 on CPU (gloo) at uneven world sizes, and its checkpoints (format 4):

In one group of 3 ranks:
* each rank's parameter pieces are exactly the boxes of ``shard_plan.dim0_plan`` (rows 5 and 7
  do not divide by 3: the last piece is short or empty), hold the right values, and the ranks'
  boxes together cover each tensor exactly once;
* the built-in ViT sharded per encoder block trains like one process on the whole global batch
  (same initial weights, same samples, SGD with momentum), to float32 rounding;
* its sharded checkpoint (each rank writing only its pieces; async, then sync) restores into a
  fresh FSDP model at the same world size bitwise (weights and optimizer moments).

Then the same checkpoint is read at other world sizes, whole values exact: into one plain
module (FSDP -> DDP), and into FSDP at 2 ranks, which also reads a whole (DDP) checkpoint of
the same state (DDP -> FSDP). Its ``ckpt export --format dcp`` folder is read by stock
``torch.distributed.checkpoint.load`` at 1 and 2 ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import spawn_ranks
from tests.unit.conftest import world_of_one as world_of_one  # a fixture: the world-1 reader needs a group

WORLD, STEPS, GLOBAL_BATCH, SIZE, CLASSES = 3, 3, 9, 16, 10


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, 3, SIZE, SIZE, generator=g), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD: the update is linear in the gradient, so a wrong average shows and rounding does not
    # grow (Adam divides tiny gradients by their own size).
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.optim.Optimizer:
    optimizer = sgd(model)
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return optimizer


def checkpointer(root: str, rank: int, world: int) -> Any:
    from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
    from elastic_train.distributed.env import DistEnv

    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, run_id="t", launched=True)
    ck = Checkpointer(CheckpointConfig(root=Path(root)), env, {"model": "vit"})
    ck.start()
    return ck


def sharded_vit(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from elastic_train.distributed.fsdp import mesh_for, shard_model
    from elastic_train.models import build_model

    torch.manual_seed(1)  # other weights than the trained ones: a restore must replace them all
    model = shard_model(build_model("vit", CLASSES, SIZE), mesh_for(torch.device("cpu"), world))
    return model, sgd(model)


def restored(root: str, rank: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A fresh sharded ViT and optimizer at ``world`` ranks, restored from ``latest`` in ``root``."""
    from elastic_train.checkpoint.snapshot import restore

    model, optimizer = sharded_vit(world)
    ck = checkpointer(root, rank, world)
    loaded = ck.resume()
    ck.close()
    assert loaded is not None
    done = restore(loaded, model, optimizer, rank=rank, world_size=world, device=torch.device("cpu"))
    return model, optimizer, done


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights and momenta, each gathered whole (a collective: every rank calls it)."""
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        out[f"momentum.{names[id(param)]}"] = state["momentum_buffer"].full_tensor()
    return out


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


def fsdp_worker(rank: int, world: int, init_file: str, out: str, root: str) -> None:
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
        optimizer = train(
            model, [(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for x, y in batches()]
        )
        full = full_state(model, optimizer)
        if rank == 0:
            torch.save(full, out)
        check_sharded_checkpoint(rank, world, model, optimizer, root)
        dist.barrier()  # no rank tears its end of the group down while a peer still uses it
    finally:
        dist.destroy_process_group()


def check_sharded_checkpoint(
    rank: int, world: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str
) -> None:
    """Save (async at step 1, sync at step 2), then restore at the same world size: bitwise."""
    from elastic_train.checkpoint.format import read_manifest, shard_name
    from elastic_train.checkpoint.snapshot import Position, capture

    cpu = torch.device("cpu")
    ck = checkpointer(root, rank, world)
    assert ck.resume() is None
    ck.save(capture(Position(1), model, optimizer, device=cpu), sync=False)
    assert ck.save(capture(Position(2), model, optimizer, device=cpu), sync=True)
    ck.close()
    manifest = read_manifest(Path(root) / "latest")
    assert manifest.version == 4 and manifest.world_size == world
    weight = manifest.sharded["model.heads.head.weight"]  # 10 rows over 3 ranks: 4, 4, 2
    assert weight.shape == [CLASSES, 128] and [p.lengths[0] for p in weight.pieces] == [4, 4, 2]
    assert [p.file for p in weight.pieces] == [shard_name(r, world) for r in range(world)]
    token = manifest.sharded["model.class_token"]  # 1 row over 3 ranks: ranks 1 and 2 hold nothing
    assert [(p.file, p.lengths) for p in token.pieces] == [(shard_name(0, world), [1, 1, 128])]
    assert not any(k.startswith("model.") for k in manifest.tensors)  # no rank wrote a whole weight
    fresh, fresh_optimizer, done = restored(root, rank, world)
    assert done.same_world_size and done.position.step == 2
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert got.placements == want.placements and torch.equal(got.to_local(), want.to_local()), name
    momenta = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    fresh_momenta = [fresh_optimizer.state[p]["momentum_buffer"] for p in fresh.parameters()]
    for want, got in zip(momenta, fresh_momenta, strict=True):
        assert torch.equal(got.to_local(), want.to_local())


def reshard_worker(
    rank: int, world: int, init_file: str, out: str, sharded_root: str, whole_root: str, exported: str
) -> None:
    """At 2 ranks: the 3-rank sharded checkpoint, a whole (DDP) one of the same state, and the
    DCP export read by stock ``dcp.load`` into the sharded model."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        want = torch.load(out, weights_only=True)
        for root in (sharded_root, whole_root):
            model, optimizer, done = restored(root, rank, world)
            assert not done.same_world_size
            got = full_state(model, optimizer)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), root
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        model, _ = sharded_vit(world)
        state = {"model": model.state_dict()}
        dcp_load(state, checkpoint_id=exported)  # into the DTensors, in place
        assert all(torch.equal(v.full_tensor(), want[f"model.{k}"]) for k, v in model.state_dict().items())
        # No rank tears its end of the group down while a peer still uses it (a rank 1 once died
        # of SIGABRT, "terminate called without an active exception", after its last gather).
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_fsdp2_at_three_ranks_trains_like_one_process_and_its_checkpoint_reshards_both_ways(
    tmp_path: Path,
    world_of_one: None,
) -> None:
    from elastic_train.checkpoint.snapshot import Position, capture, restore
    from elastic_train.models import build_model

    out, sharded_root, whole_root = tmp_path / "fsdp.pt", tmp_path / "sharded", tmp_path / "whole"
    spawn_ranks(fsdp_worker, WORLD, (str(out), str(sharded_root)), timeout=200)
    torch.manual_seed(0)
    reference = build_model("vit", CLASSES, SIZE)
    before = {k: v.detach().clone() for k, v in reference.named_parameters()}
    train(reference, batches())
    sharded = torch.load(out, weights_only=True)
    weights = {k[len("model.") :]: v for k, v in sharded.items() if k.startswith("model.")}
    assert weights.keys() == dict(reference.named_parameters()).keys()
    worst = max((weights[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
    moved = max((before[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
    assert worst < 1e-5 and moved > 1e-4, (worst, moved)  # trained, and alike to rounding

    # FSDP at 3 -> one plain module: every piece assembled, bitwise the gathered state.
    torch.manual_seed(1)
    plain = build_model("vit", CLASSES, SIZE)
    optimizer = sgd(plain)
    ck = checkpointer(str(sharded_root), 0, 1)
    loaded = ck.resume()
    ck.close()
    restore(loaded, plain, optimizer, rank=0, world_size=1, device=torch.device("cpu"))
    assert all(torch.equal(v, weights[k]) for k, v in plain.named_parameters())
    assert all(
        torch.equal(optimizer.state[p]["momentum_buffer"], sharded[f"momentum.{k}"])
        for k, p in plain.named_parameters()
    )
    # Exported for stock DCP, read back in this one process.
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from elastic_train.ckpt import main as ckpt

    exported = tmp_path / "exported.dcp"
    assert ckpt(["export", str(sharded_root), "--format", "dcp", "-o", str(exported)]) == 0
    assert ckpt(["export", str(sharded_root), "--format", "dcp", "-o", str(exported)]) == 2  # never overwritten
    # And consolidated into one safetensors file, as a Hugging Face user loads weights.
    from safetensors.torch import load_file

    assert ckpt(["export", str(sharded_root), "-o", str(tmp_path / "model.safetensors")]) == 0
    consolidated = load_file(str(tmp_path / "model.safetensors"))
    assert consolidated.keys() == weights.keys() and all(torch.equal(consolidated[k], weights[k]) for k in weights)
    torch.manual_seed(1)
    stock = build_model("vit", CLASSES, SIZE)
    state = {"model": stock.state_dict()}
    dcp_load(state, checkpoint_id=str(exported), no_dist=True)
    assert all(torch.equal(v, weights[k]) for k, v in stock.named_parameters())
    # The same state saved whole (as a DDP run would), for the 2-rank reader.
    ck = checkpointer(str(whole_root), 0, 1)
    ck.save(capture(Position(2), plain, optimizer, device=torch.device("cpu")), sync=True)
    ck.close()
    spawn_ranks(reshard_worker, 2, (str(out), str(sharded_root), str(whole_root), str(exported)), timeout=200)
