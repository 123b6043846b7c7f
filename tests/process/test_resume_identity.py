"""What a resume may change: settings outside the fingerprint (logged), never the dataset.

Real single-process runs on a small image folder: a run interrupted after its first epoch is
resumed from a moved copy of the data with a new --base-lr and --epochs (allowed, and said so),
then a changed dataset is refused with the difference and the fix.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.datagen import imagefolder_tree
from tests.helpers import cli, dirs, events, flags

pytestmark = pytest.mark.timeout(240)
RUN = [
    *flags(dataset="imagefolder", image_size=16, batch_size=6, max_steps_per_epoch=1, target_accuracy=1.0, patience=0),
    "--no-async-checkpoint",  # the epoch-1 checkpoint is committed before step 2's fault
]


def test_a_resume_logs_changed_settings_and_refuses_a_changed_dataset(tmp_path: Path) -> None:
    # 6 classes in 3 colours: pairs of classes look alike, so no run reaches the target and stops.
    data = imagefolder_tree(tmp_path / "data", classes=6, per_class=3)
    first = cli(
        [*RUN, *flags(epochs=2, data_dir=data), *dirs(tmp_path)], env={"ELASTIC_TRAIN_FAULTS": "raise:rank=0:step=2"}
    )
    assert first.returncode not in (0, 2), first.output  # failed after the epoch-1 checkpoint

    moved = shutil.copytree(data, tmp_path / "scratch" / "data")  # e.g. staged to node-local disk
    second = cli([*RUN, *flags(epochs=3, base_lr=0.002, data_dir=moved), *dirs(tmp_path)])
    assert second.returncode == 0, second.output
    assert "at epoch 2, step 1" in second.stdout, "the moved copy is the same dataset: resumed"
    listed = f"epochs 2 -> 3, base_lr 0.001 -> 0.002, data_dir {data} -> {moved}"
    assert f"Settings changed since the checkpoint: {listed}" in second.stdout
    assert second.stdout.count("Settings changed") == 1
    (changed,) = events(tmp_path / "logs", 0, "resume_config_changed")
    assert changed["level"] == "warning"
    assert changed["changes"] == {
        "epochs": {"old": 2, "new": 3},
        "base_lr": {"old": 0.001, "new": 0.002},
        "data_dir": {"old": str(data), "new": str(moved)},
    }

    (moved / "train" / "class_0" / "extra.png").write_bytes((moved / "train" / "class_1" / "0.png").read_bytes())
    third = cli([*RUN, *flags(epochs=4, data_dir=moved), *dirs(tmp_path)])
    assert third.returncode == 2, third.output
    assert "data.train_samples: checkpoint 18, this run 19" in third.stderr
    assert "data.train_content: checkpoint '18 files, sha256 " in third.stderr
    assert "Fix: resume on the dataset the checkpoint was trained on" in third.stderr
    assert "Traceback" not in third.stderr
