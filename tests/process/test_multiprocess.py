"""Several gloo processes on CPU, launched with the environment torchrun would give them.

These exercise the distributed behaviour itself (exact metrics, early stop, teardown) without
torchrun's agent in the way; tests/launch/test_torchrun.py runs the same code under real torchrun.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from elastic_train.early_stop import EarlyStopper
from tests.helpers import QUICK, VAL, cli, events, read_jsonl, run_ranks

pytestmark = pytest.mark.timeout(240)


def test_two_rank_metrics_equal_the_single_process_computation(tmp_path: Path) -> None:
    one = cli([*QUICK, "--log-dir", str(tmp_path / "w1"), "--checkpoint-dir", str(tmp_path / "w1" / "ckpt")])
    assert one.returncode == 0, one.output
    results = run_ranks(
        2, [*QUICK, "--log-dir", str(tmp_path / "w2"), "--checkpoint-dir", str(tmp_path / "w2" / "ckpt")], timeout=150
    )
    assert [r.returncode for r in results] == [0, 0], results[0].output + results[1].output
    single = read_jsonl(tmp_path / "w1" / "metrics.jsonl")
    double = read_jsonl(tmp_path / "w2" / "metrics.jsonl")
    assert len(single) == len(double) == 2
    for a, b in zip(single, double, strict=True):
        # Same samples, same count: the global batch sequence does not depend on the world size.
        assert (a["samples_seen"], a["sample_digest"], a["val_samples"]) == (
            b["samples_seen"],
            b["sample_digest"],
            b["val_samples"],
        )
        assert b["world_size"] == 2
        for key in ("train_loss", "train_acc", "val_loss", "val_acc"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-5), (key, a[key], b[key])
    assert "Training started with 2 processes" in results[0].stdout
    assert results[1].stdout == "", "only rank 0 writes the console lines"


def test_early_stop_on_target_makes_every_rank_leave_in_the_same_epoch(tmp_path: Path) -> None:
    args = [
        "--batch-size",
        "32",
        "--max-steps-per-epoch",
        "3",
        "--epochs",
        "5",
        "--target-accuracy",
        "0.01",
        "--log-dir",
        str(tmp_path),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        *VAL,
    ]
    results = run_ranks(2, args, timeout=150)
    assert [r.returncode for r in results] == [0, 0]
    assert "Early stopping at epoch 1: val_acc" in results[0].stdout
    assert [events(tmp_path, r, "done")[0]["epochs"] for r in (0, 1)] == [1, 1]


def test_early_stop_on_patience_makes_every_rank_leave_in_the_same_epoch(tmp_path: Path) -> None:
    # A learning rate of 1e-12 all but freezes the model, so val accuracy soon stops improving.
    args = [
        "--batch-size",
        "32",
        "--max-steps-per-epoch",
        "2",
        "--epochs",
        "8",
        "--target-accuracy",
        "1.0",
        "--patience",
        "1",
        "--base-lr",
        "1e-12",
        "--log-dir",
        str(tmp_path),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        *VAL,
    ]
    results = run_ranks(2, args, timeout=150)
    assert [r.returncode for r in results] == [0, 0]
    accuracies = [m["val_acc"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    stopper = EarlyStopper(target_accuracy=1.0, patience=1)
    expected = next(e for e, acc in enumerate(accuracies, start=1) if stopper.update(acc))
    assert expected == len(accuracies) < 8, accuracies
    assert re.search(
        rf"Early stopping at epoch {expected}: no val_acc improvement over \S+ for 1 epoch", results[0].stdout
    )
    assert [events(tmp_path, r, "done")[0]["epochs"] for r in (0, 1)] == [expected, expected]


def test_an_exception_on_one_rank_tears_the_group_down_with_no_orphan(tmp_path: Path) -> None:
    # The collective timeout is far longer than the test: rank 0 must fail because its peer
    # went away, not because a timer ran out.
    args = [
        *QUICK,
        "--collective-timeout",
        "600",
        "--log-dir",
        str(tmp_path),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    results = run_ranks(2, args, timeout=90, env={"ELASTIC_TRAIN_FAULTS": "raise:rank=1:step=2"})
    assert not any(r.leftovers for r in results), "a rank process outlived the failure"
    assert results[1].returncode not in (0, 2)
    assert "InjectedFault: injected fault: raise at step 2" in results[1].stderr
    assert results[0].returncode not in (0, 2), "rank 0 went on as if nothing happened"
    assert "Training completed successfully." not in results[0].stdout


def test_bad_world_size_fit_exits_2_on_every_rank_with_one_message(tmp_path: Path) -> None:
    results = run_ranks(
        2, ["--batch-size", "1", "--log-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")], timeout=60
    )
    assert [r.returncode for r in results] == [2, 2]
    assert "global --batch-size 1 is smaller than the world size 2" in results[0].stderr
    assert results[1].stderr == "", "the message is printed once, by rank 0"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_corrupt_data_on_rank_0_makes_every_rank_exit_2_without_a_hang(tmp_path: Path) -> None:
    (tmp_path / "tiny-imagenet-200.zip").write_bytes(b"garbage" * 100)
    args = [
        "--dataset",
        "tiny-imagenet",
        "--data-dir",
        str(tmp_path),
        "--batch-size",
        "4",
        "--log-dir",
        str(tmp_path / "logs"),
        "--checkpoint-dir",
        str(tmp_path / "logs" / "ckpt"),
    ]
    results = run_ranks(2, args, timeout=60)
    assert [r.returncode for r in results] == [2, 2]
    assert "tiny-imagenet-200.zip is corrupt" in results[0].stderr
    assert not (tmp_path / "logs").exists()
