"""The checkpoint paths no other test walks, as short real runs: synchronous saves and retention,
timed saves, ``--resume PATH``, preemptions on an epoch's last batch and with a failing save,
early-stop state and a 1 -> 2 process grow across a resume.

Preemption is delivered as a scheduler would: SIGUSR1, sent by the ``preempt`` fault at the start
of a step (the preemption marker names the signal, so the tests see that it fired). The ranks
agree on a stop at the step boundary after the one that saw the signal, so a signal at the start
of step S stops the run after step S + 1. One uninterrupted run (``reference``) is the yardstick
for weights and metrics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import (
    aside_folders,
    aside_reason,
    latest_target,
    read_manifest,
    step_dir_name,
    step_folders,
    verify,
)
from elastic_train.outcome import PREEMPTED_MARKER, ExitCode, Marker, read_marker
from tests.helpers import (
    ROOT,
    assert_bitwise_equal,
    base_env,
    cli,
    dirs,
    epoch_metrics,
    events,
    final_state,
    read_jsonl,
    run_ranks,
)

pytestmark = pytest.mark.timeout(240)
STEPS = 3  # per epoch
RUN = [
    "--batch-size",
    "32",
    "--max-steps-per-epoch",
    str(STEPS),
    "--max-val-samples",
    "64",
    "--epochs",
    "3",
    "--target-accuracy",
    "1.0",
    "--patience",
    "0",
    "--image-size",
    "16",
]


def preempt_after(step: int) -> str:
    """The fault that makes the ranks stop (and checkpoint) right after ``step``."""
    return f"preempt:rank=0:step={step - 1}"


def committed_steps(base: Path) -> list[int]:
    return [e["step"] for e in events(base / "logs", 0, "checkpoint_committed")]


def samples(base: Path) -> list[tuple[int, int, str]]:
    return [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(base)]


def marker(base: Path) -> Marker:
    found = read_marker(base / "ckpt" / PREEMPTED_MARKER)
    assert found is not None, f"no readable {PREEMPTED_MARKER} in {base / 'ckpt'}"
    return found


def ok(done: object) -> None:
    code = getattr(done, "returncode", None)
    assert code == 0, f"exit {code}\n{getattr(done, 'output', '')[-4000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted, with a timed save due at every step boundary (``--checkpoint-every-seconds``)."""
    base = tmp_path_factory.mktemp("paths-reference")
    ok(cli([*RUN, *dirs(base), "--checkpoint-every-seconds", "0.001", "--keep-last", "20"]))
    return base


def test_timed_saves_commit_checkpoints_between_epoch_ends(reference: Path) -> None:
    steps = committed_steps(reference)
    epoch_ends = {STEPS, 2 * STEPS, 3 * STEPS}
    timed = [s for s in steps if s not in epoch_ends]
    assert timed, f"--checkpoint-every-seconds committed nothing between epoch ends (committed: {steps})"
    assert epoch_ends <= set(steps)
    for step in timed:
        manifest = verify(reference / "ckpt" / step_dir_name(step))
        assert 0 < manifest.batch_in_epoch < STEPS, "a timed save on an epoch's last batch must defer to the epoch end"


