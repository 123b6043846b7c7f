"""``--keep-best``, as a real run: the best epoch-end checkpoint outlives ``--keep-last``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import step_folders
from elastic_train.checkpoint.storage import read_best
from tests.helpers import cli, dirs, read_jsonl, run

pytestmark = pytest.mark.timeout(180)
# A learning rate this high for AdamW makes val_acc peak at the first epoch and fall after it (on
# this seed), so the best checkpoint is one that --keep-last 2 alone would delete.
RUN = [
    *("--batch-size", "32", "--max-steps-per-epoch", "2", "--epochs", "4", "--target-accuracy", "1.0"),
    *("--patience", "0", "--image-size", "16", "--base-lr", "0.03", "--keep-last", "2", "--keep-best", "1"),
]


def test_the_best_epoch_survives_keep_last_and_every_kept_folder_verifies(tmp_path: Path) -> None:
    done = cli([*RUN, *dirs(tmp_path)], timeout=120)
    assert done.returncode == 0, done.output
    epochs = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    top = max(m["val_acc"] for m in epochs)
    best_epoch = max(m["epoch"] for m in epochs if m["val_acc"] == top)  # of equal values, the newer
    root = tmp_path / "ckpt"
    (best,) = read_best(root)
    assert (best.epoch, best.value) == (best_epoch, top) and (root / best.folder).is_dir()
    newest = step_folders(root)[:2]
    assert set(step_folders(root)) == {root / best.folder, *newest}
    assert best_epoch <= 2, f"val_acc should peak early with these settings: {[m['val_acc'] for m in epochs]}"
    verify = run([sys.executable, "-m", "elastic_train.ckpt", "verify", str(root)], timeout=60)
    assert verify.returncode == 0, verify.output
