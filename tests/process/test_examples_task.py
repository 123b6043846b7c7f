"""Example (b): a ``--task`` plug-in with non-image data (generated text) and extra checkpointed
state (an EMA of the weights), trained by the built-in trainer on two gloo ranks.

A run that fails mid-epoch (dropout active, the EMA moving) and is started again ends with the
same weights and the same EMA, bit for bit, as a run never interrupted; a checkpoint of the task
is refused by a run of another task.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import flags, read_jsonl, run_ranks, state_hash

TASK = [
    "--task",
    "examples.lm_task:task",
    *flags(epochs=2, batch_size=16, max_steps_per_epoch=6, target_accuracy=1.0, checkpoint_every=2, threads=1),
    "--no-async-checkpoint",  # step 8's checkpoint is committed before step 9's fault
]


def _run(base: Path, env: dict[str, str] | None = None, world_size: int = 2) -> list[int]:
    args = [*TASK, *flags(log_dir=base / "logs", checkpoint_dir=base / "ckpt")]
    done = run_ranks(world_size, args, timeout=150, env=env)
    return [d.returncode for d in done]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted two-rank run every other run is compared with."""
    base = tmp_path_factory.mktemp("clean")
    assert _run(base) == [0, 0]
    return base


@pytest.mark.timeout(300)
def test_a_plug_in_task_resumes_mid_epoch_bit_for_bit_with_its_extra_state(clean: Path, tmp_path: Path) -> None:
    faulty = tmp_path / "faulty"
    codes = _run(faulty, {"ELASTIC_TRAIN_FAULTS": "raise:rank=0:step=9"})
    assert codes[0] not in (0, 2), "the injected fault ends the first attempt"
    assert _run(faulty) == [0, 0]

    (resumed,) = [e for e in read_jsonl(faulty / "logs" / "rank-0.jsonl") if e.get("event") == "resumed"]
    assert resumed["step"] == 8 and resumed["batch_in_epoch"] == 2, "resumed mid-epoch 2"
    for part in (("model.",), ("extra.",)):
        assert state_hash(faulty / "ckpt", part) == state_hash(clean / "ckpt", part), part
    reference = read_jsonl(clean / "logs" / "metrics.jsonl")
    again = read_jsonl(faulty / "logs" / "metrics.jsonl")
    assert [r["sample_digest"] for r in again] == [r["sample_digest"] for r in reference], "every sample once"
    assert again[-1]["val_metrics"] == reference[-1]["val_metrics"]
    assert "bits_per_char" in reference[-1]["val_metrics"]


@pytest.mark.timeout(300)
def test_a_plug_in_task_continues_at_another_world_size_with_every_sample_once(clean: Path, tmp_path: Path) -> None:
    """Two ranks fail mid-epoch 2; one rank continues: the same global batches, each sample once."""
    assert _run(tmp_path, {"ELASTIC_TRAIN_FAULTS": "raise:rank=1:step=9"})[1] not in (0, 2)
    assert _run(tmp_path, world_size=1) == [0]
    reference = read_jsonl(clean / "logs" / "metrics.jsonl")
    resized = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert [(r["samples_seen"], r["sample_digest"]) for r in resized] == [
        (r["samples_seen"], r["sample_digest"]) for r in reference
    ]
    assert resized[-1]["world_size"] == 1 and resized[-1]["val_samples"] == reference[-1]["val_samples"]


@pytest.mark.timeout(200)
def test_a_checkpoint_of_a_task_is_refused_by_a_run_of_another_task(clean: Path, tmp_path: Path) -> None:
    args = [*flags(epochs=3, batch_size=16, max_steps_per_epoch=2, log_dir=tmp_path / "logs")]
    (done,) = run_ranks(1, [*args, *flags(checkpoint_dir=clean / "ckpt")], timeout=120)
    assert done.returncode == 2, done.output
    assert "task.name: checkpoint 'char-lm', this run None" in done.stderr