def test_synchronous_saves_with_retention_resume_after_a_kill_like_an_uninterrupted_run(
    tmp_path: Path, reference: Path
) -> None:
    flags = [*RUN, *dirs(tmp_path), "--no-async-checkpoint", "--checkpoint-every", "1", "--keep-last", "2"]
    killed = cli(flags, env={"ELASTIC_TRAIN_FAULTS": "kill:rank=0:step=5"})
    assert killed.returncode == -9, killed.output[-3000:]
    sync_saves = [e["sync"] for e in events(tmp_path / "logs", 0, "checkpoint_started")]
    assert sync_saves and all(sync_saves), "--no-async-checkpoint must write every checkpoint synchronously"
    resumed = cli(flags)
    ok(resumed)
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(4)} at epoch 2, step 4" in resumed.stdout
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    assert epoch_metrics(tmp_path) == epoch_metrics(reference)
    # Retention: 9 steps saved, the newest 2 kept, every older one deleted, `latest` valid.
    kept = [f.name for f in step_folders(tmp_path / "ckpt")]
    assert kept == [step_dir_name(9), step_dir_name(8)]
    assert latest_target(tmp_path / "ckpt") == tmp_path / "ckpt" / step_dir_name(9)
    verify(tmp_path / "ckpt" / step_dir_name(9), sha256=True)
    deleted = {Path(e["path"]).name for e in events(tmp_path / "logs", 0, "checkpoint_deleted")}
    assert {step_dir_name(s) for s in range(3, 8)} <= deleted, "deleted by the resumed run's retention"


def test_resume_path_from_another_runs_directory_starts_a_new_job_not_a_recovery(
    tmp_path: Path, reference: Path
) -> None:
    """A fine-tune or a branch: the state continues, but the job is new. Nothing is booked as a
    restart and the wall clock starts now, not when the other run started."""
    start = reference / "ckpt" / step_dir_name(STEPS)
    began = time.time()
    done = cli([*RUN, *dirs(tmp_path / "branch"), "--resume", str(start)])
    ok(done)
    assert f"Resumed from {start} at epoch 2, step {STEPS}" in done.stdout
    assert "Restarts: 0" in done.stdout, done.stdout
    assert not events(tmp_path / "branch" / "logs", 0, "recovery")
    wall = float(done.stdout.split("Wall time since job start: ")[1].split()[0])
    assert wall <= time.time() - began + 1, f"the branch inherited the other job's clock: {wall:.1f}s"
    assert_bitwise_equal(final_state(reference), final_state(tmp_path / "branch"))


def test_resume_path_to_an_older_checkpoint_continues_from_it_and_sets_the_abandoned_future_aside(
    tmp_path: Path, reference: Path
) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    future = [f.name for f in step_folders(tmp_path / "ckpt") if (read_manifest(f).step > STEPS)]
    old_timeline = read_manifest(tmp_path / "ckpt" / step_dir_name(3 * STEPS)).timeline
    start = tmp_path / "ckpt" / step_dir_name(STEPS)
    done = cli([*RUN, *dirs(tmp_path), "--resume", str(start), "--keep-last", "20"])
    ok(done)
    assert f"Resumed from {start} at epoch 2, step {STEPS}" in done.stdout
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    assert epoch_metrics(tmp_path)[-2:] == epoch_metrics(reference)[-2:]
    assert "checkpoint_timeline_forked" in done.stderr  # logged before the rank's log file opens
    aside = aside_folders(tmp_path / "ckpt")
    assert sorted(a.name.split(".")[0] for a in aside) == sorted(future), "set aside, never deleted"
    assert {aside_reason(a) for a in aside} == {"abandoned"}
    final = read_manifest(latest_target(tmp_path / "ckpt") or tmp_path)
    assert final.finished and final.timeline != old_timeline and final.parent == step_dir_name(STEPS)
    listing = subprocess.run(
        [sys.executable, "-m", "elastic_train.ckpt", "list", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env=base_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert listing.returncode == 0 and "set aside (abandoned" in listing.stdout


@pytest.fixture(scope="module")
def preempted_twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Marker]]:
    """Preempted on epoch 1's last batch; resumed and preempted again mid-epoch 2 with a full
    disk for that save; resumed to the end. Returns the folder and the two markers."""
    base = tmp_path_factory.mktemp("preempted")
    flags = [*RUN, *dirs(base), "--keep-last", "10"]
    first = cli(flags, env={"ELASTIC_TRAIN_FAULTS": preempt_after(STEPS)})
    assert first.returncode == ExitCode.PREEMPTED, first.output[-3000:]
    markers = [marker(base)]
    faults = f"{preempt_after(STEPS + 2)},enospc:rank=0:step={STEPS + 2}"
    second = cli(flags, env={"ELASTIC_TRAIN_FAULTS": faults})
    assert second.returncode == ExitCode.PREEMPTED, second.output[-3000:]
    markers.append(marker(base))
    ok(cli(flags))
    return base, markers


