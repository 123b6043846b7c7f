"""Storage faults seen from outside one process: the trainer's exit code and message when the
newest checkpoint cannot be read, and a gloo group whose rank 0 fails to clean up after a commit
(the in-process rules are in tests/unit/test_checkpoint_storage_faults.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from elastic_train.checkpoint import format as fmt
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
from elastic_train.distributed.env import DistEnv
from tests.helpers import run, spawn_ranks
from tests.unit.test_checkpoint_storage_faults import BrokenPurger, snapshot
from tests.unit.test_checkpoint_units import FINGERPRINT, make_checkpoint, snap

# The trainer's command line, with every read of one file (argv[1]) failing with EIO.
TRAIN_WITH_EIO = """
import errno, os, sys
from elastic_train.checkpoint import format as fmt
broken, real = sys.argv.pop(1), fmt.file_digests
def digests(path, *args, **kwargs):
    if str(path) == broken:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
    return real(path, *args, **kwargs)
fmt.file_digests = digests
from elastic_train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(180)
def test_the_trainer_refuses_an_unreadable_newest_checkpoint_with_exit_2_and_one_message(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, 1)
    newest = make_checkpoint(ckpt, 2)
    shard = newest / fmt.shard_name(0, 1)
    before = snapshot(ckpt)
    args = ["--epochs", "1", "--max-steps-per-epoch", "2", "--log-dir", str(tmp_path / "logs")]
    done = run(
        [sys.executable, "-c", TRAIN_WITH_EIO, str(shard), *args, "--checkpoint-dir", str(ckpt)],
        timeout=150,
        env={"ELASTIC_TRAIN_READ_RETRY_S": "1"},
    )
    assert done.returncode == 2, done.output
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastic-train: error:")]
    assert len(errors) == 1, done.stderr
    assert str(shard) in errors[0] and "EIO" in errors[0] and "Fix:" in errors[0], errors[0]
    assert "Traceback" not in done.output
    assert snapshot(ckpt) == before, "nothing in the checkpoint directory changed"


def clean_up_fails_on_rank_0(rank: int, world: int, init_file: str, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, run_id="t", launched=True)
        ck = Checkpointer(CheckpointConfig(root=Path(root), keep_last=1), env, FINGERPRINT)
        ck.start()
        assert ck.resume() is None
        if rank == 0:
            ck.purger = BrokenPurger()
        with capture_logs() as logs:
            for step in (1, 2, 3):
                assert ck.save(snap(step, 0, step), sync=True) is True, f"rank {rank}: step {step} not committed"
        ck.close()
        failed = [e for e in logs if e["event"] == "checkpoint_cleanup_failed"]
        assert len(failed) == (3 if rank == 0 else 0), failed
        assert fmt.latest_target(Path(root)) == Path(root) / fmt.step_dir_name(3)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_a_clean_up_failure_on_rank_0_after_a_commit_leaves_every_rank_training(tmp_path: Path) -> None:
    spawn_ranks(clean_up_fails_on_rank_0, 2, (str(tmp_path),), timeout=90)
    assert [f.name for f in fmt.step_folders(tmp_path)] == [fmt.step_dir_name(s) for s in (3, 2, 1)], (
        "retention failed, so nothing was deleted"
    )
