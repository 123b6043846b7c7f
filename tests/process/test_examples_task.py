"""Example (b): a ``--task`` plug-in with non-image data (generated text) and extra checkpointed
state (an EMA of the weights), trained by the built-in trainer on two gloo ranks.

A run that fails mid-epoch (dropout active, the EMA moving) and is started again ends with the
same weights and the same EMA, bit for bit, as a run never interrupted; a checkpoint of the task
is refused by a run of another task.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import flags, ranks, read_jsonl, state_hash, wait_all

TASK = [
    "--task",
    "examples.lm_task:task",
    *flags(epochs=2, batch_size=16, max_steps_per_epoch=6, target_accuracy=1.0, checkpoint_every=2, threads=1),
    "--no-async-checkpoint",  # step 8's checkpoint is committed before step 9's fault
]


def _run(base: Path, env: dict[str, str] | None = None) -> list[int]:
    args = [*TASK, *flags(log_dir=base / "logs", checkpoint_dir=base / "ckpt")]
    with ranks(2, args, env) as procs:
        done = wait_all(procs, timeout=150)
    return [d.returncode for d in done]


@pytest.mark.timeout(300)
def test_a_plug_in_task_resumes_mid_epoch_bit_for_bit_with_its_extra_state(tmp_path: Path) -> None:
    assert _run(tmp_path / "clean") == [0, 0]
    faulty = tmp_path / "faulty"
    codes = _run(faulty, {"ELASTIC_TRAIN_FAULTS": "raise:rank=0:step=9"})
    assert codes[0] not in (0, 2), "the injected fault ends the first attempt"
    assert _run(faulty) == [0, 0]

    (resumed,) = [e for e in read_jsonl(faulty / "logs" / "rank-0.jsonl") if e.get("event") == "resumed"]
    assert resumed["step"] == 8 and resumed["batch_in_epoch"] == 2, "resumed mid-epoch 2"
    for part in (("model.",), ("extra.",)):
        assert state_hash(faulty / "ckpt", part) == state_hash(tmp_path / "clean" / "ckpt", part), part
    clean = read_jsonl(tmp_path / "clean" / "logs" / "metrics.jsonl")
    again = read_jsonl(faulty / "logs" / "metrics.jsonl")
    assert [r["sample_digest"] for r in again] == [r["sample_digest"] for r in clean], "every sample once"
    assert again[-1]["val_metrics"] == clean[-1]["val_metrics"] and "bits_per_char" in clean[-1]["val_metrics"]


@pytest.mark.timeout(200)
def test_a_checkpoint_of_a_task_is_refused_by_a_run_of_another_task(tmp_path: Path) -> None:
    assert _run(tmp_path) == [0, 0]
    args = [*flags(epochs=3, batch_size=16, max_steps_per_epoch=2, log_dir=tmp_path / "logs")]
    with ranks(1, [*args, *flags(checkpoint_dir=tmp_path / "ckpt")]) as procs:
        (done,) = wait_all(procs, timeout=120)
    assert done.returncode == 2, done.output
    assert "task: checkpoint 'examples.lm_task:task', this run None" in done.stderr
