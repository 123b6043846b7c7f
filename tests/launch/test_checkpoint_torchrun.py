"""Checkpoint resume under real torchrun: worker killed and restarted; 2 ranks resumed by 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_train.checkpoint.format import step_dir_name
from tests.helpers import (
    RESUME_RUN,
    Finished,
    assert_bitwise_equal,
    cli,
    dirs,
    epoch_metrics,
    final_state,
    reference_run,
    resume_run_at_2,
    torchrun,
)

pytestmark = pytest.mark.timeout(300)
# torch's defaults (the agent's shared store across restarts): what a user's plain torchrun gets.
AGENT_ENV: dict[str, str] = {}
STANDALONE_2 = ["--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resume_run_at_2(tmp_path_factory)  # shared with tests/launch/test_launch.py


def test_a_two_rank_checkpoint_resumed_by_one_rank_sees_every_sample_once(tmp_path: Path, reference_2: Path) -> None:
    crashed = torchrun(
        [*STANDALONE_2, "--max-restarts=0"],
        [*RESUME_RUN, *dirs(tmp_path)],
        env={**AGENT_ENV, "ELASTIC_TRAIN_FAULTS": "kill:rank=0:step=8"},
    )
    assert crashed.returncode != 0
    alone = cli([*RESUME_RUN, *dirs(tmp_path)])
    assert alone.returncode == 0, alone.output
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(6)} at epoch 2, step 6" in alone.stdout
    assert "Total processes used: 1" in alone.stdout
    ours = [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(tmp_path)]
    theirs = [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(reference_2)]
    assert ours == theirs, "a sample was skipped or repeated across the change of world size"


def uninterrupted_and_killed(tmp_path: Path, nproc: int, args: list[str], fault: str) -> tuple[Path, Path, Finished]:
    """The same job run through by ``nproc`` ranks (``reference_run``), then under plain
    torchrun with ``fault`` (one restart allowed); both must succeed. Returns their run folders
    and the killed run's result."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference_run(nproc, [*args, *dirs(reference)])
    done = torchrun(
        ["--standalone", f"--nproc_per_node={nproc}", "--max-restarts=1"],
        [*args, *dirs(killed)],
        env={**AGENT_ENV, "ELASTIC_TRAIN_FAULTS": fault},
    )
    assert done.returncode == 0, done.output
    return reference, killed, done


def test_a_worker_killed_mid_epoch_is_restarted_and_a_model_with_buffers_resumes_bitwise(tmp_path: Path) -> None:
    """Plain torchrun restarts the group after a worker's SIGKILL, and the run resumes from its
    last committed checkpoint to the uninterrupted run's bits. The model carries buffers:
    ResNet-18's BatchNorm statistics differ between ranks at a step boundary (each rank's own
    batch updated them); DDP re-broadcasts rank 0's at the next forward, so rank 0's are saved."""
    args = [*RESUME_RUN, "--model", "resnet18", "--image-size", "16"]
    reference, killed, done = uninterrupted_and_killed(tmp_path, 2, args, "kill:rank=1:step=8")
    # Step 8's async save commits at the next boundary; the kill at step 9's start comes first.
    assert f"Resumed from {killed / 'ckpt' / step_dir_name(6)} at epoch 2, step 6" in done.stdout, done.stdout
    assert "Training completed successfully." in done.stdout and not done.leftovers
    state = final_state(killed)
    assert any(k.endswith("running_mean") for k in state), "no BatchNorm buffers in the checkpoint"
    assert_bitwise_equal(final_state(reference), state)
    assert epoch_metrics(killed) == epoch_metrics(reference)


def test_three_workers_killed_and_restarted_end_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    """From three ranks a gradient's all-reduce sums in an order set by DDP's bucket layout,
    which DDP used to rebuild after each run's first step: the step after a resume was reduced
    over other buckets than the uninterrupted run's (the weights drifted by ~1e-5 at 4 workers;
    two ranks sum in either order alike). ``elastic_train.distributed.ddp`` fixes the layout."""
    reference, killed, done = uninterrupted_and_killed(tmp_path, 3, RESUME_RUN, "kill:rank=2:step=8")
    assert f"Resumed from {killed / 'ckpt' / step_dir_name(6)} at epoch 2, step 6" in done.stdout
    assert not done.leftovers
    assert_bitwise_equal(final_state(reference), final_state(killed))
    assert epoch_metrics(killed) == epoch_metrics(reference)
