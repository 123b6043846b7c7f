"""Plug-in tasks: loading ``--task`` specs, the default per-batch functions, indexed items."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
from elastic_train.cli import main
from elastic_train.config import TrainConfig
from elastic_train.data import Indexed, open_task_data
from elastic_train.distributed.env import DistEnv
from elastic_train.errors import DataError, UsageError
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


def test_the_command_line_refuses_an_unknown_task_with_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command line would point structlog at this test's captured stdout, closed after it.
    monkeypatch.setattr("elastic_train.cli.configure_logging", lambda env: None)
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


def test_a_fingerprint_that_json_cannot_give_back_is_refused_on_every_rank(world_of_one: None, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"fingerprint\.shape\[0\]|fingerprint\.shape: tuple"):
        Checkpointer(CheckpointConfig(root=tmp_path), DistEnv(), {"shape": (3, 32)})
    with pytest.raises(UsageError, match=r"fingerprint\.root: PosixPath"):
        Checkpointer(CheckpointConfig(root=tmp_path), DistEnv(), {"root": tmp_path})


def _task(data: TaskData) -> Task:
    return Task(name="toy", data=lambda: data, model=lambda _: torch.nn.Linear(2, 2))


def test_plug_in_data_that_cannot_be_sampled_exactly_is_bad_input(world_of_one: None) -> None:
    class Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, int]]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield torch.zeros(2), 0

    cfg = TrainConfig(batch_size=2)
    pairs = [(torch.zeros(2), 0)] * 8
    with pytest.raises(DataError, match="toy: the train dataset \\(Stream\\) is not map-style"):
        open_task_data(_task(TaskData(train=Stream(), val=pairs)), cfg, DistEnv())  # type: ignore[arg-type]
    odd = TaskData(train=pairs, val=pairs, identity=lambda: {"made": Path("/data")})  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"the data's identity\.made: PosixPath"):
        open_task_data(_task(odd), cfg, DistEnv())


def test_an_item_that_is_not_an_input_target_tuple_is_named() -> None:
    with pytest.raises(TypeError, match=r"item 1 of list is a Tensor: .* must be \(inputs, target\) tuples"):
        Indexed([torch.zeros(2)] * 3)[1]  # type: ignore[arg-type]


def test_a_checkpoint_without_the_tasks_extra_state_is_refused_not_crashed_on(
    world_of_one: None, tmp_path: Path
) -> None:
    from elastic_train.checkpoint.snapshot import Position, capture
    from elastic_train.distributed.process_group import choose_placement
    from elastic_train.trainer import Trainer
    from examples.lm_task import task as lm_task

    cfg = TrainConfig(batch_size=8, checkpoint_dir=tmp_path, log_dir=tmp_path / "logs")
    env = DistEnv()
    task = lm_task(cfg)
    trainer = Trainer(cfg, env, choose_placement("cpu", env), task, task.data())
    assert trainer.extra is not None
    ck = Checkpointer(CheckpointConfig(root=tmp_path), env, {"t": 1})
    ck.start()
    ck.save(capture(Position(1), trainer.module, trainer.optimizer, device=torch.device("cpu")), sync=True)
    loaded = ck.resume()
    ck.close()
    assert loaded is not None
    with pytest.raises(UsageError, match="has no extra state, but task char-lm keeps some"):
        trainer.restore(loaded)
    trainer.close()


def test_task_data_with_an_identity_that_is_not_a_function_is_refused_at_once() -> None:
    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(UsageError, match=r"identity=\.\.\.\) got a dict, not a function"):
        TaskData(data, data, identity={"sha256": "abc"})  # type: ignore[arg-type]


def test_a_scheduler_a_checkpoint_cannot_save_is_refused_at_start() -> None:
    class NoState:
        def step(self) -> None: ...

    task = Task(name="t", data=lambda: None, model=lambda _: None, scheduler=lambda opt, n: NoState())  # type: ignore[arg-type, return-value]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UsageError, match="has no state_dict, load_state_dict"):
        task.make_scheduler(opt, 10)
