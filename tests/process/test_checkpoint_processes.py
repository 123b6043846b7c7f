"""Checkpoint rules that need more than this process: every rank of a spawned gloo group follows
rank 0's decision on where a save goes, and a fresh interpreter shows what the trainer imports
(the in-process rules are in tests/unit/test_checkpoint_units.py, whose helpers these reuse)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint import format as fmt
from elastic_train.checkpoint.format import FileEntry
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer, SaveTarget, ShardResult
from elastic_train.checkpoint.snapshot import Snapshot
from elastic_train.distributed.env import DistEnv
from tests.helpers import spawn_ranks
from tests.unit.test_checkpoint_units import FINGERPRINT, make_checkpoint, names, snap


def test_the_trainer_does_not_import_torchs_distributed_checkpoint() -> None:
    code = "import sys, elastic_train.run; sys.exit('torch.distributed.checkpoint' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def decision_worker(rank: int, world: int, init_file: str, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, run_id="t", launched=True)
        base = Path(root)
        ck = Checkpointer(CheckpointConfig(root=base), env, FINGERPRINT)
        if rank != 0:

            def not_mine(_: Snapshot) -> SaveTarget:
                raise AssertionError("only rank 0 decides where a save goes")

            ck._target = not_mine  # type: ignore[method-assign,assignment]
        ck.start()
        assert ck.resume() is None
        assert ck.save(snap(3, 0, 3), sync=True) is True
        assert ck.save(snap(3, 0, 3), sync=True) is True  # already committed: skipped on every rank
        assert ck.save(snap(3, 1, 0), sync=True) is True  # another state: a new version
        if rank == 0:
            make_checkpoint(base, 6, timeline="abandoned-future")
        dist.barrier()
        assert ck.save(snap(6, 2, 0), sync=True) is True
        ck.close()
        if rank == 0:
            assert names(base) == [
                fmt.step_dir_name(3),
                fmt.step_dir_name(3, 2),
                fmt.step_dir_name(6),
                *[a.name for a in fmt.aside_folders(base)],
            ]
            assert all(len(fmt.verify(base / n).files) == world for n in (fmt.step_dir_name(3, 2), "step-00000006"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_rank_follows_rank_0s_decision_on_where_a_save_goes(tmp_path: Path) -> None:
    spawn_ranks(decision_worker, 2, (str(tmp_path),), timeout=90)
    assert [fmt.aside_reason(a) for a in fmt.aside_folders(tmp_path)] == ["abandoned"]


def json_worker(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    from elastic_train.distributed.process_group import all_gather_json, broadcast_json

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Ranks' values of different lengths (rank 1's the longest), None among them.
        mine = None if rank == 2 else {"rank": rank, "text": "é" * (10 if rank == 1 else 1)}
        assert all_gather_json(mine) == [{"rank": 0, "text": "é"}, {"rank": 1, "text": "é" * 10}, None]
        assert broadcast_json(f"from rank {rank}", src=1) == "from rank 1"
        side = dist.new_group(backend="gloo")  # as the checkpointer's own group
        assert broadcast_json([rank, None], src=0, group=side) == [0, None]
        # A shard result with pieces and no entry, and one with an entry, as a commit gathers them.
        result = ShardResult(rank, pieces={"model.w": {"offsets": [rank], "lengths": [1]}})
        if rank == 1:
            result = ShardResult(rank, "shard-1.safetensors", FileEntry(3, "a" * 64, "b" * 32), ["x"])
        back = [ShardResult.from_json(r) for r in all_gather_json(result.to_json(), group=side)]
        assert back[rank] == result and back[1].entry == FileEntry(3, "a" * 64, "b" * 32)
        # Over the bound, every rank refuses, the sender too: none goes on into the payload alone.
        from elastic_train.distributed import process_group as pg

        pg.MAX_JSON_BYTES = 8
        try:
            broadcast_json("x" * 20, src=1)
        except RuntimeError as exc:
            assert "rank 1 announced 22 bytes of JSON (at most 8): refused unread" in str(exc)
        else:
            raise AssertionError("a value over the bound was shared")
        pg.MAX_JSON_BYTES = 64 << 20
        assert broadcast_json("after", src=0) == "after"  # the collectives still line up
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_values_shared_between_ranks_travel_as_json_of_any_length() -> None:
    spawn_ranks(json_worker, 3, (), timeout=90)
