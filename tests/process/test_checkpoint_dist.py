"""Sharded save at one world size, load at another: multi-process gloo, hypothesis-driven."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_train.checkpoint.format import MANIFEST, Payload, latest_target, read_manifest
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
from elastic_train.checkpoint.snapshot import Position, Snapshot
from elastic_train.distributed.env import DistEnv
from tests.helpers import spawn_ranks

pytestmark = pytest.mark.timeout(600)
FINGERPRINT = {"model": "test"}
DTYPES = ["float32", "float16", "bfloat16", "int64", "uint8"]


def make_state(spec: list[tuple[list[int], str]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (shape, dtype) in enumerate(spec):
        t = torch.randn(shape, generator=gen) * 100
        key = f"model.layer{i}.weight" if i % 2 else f"optim.state.layer{i}.exp_avg"
        out[key] = t.to(getattr(torch, dtype))
    return out


def per_rank_state(rank: int) -> dict[str, torch.Tensor]:
    return {
        "rng.torch": torch.arange(rank + 3, dtype=torch.uint8),
        "metrics.train_sums": torch.full((3,), rank + 0.5, dtype=torch.float64),
    }


def checkpointer(rank: int, world: int, root: Path) -> Checkpointer:
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, run_id="t", launched=True)
    return Checkpointer(CheckpointConfig(root=root), env, FINGERPRINT)


def save_worker(rank: int, world: int, init_file: str, root: str, spec: list[Any], seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ck = checkpointer(rank, world, Path(root))
        ck.start()
        snap = Snapshot(
            position=Position(step=5, epoch=1, batch_in_epoch=2),
            replicated=make_state(spec, seed),
            per_rank=per_rank_state(rank),
            payload=Payload(app={"note": "x"}),
        )
        assert ck.save(snap, sync=True) is True
        ck.close()
    finally:
        dist.destroy_process_group()


def load_worker(rank: int, world: int, init_file: str, root: str, spec: list[Any], seed: int, saved_world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ck = checkpointer(rank, world, Path(root))
        ck.start()
        loaded = ck.resume()
        ck.close()
        assert loaded is not None and loaded.manifest.world_size == saved_world
        expected = make_state(spec, seed)
        for key, value in expected.items():
            got = loaded.tensors[key]
            assert got.dtype == value.dtype and torch.equal(got, value), key
        for old in range(saved_world):
            for name, value in per_rank_state(old).items():
                assert torch.equal(loaded.tensors[f"rank.{old}.{name}"], value)
    finally:
        dist.destroy_process_group()


specs = st.lists(
    st.tuples(st.lists(st.integers(1, 40), min_size=0, max_size=3), st.sampled_from(DTYPES)), min_size=1, max_size=12
)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(save_world=st.integers(1, 4), load_world=st.integers(1, 4), spec=specs, seed=st.integers(0, 2**31))
def test_save_at_one_world_size_and_load_at_another_round_trips_exactly(
    tmp_path_factory: pytest.TempPathFactory, save_world: int, load_world: int, spec: list[Any], seed: int
) -> None:
    root = tmp_path_factory.mktemp("ckpt")
    spawn_ranks(save_worker, save_world, (str(root), spec, seed), timeout=120)
    folder = latest_target(root)
    assert folder is not None and (folder / MANIFEST).exists()
    manifest = read_manifest(folder)
    assert len(manifest.files) == save_world, "one shard per rank"
    assert set(manifest.tensors) >= {f"rank.{r}.rng.torch" for r in range(save_world)}
    spawn_ranks(load_worker, load_world, (str(root), spec, seed, save_world), timeout=120)
    assert os.listdir(root)  # nothing was deleted by loading