def test_a_preemption_on_an_epochs_last_batch_still_gets_its_evaluated_epoch_end_checkpoint(
    preempted_twice: tuple[Path, list[Marker]], reference: Path
) -> None:
    base, markers = preempted_twice
    assert [m.signal for m in markers] == ["SIGUSR1", "SIGUSR1"]
    assert markers[0].step == STEPS and markers[0].committed is True
    mid = read_manifest(base / "ckpt" / step_dir_name(STEPS))
    assert (mid.epoch, mid.batch_in_epoch) == (0, STEPS), "the preemption must land on the last batch, before eval"
    end = read_manifest(base / "ckpt" / step_dir_name(STEPS, 2))
    assert (end.epoch, end.batch_in_epoch, end.timeline) == (1, 0, mid.timeline)
    assert [r["epoch"] for r in end.payload.app["history"]] == [1], "the epoch-end checkpoint carries the evaluation"
    history = read_manifest(latest_target(base / "ckpt") or base).payload.app["history"]
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert epoch_metrics(base) == epoch_metrics(reference), "every epoch evaluated once, as uninterrupted"
    assert_bitwise_equal(final_state(reference), final_state(base))


def test_a_preemption_whose_save_fails_reports_it_and_the_next_run_resumes_from_the_previous_checkpoint(
    preempted_twice: tuple[Path, list[Marker]], reference: Path
) -> None:
    base, markers = preempted_twice
    assert markers[1].step == STEPS + 2 and markers[1].committed is False
    failed = [e["step"] for e in events(base / "logs", 0, "checkpoint_failed")]
    assert STEPS + 2 in failed and STEPS + 2 not in committed_steps(base), "a failed save must not commit"
    resumed = events(base / "logs", 0, "resumed")
    assert [(Path(e["path"]).name, e["step"]) for e in resumed][-1] == (step_dir_name(STEPS, 2), STEPS)
    assert_bitwise_equal(final_state(reference), final_state(base))


def test_growing_from_one_to_two_processes_mid_epoch_keeps_exact_samples_and_the_patience_count(
    tmp_path: Path, reference: Path
) -> None:
    # A learning rate so large that the weights turn to NaN in epoch 1: every prediction is then
    # class 0 and validation accuracy never improves again. With --patience 2 the run stops
    # early at epoch 3 (of 4) only if the count (1 after epoch 2) survives the resume.
    flags = [*RUN, *dirs(tmp_path), "--base-lr", "1e6", "--patience", "2", "--epochs", "4"]
    alone = cli(flags, env={"ELASTIC_TRAIN_FAULTS": preempt_after(2 * STEPS + 2)})
    assert alone.returncode == ExitCode.PREEMPTED, alone.output[-3000:]
    saved = read_manifest(latest_target(tmp_path / "ckpt") or tmp_path)
    assert (saved.world_size, saved.epoch, saved.batch_in_epoch) == (1, 2, 2), "stopped mid-epoch 3"
    assert saved.payload.app["early_stop"]["epochs_without_improvement"] == 1
    results = run_ranks(2, flags, timeout=180)
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:] + results[1].output[-3000:]
    assert "Early stopping at epoch 3" in results[0].stdout
    final = read_manifest(latest_target(tmp_path / "ckpt") or tmp_path)
    assert final.finished and final.world_size == 2
    assert final.payload.app["early_stop"]["epochs_without_improvement"] == 2
    assert samples(tmp_path) == samples(reference), "a sample was skipped or repeated across the 1 -> 2 grow"
    assert [m["world_size"] for m in read_jsonl(tmp_path / "logs" / "metrics.jsonl")] == [1, 1, 2]
