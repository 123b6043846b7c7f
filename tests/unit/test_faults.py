"""ELASTIC_TRAIN_FAULTS parsing and fire-once semantics."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_train import faults as faults_module
from elastic_train.errors import UsageError
from elastic_train.faults import CheckpointFaults, Fault, FaultInjector, InjectedFault, parse_faults


def test_grammar() -> None:
    faults = parse_faults("kill:rank=1:step=7, raise:rank=0:step=3:always,kill_in_save:rank=1:step=10:stage=manifest")
    assert faults[0] == Fault("kill", 1, 7)
    assert faults[1] == Fault("raise", 0, 3, always=True)
    assert faults[2].kind == "kill_in_save" and dict(faults[2].params) == {"stage": "manifest"}
    assert parse_faults("") == []


@pytest.mark.parametrize(
    "spec",
    [
        "explode:rank=0:step=1",
        "kill:rank=0",
        "kill:rank=a:step=1",
        "kill:step=0:rank=0",
        "kill:rank",
        "slow_save:rank=0:step=4",
        "slow_save:rank=0:step=4:seconds=0",
        "slow_save:rank=0:step=4:seconds=soon",
        "slow_save:rank=0:step=4:seconds=inf",
    ],
)
def test_bad_specs_are_usage_errors(spec: str) -> None:
    with pytest.raises(UsageError, match="ELASTIC_TRAIN_FAULTS"):
        parse_faults(spec)


def test_a_fault_fires_once_per_run_across_restarts(tmp_path: Path) -> None:
    faults = parse_faults("raise:rank=1:step=3")
    first = FaultInjector(faults, rank=1, marker_dir=tmp_path)
    first.at_step(2)
    with pytest.raises(InjectedFault):
        first.at_step(3)
    restarted = FaultInjector(faults, rank=1, marker_dir=tmp_path)  # a new process, same markers
    restarted.at_step(3)
    assert list(tmp_path.iterdir())


def test_always_fires_on_every_attempt_and_only_on_its_rank(tmp_path: Path) -> None:
    faults = parse_faults("raise:rank=1:step=3:always")
    for _ in range(3):
        with pytest.raises(InjectedFault):
            FaultInjector(faults, rank=1, marker_dir=tmp_path).at_step(3)
    FaultInjector(faults, rank=0, marker_dir=tmp_path).at_step(3)
    assert not FaultInjector(faults, rank=0, marker_dir=tmp_path).active


def test_hooks_elsewhere_match_on_parameters(tmp_path: Path) -> None:
    injector = FaultInjector(parse_faults("enospc:rank=0:step=4:stage=shard"), 0, tmp_path)
    assert not injector.fires("enospc", 4, stage="manifest")
    assert injector.fires("enospc", 4, stage="shard")
    assert not injector.fires("enospc", 4, stage="shard")


def test_slow_save_sleeps_in_the_writer_before_that_steps_shard_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    hooks = CheckpointFaults(FaultInjector(parse_faults("slow_save:rank=0:step=4:seconds=2.5"), 0, tmp_path))
    shard = tmp_path / "step-4" / "shard-0-of-2.safetensors"
    hooks.on_save("before_shard", 3, shard)
    hooks.on_save("after_shard", 4, shard)
    assert slept == []
    hooks.on_save("before_shard", 4, shard)
    assert slept == [2.5]
    hooks.on_save("before_shard", 4, shard)  # once per run, like every fault
    assert slept == [2.5]
