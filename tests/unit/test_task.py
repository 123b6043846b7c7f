"""Plug-in tasks: loading ``--task`` specs, the default per-batch functions, indexed items."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elastic_train.cli import main
from elastic_train.config import TrainConfig
from elastic_train.data import Indexed
from elastic_train.errors import UsageError
from elastic_train.task import Task, TaskData, argmax_correct, build_task, load_task_factory, move_to


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("examples.lm_task", "is not of the form package.module:function"),
        ("examples.lm_task:", "is not of the form package.module:function"),
        ("no_such_module_xyz:task", "cannot import 'no_such_module_xyz'"),
        ("examples.lm_task:nope", "examples.lm_task has no function 'nope'"),
        ("examples.lm_task:CONTEXT", "examples.lm_task has no function 'CONTEXT'"),
    ],
)
def test_a_bad_task_spec_names_the_problem_and_the_fix(spec: str, problem: str) -> None:
    with pytest.raises(UsageError, match=r"package\.module:function") as err:
        load_task_factory(spec)
    assert problem in str(err.value)


def test_a_factory_that_returns_something_else_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "not_a_task.py").write_text("def task(cfg):\n    return {'model': None}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"returned dict, not an elastic_train\.Task"):
        build_task("not_a_task:task", TrainConfig())
    sys.modules.pop("not_a_task", None)


def test_the_example_task_builds_from_a_config() -> None:
    task = build_task("examples.lm_task:task", TrainConfig(batch_size=8))
    assert isinstance(task, Task) and task.name == "char-lm" and set(task.metrics) == {"bits_per_char"}
    data = task.data()
    assert len(data) > 1000 and data.identify()["context"] == 32
    assert task.rate_unit == "samples"


def test_the_command_line_refuses_an_unknown_task_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--task", "no_such_module_xyz:task"]) == 2
    err = capsys.readouterr().err
    assert "cannot import 'no_such_module_xyz'" in err and "Fix: pass --task package.module:function" in err


def test_argmax_correct_counts_samples_and_fractions_of_sequences() -> None:
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0]])
    assert argmax_correct(logits, torch.tensor([0, 1, 1])).item() == 2
    # [N=2, C=2, T=4]: sample 0 right at 3 of 4 positions, sample 1 at 1 of 4 -> 1.0 sample.
    seq = torch.zeros(2, 2, 4)
    seq[0, 1, :3] = 1.0
    seq[1, 1, :1] = 1.0
    targets = torch.ones(2, 4, dtype=torch.long)
    assert argmax_correct(seq, targets).item() == pytest.approx(1.0)


def test_move_to_needs_input_target_pairs() -> None:
    x, y = move_to([torch.ones(2), torch.zeros(2)], torch.device("cpu"))
    assert x.shape == y.shape == (2,)
    with pytest.raises(ValueError, match="pass to_device"):
        move_to([torch.ones(2)], torch.device("cpu"))


def test_indexed_appends_the_index_and_passes_epoch_keys_only_when_asked() -> None:
    class ByIndex(torch.utils.data.Dataset[tuple[int, int]]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, key: int) -> tuple[int, int]:
            return key * 10, key % 2

    class ByEpoch(ByIndex):
        def __getitem__(self, key: object) -> tuple[int, int]:  # type: ignore[override]
            epoch, index = key  # type: ignore[misc]
            return epoch, index

    assert Indexed(ByIndex())[(3, 7)] == (70, 1, 7)
    assert Indexed(ByIndex())[4] == (40, 0, 4)
    assert Indexed(ByEpoch(), by_epoch=True)[(3, 7)] == (3, 7, 7)


def test_task_data_describes_itself_by_default() -> None:
    data = TaskData(train=list(range(5)), val=list(range(2)))  # type: ignore[arg-type]
    assert data.describe() == "5 train / 2 val" and data.identify() == {"train_samples": 5, "val_samples": 2}
