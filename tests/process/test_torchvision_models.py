"""``python -m elastic_train --model torchvision:<name>``: a registry model trains, crashes, resumes
exactly, and is refused with exit 2 where it cannot train (issue 10, example c)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import latest_target, step_dir_name
from tests.helpers import assert_bitwise_equal, cli, dirs, epoch_metrics, final_state, flags

pytestmark = pytest.mark.timeout(240)

MODEL = "torchvision:mobilenet_v3_small"
# Four steps in two epochs; synchronous saves commit at each epoch end, so a crash at step 3
# resumes from step 2 whatever the asynchronous commit protocol does.
RUN = [
    "--dataset",
    "synthetic",
    *flags(batch_size=16, max_steps_per_epoch=2, max_val_samples=64, epochs=2, target_accuracy=1.0, patience=0),
    "--no-async-checkpoint",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    done = cli(["--model", MODEL, *RUN, *dirs(base)])
    assert done.returncode == 0, done.output
    assert f"model: {MODEL} (" in done.stdout and "10 classes, 32px" in done.stdout
    return base


def test_a_torchvision_model_resumes_after_a_crash_and_ends_equal_to_an_uninterrupted_run(
    tmp_path: Path, reference: Path
) -> None:
    fault = {"ELASTIC_TRAIN_FAULTS": "raise:rank=0:step=3"}
    crashed = cli(["--model", MODEL, *RUN, *dirs(tmp_path)], env=fault)
    assert crashed.returncode == 1 and "injected fault: raise at step 3" in crashed.output
    assert latest_target(tmp_path / "ckpt") == tmp_path / "ckpt" / step_dir_name(2)
    resumed = cli(["--model", MODEL, *RUN, *dirs(tmp_path)], env=fault)  # the fault fires once per run
    assert resumed.returncode == 0, resumed.output
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(2)} at epoch 2, step 2" in resumed.stdout
    assert "Epoch 2/2: " in resumed.stdout and "Epoch 1/2: " not in resumed.stdout
    # Weights, BatchNorm statistics and optimizer state: bit for bit those of the reference.
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    assert epoch_metrics(tmp_path) == epoch_metrics(reference)


def test_resuming_with_another_torchvision_model_is_refused_naming_both(tmp_path: Path, reference: Path) -> None:
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt", symlinks=True)
    done = cli(["--model", "torchvision:shufflenet_v2_x0_5", *RUN, *dirs(tmp_path)])
    assert done.returncode == 2, done.output
    assert f"model: checkpoint '{MODEL}', this run 'torchvision:shufflenet_v2_x0_5'" in done.stderr
    assert "Traceback" not in done.output


def test_an_unknown_torchvision_model_exits_2_with_the_closest_names_before_touching_the_disk(
    tmp_path: Path,
) -> None:
    done = cli(["--model", "torchvision:mobilenet_v3_smal", *RUN, *dirs(tmp_path)])
    assert done.returncode == 2, done.output
    assert "has no model named 'mobilenet_v3_smal'" in done.stderr
    assert "did you mean torchvision:mobilenet_v3_small" in done.stderr and "Traceback" not in done.output
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


def test_images_too_small_for_the_architecture_exit_2_naming_the_image_size_to_pass(tmp_path: Path) -> None:
    done = cli(["--model", "torchvision:alexnet", *RUN, *dirs(tmp_path)])
    assert done.returncode == 2, done.output
    assert "torchvision:alexnet needs images of at least 63x63; the dataset's are 32x32" in done.stderr
    assert "Fix: pass --image-size 63 or more" in done.stderr and "Traceback" not in done.output
    assert latest_target(tmp_path / "ckpt") is None, "nothing trained, nothing saved"
