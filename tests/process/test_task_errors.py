"""A task's mistakes are found at start (exit 2, one message with the fix), not as a crash that
torchrun retries on every attempt."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import cli, dirs, flags

RUN = flags(batch_size=16, max_steps_per_epoch=3, epochs=1, target_accuracy=1.0)


def test_a_model_with_parameters_the_loss_never_uses_is_refused_naming_the_task_setting(tmp_path: Path) -> None:
    done = cli([*RUN, "--task", "tests.tasks:idle_branch", *dirs(tmp_path / "a")])
    assert done.returncode == 2, done.output
    assert "took no part in the loss" in done.stderr and "Task(find_unused_parameters=True)" in done.stderr
    assert "Traceback" not in done.output
    declared = cli([*RUN, "--task", "tests.tasks:idle_branch_declared", *dirs(tmp_path / "b")])
    assert declared.returncode == 0, declared.output


def test_flags_a_task_does_not_use_are_named_at_start_and_never_refuse_its_resume(tmp_path: Path) -> None:
    first = cli([*RUN, "--task", "tests.tasks:idle_branch_declared", *dirs(tmp_path)])
    assert first.returncode == 0, first.output
    more = cli(
        [*RUN, "--epochs", "2", "--model", "resnet18", "--task", "tests.tasks:idle_branch_declared", *dirs(tmp_path)]
    )
    assert more.returncode == 0, more.output
    assert "Ignored with task idle-branch: --model resnet18" in more.stdout
    assert "Extending the finished run" in more.stdout, more.stdout  # not refused for another --model


def test_a_regression_task_stops_early_on_its_own_metric_and_shows_no_accuracy(tmp_path: Path) -> None:
    done = cli(
        [*flags(batch_size=32, max_steps_per_epoch=12, epochs=20), "--task", "tests.tasks:regression", *dirs(tmp_path)]
    )
    assert done.returncode == 0, done.output
    assert "Early stopping at epoch" in done.stdout and "val_loss" in done.stdout, done.stdout
    epochs = [line for line in done.stdout.splitlines() if line.startswith("Epoch ")]
    assert epochs and all("acc=" not in line for line in epochs), epochs
    assert len(epochs) < 20, "it never stopped on its target"
