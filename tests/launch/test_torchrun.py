"""Real ``torchrun --standalone --nproc_per_node=2`` runs, checked for the seed's console lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.datagen import tiny_imagenet_zip
from tests.helpers import QUICK, SEED_EPOCH_LINE, events, read_jsonl, torchrun

pytestmark = pytest.mark.timeout(240)
STANDALONE_2 = ["--standalone", "--nproc_per_node=2"]


def test_torchrun_two_processes_prints_the_seeds_lines(tmp_path: Path) -> None:
    done = torchrun(STANDALONE_2, [*QUICK, "--log-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert done.returncode == 0, done.output
    lines = done.stdout.splitlines()
    assert lines.count("Training started with 2 processes") == 1
    assert "global batch: 32, per-process batch: 16" in done.stdout
    assert sum(bool(SEED_EPOCH_LINE.match(line)) for line in lines) == 2
    summary = lines[lines.index("Training Summary:") :]
    assert summary[3:5] == ["Total GPUs used: 0", "Total processes used: 2"]
    assert summary[-2].startswith("Goodput: ") and summary[-1] == "Training completed successfully."
    assert not done.leftovers
    for rank in (0, 1):
        started = events(tmp_path, rank, "start")[0]
        assert started["world_size"] == 2 and started["rank"] == rank and started["run_id"] not in ("", "local")


def test_torchrun_on_a_tiny_imagenet_zip_extracts_once_on_rank_0(tmp_path: Path) -> None:
    tiny_imagenet_zip(tmp_path / "data")
    args = [
        "--dataset",
        "tiny-imagenet",
        "--data-dir",
        str(tmp_path / "data"),
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--log-dir",
        str(tmp_path / "logs"),
        "--checkpoint-dir",
        str(tmp_path / "logs" / "ckpt"),
        "--num-workers",
        "1",
    ]
    done = torchrun(STANDALONE_2, args)
    assert done.returncode == 0, done.output
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "build",
        "tiny-imagenet-200",
        "tiny-imagenet-200.zip",
    ]
    assert "dataset: tiny-imagenet (24 train / 9 val, 3 classes, 64px)" in done.stdout
    (metrics,) = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert metrics["samples_seen"] == 24 and metrics["val_samples"] == 9


def test_a_crash_under_torchrun_names_the_rank_and_the_exception(tmp_path: Path) -> None:
    done = torchrun(
        [*STANDALONE_2, "--max-restarts=0"],
        [*QUICK, "--log-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")],
        env={"ELASTIC_TRAIN_FAULTS": "raise:rank=1:step=2"},
    )
    assert done.returncode != 0
    # torchrun's failure summary, fed by @record's error file.
    assert "Root Cause" in done.stderr and "rank      : 1" in done.stderr, done.stderr[-3000:]
    assert "InjectedFault" in done.stderr
    assert not done.leftovers, "a worker outlived torchrun"


def test_bad_flags_under_torchrun_fail_fast_with_one_message(tmp_path: Path) -> None:
    done = torchrun(
        STANDALONE_2,
        ["--batch-size", "1", "--log-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")],
        timeout=90,
    )
    assert done.returncode != 0
    assert done.stderr.count("global --batch-size 1 is smaller than the world size 2") == 1
    assert "exitcode  : 2" in done.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
