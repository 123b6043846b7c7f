"""Kill, corrupt and fill the disk around real training runs; resume must continue exactly.

Single-process runs here (fast); tests/launch/test_checkpoint_torchrun.py does the same under torchrun.
The reference is one uninterrupted run with the same flags, computed once per module.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from elastic_train.checkpoint.format import (
    MANIFEST,
    aside_folders,
    aside_reason,
    latest_target,
    step_dir_name,
    step_folders,
    verify,
)
from elastic_train.outcome import ExitCode
from tests.helpers import (
    RESUME_RUN,
    ROOT,
    assert_bitwise_equal,
    base_env,
    cli,
    dirs,
    epoch_metrics,
    events,
    final_state,
    kill_group,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    done = cli([*RESUME_RUN, *dirs(base)])
    assert done.returncode == 0, done.output
    return base


def run_until_done(base: Path, faults: str, extra: list[str] | None = None) -> list[Any]:
    """Run with ``faults`` until a run exits 0 (each fault fires once); returns the exit codes."""
    codes = []
    for _ in range(3):
        done = cli([*RESUME_RUN, *dirs(base), *(extra or [])], env={"ELASTIC_TRAIN_FAULTS": faults})
        codes.append(done.returncode)
        if done.returncode == 0:
            return [codes, done]
    raise AssertionError(f"never finished: exit codes {codes}\n{done.output}")


def test_resume_after_kill_mid_epoch_matches_uninterrupted_run(tmp_path: Path, reference: Path) -> None:
    (codes, done) = run_until_done(tmp_path, "kill:rank=0:step=8")
    assert codes == [-9, 0]
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(6)} at epoch 2, step 6" in done.stdout
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    assert epoch_metrics(tmp_path) == epoch_metrics(reference), "per-epoch metrics must be identical"
    # Goodput accounting: the kill came at the start of step 8, so step 7 was recomputed.
    assert "Restarts: 1 (failure: 1)" in done.stdout and "Steps recomputed: 1" in done.stdout
    assert re.search(r"^Goodput: 0\.\d\d$", done.stdout, re.MULTILINE)


@pytest.mark.parametrize("stage", ["before_shard", "after_shard", "after_manifest"])
def test_kill_at_each_point_of_a_save_resumes_from_the_newest_committed(
    tmp_path: Path, reference: Path, stage: str
) -> None:
    faults = f"kill_in_save:rank=0:step=6:stage={stage}"
    first = cli([*RESUME_RUN, *dirs(tmp_path)], env={"ELASTIC_TRAIN_FAULTS": faults})
    assert first.returncode == -9
    step6 = tmp_path / "ckpt" / step_dir_name(6)
    assert (step6 / MANIFEST).exists() == (stage == "after_manifest")
    assert latest_target(tmp_path / "ckpt") == tmp_path / "ckpt" / step_dir_name(4), "latest moved too early"
    second = cli([*RESUME_RUN, *dirs(tmp_path)], env={"ELASTIC_TRAIN_FAULTS": faults})
    assert second.returncode == 0, second.output
    newest = 6 if stage == "after_manifest" else 4  # a written manifest commits, even if `latest` lagged
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(newest)}" in second.stdout
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    assert all((f / MANIFEST).exists() for f in step_folders(tmp_path / "ckpt")), "partial folder not cleaned up"


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_training_goes_on(
    tmp_path: Path, reference: Path
) -> None:
    done = cli([*RESUME_RUN, *dirs(tmp_path)], env={"ELASTIC_TRAIN_FAULTS": "enospc:rank=0:step=2"})
    assert done.returncode == 0, done.output
    failed = events(tmp_path / "logs", 0, "checkpoint_failed")
    assert failed and failed[0]["step"] == 2 and "No space left on device" in failed[0]["error"]
    committed = [e["step"] for e in events(tmp_path / "logs", 0, "checkpoint_committed")]
    assert 2 not in committed and committed[0] == 4, "the next interval must retry"
    assert not list((tmp_path / "ckpt").rglob(".*.tmp-*")), "temporary files left behind"
    assert not (tmp_path / "ckpt" / step_dir_name(2)).exists(), "the failed save's files were left on the full disk"
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))


def test_a_failed_final_save_is_a_failure_and_the_rerun_finishes_bitwise(tmp_path: Path, reference: Path) -> None:
    done = cli([*RESUME_RUN, *dirs(tmp_path)], env={"ELASTIC_TRAIN_FAULTS": "enospc:rank=0:step=8"})
    assert done.returncode == ExitCode.FINAL_CHECKPOINT_FAILED, done.output
    assert "Training completed successfully" not in done.stdout, done.stdout
    assert "Training finished at step 8, but its final checkpoint could NOT be committed" in done.stdout
    assert f"{tmp_path / 'ckpt'}/latest is {step_dir_name(6)}" in done.stdout, done.stdout
    assert latest_target(tmp_path / "ckpt") == tmp_path / "ckpt" / step_dir_name(6)
    assert not (tmp_path / "ckpt" / step_dir_name(8)).exists(), "the failed save's files were left behind"
    again = cli([*RESUME_RUN, *dirs(tmp_path)])
    assert again.returncode == 0 and "Training completed successfully." in again.stdout, again.output
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(6)}" in again.stdout
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))


def test_a_corrupt_latest_is_reported_and_the_run_continues_from_an_older_one(tmp_path: Path, reference: Path) -> None:
    first = cli([*RESUME_RUN, *dirs(tmp_path)], env={"ELASTIC_TRAIN_FAULTS": "kill:rank=0:step=8"})
    assert first.returncode == -9
    shard = tmp_path / "ckpt" / step_dir_name(6) / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    second = cli([*RESUME_RUN, *dirs(tmp_path)])
    assert second.returncode == 0, second.output
    assert "checksum mismatch" in second.stderr and str(shard) in second.stderr
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(4)} at epoch 2, step 4" in second.stdout
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    # The damaged one was moved aside (kept for a post-mortem) and its step written again.
    aside = aside_folders(tmp_path / "ckpt")
    assert [a.name.split(".")[0] for a in aside] == [step_dir_name(6)] and aside_reason(aside[0]) == "corrupt"
    assert (aside[0] / shard.name).read_bytes() == bytes(data)
    verify(tmp_path / "ckpt" / step_dir_name(6), sha256=True)


def test_no_valid_checkpoint_exits_2_and_deletes_nothing(tmp_path: Path, reference: Path) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    for manifest in (tmp_path / "ckpt").glob("step-*/manifest.json"):
        manifest.write_text("{}")
    before = sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))
    done = cli([*RESUME_RUN, *dirs(tmp_path)])
    assert done.returncode == 2
    assert "holds checkpoints but none is valid" in done.stderr and "empty --checkpoint-dir" in done.stderr
    assert "--resume never" not in done.stderr  # it would be refused in turn: never suggested
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path: Path, reference: Path) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    done = cli([*RESUME_RUN, *dirs(tmp_path), "--model", "resnet18"])
    assert done.returncode == 2
    assert "model: checkpoint 'vit', this run 'resnet18'" in done.stderr


def test_a_finished_run_is_not_trained_again(tmp_path: Path, reference: Path) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    done = cli([*RESUME_RUN, *dirs(tmp_path)])
    assert done.returncode == 0, done.output
    assert "Training already finished" in done.stdout and "Epoch " not in done.stdout


def test_a_finished_run_given_more_epochs_trains_them_on_the_stretched_schedule(
    tmp_path: Path, reference: Path
) -> None:
    """--epochs 2 -> 3 on a finished run: epoch 3 is trained (its samples exactly those of an
    uninterrupted 3-epoch run's epoch 3), from a learning rate on the schedule over 3 epochs
    (the 2-epoch curve had decayed to 0), booked as a new launch, not a recovery."""
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    shutil.copytree(reference / "logs", tmp_path / "logs")
    done = cli([*RESUME_RUN, *dirs(tmp_path), "--epochs", "3"])
    assert done.returncode == 0, done.output
    assert f"Extending the finished run {tmp_path / 'ckpt' / step_dir_name(8)} (epoch 2) to --epochs 3" in done.stdout
    lr = float(done.stdout.split("learning rate ")[1].split()[0])
    assert lr > 0, done.stdout
    assert "Epoch 3/3:" in done.stdout and "Restarts: 0" in done.stdout, done.stdout
    longer = cli([*RESUME_RUN, *dirs(tmp_path / "three"), "--epochs", "3"])
    assert longer.returncode == 0, longer.output
    ours, theirs = epoch_metrics(tmp_path), epoch_metrics(tmp_path / "three")
    assert [m["epoch"] for m in ours] == [1, 2, 3]
    assert (ours[2]["samples_seen"], ours[2]["sample_digest"]) == (
        theirs[2]["samples_seen"],
        theirs[2]["sample_digest"],
    )
    again = cli([*RESUME_RUN, *dirs(tmp_path), "--epochs", "3"])
    assert "Training already finished" in again.stdout and "all 3 epoch(s) of --epochs 3 are done" in again.stdout


def test_init_from_another_runs_checkpoint_or_its_export_starts_from_those_weights(
    tmp_path: Path, reference: Path
) -> None:
    """The model only (a fresh optimizer): the first step from the reference's final weights
    gives the same model as the same first step from its exported file; another model's
    checkpoint is refused naming the tensors; a resume of the run itself ignores --init-from."""
    exported = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "elastic_train.ckpt", "export", str(reference / "ckpt"), "-o", str(exported)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    one_step = [*RESUME_RUN, "--epochs", "1", "--max-steps-per-epoch", "1", "--checkpoint-every", "0"]
    runs = {}
    for name, source in (("from-ckpt", reference / "ckpt"), ("from-file", exported)):
        runs[name] = cli([*one_step, *dirs(tmp_path / name), "--init-from", str(source)])
        assert runs[name].returncode == 0, runs[name].output
        assert f"Initial weights from {source}" in runs[name].stdout
    a, b = final_state(tmp_path / "from-ckpt"), final_state(tmp_path / "from-file")
    assert_bitwise_equal(
        {k: v for k, v in a.items() if k.startswith("model.")}, {k: v for k, v in b.items() if k.startswith("model.")}
    )
    assert cli([*one_step, *dirs(tmp_path / "fresh")]).returncode == 0
    fresh = final_state(tmp_path / "fresh")
    assert not all(torch.equal(fresh[k], v) for k, v in a.items() if k.startswith("model.")), (
        "--init-from had no effect"
    )
    refused = cli([*one_step, *dirs(tmp_path / "other"), "--init-from", str(exported), "--model", "resnet18"])
    assert refused.returncode == 2 and "does not fit the model" in refused.stderr, refused.output
    assert "missing from the file:" in refused.stderr and not step_folders(tmp_path / "other" / "ckpt")
    again = cli([*one_step, *dirs(tmp_path / "from-file"), "--init-from", str(exported), "--epochs", "2"])
    assert again.returncode == 0 and "Initial weights" not in again.stdout, again.output


def test_a_second_run_on_the_same_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    long_run = [*RESUME_RUN, "--epochs", "50", *dirs(tmp_path / "a")]
    first = subprocess.Popen(
        [sys.executable, "-m", "elastic_train", *long_run],
        env=base_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        lock = tmp_path / "a" / "ckpt" / ".lock"
        deadline = time.monotonic() + 60
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lock.exists() and first.poll() is None
        second = cli([*RESUME_RUN, *dirs(tmp_path / "a")])
        assert second.returncode == 2
        assert "is in use by run" in second.stderr and json.loads(lock.read_text())["pid"] == first.pid
        assert first.poll() is None, "the first run must be unaffected"
    finally:
        kill_group(first)
        first.wait()


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_train.ckpt", *args],
        capture_output=True,
        text=True,
        env=base_env(),
        cwd=ROOT,
        timeout=120,
    )


def test_ckpt_tool_lists_verifies_inspects_and_exports(tmp_path: Path, reference: Path) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    listing = tool("list", str(tmp_path / "ckpt"))
    assert listing.returncode == 0
    assert "step-00000008  ok: step 8, end of epoch 2, world size 1, finished <- latest" in listing.stdout
    assert tool("verify", str(tmp_path / "ckpt")).returncode == 0
    inspect = tool("inspect", str(tmp_path / "ckpt"))
    assert "step         8" in inspect.stdout and "world size   1" in inspect.stdout
    assert "tensors      " in inspect.stdout and "shard-00000-of-00001.safetensors" in inspect.stdout
    exported = tool("export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "model.safetensors"))
    assert exported.returncode == 0, exported.stderr
    from elastic_train.models import build_model

    model = build_model("vit", 10, 32)
    model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    final = final_state(reference)
    assert all(torch.equal(v, final["model." + k]) for k, v in model.state_dict().items())
    shard = tmp_path / "ckpt" / step_dir_name(8) / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = tool("verify", str(tmp_path / "ckpt"))
    assert bad.returncode == 1 and f"INVALID  {shard.parent}" in bad.stdout and "mismatch" in bad.stdout
