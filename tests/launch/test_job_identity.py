"""Two plain torchrun jobs on one checkpoint directory are told apart.

torchrun's documented way to run several jobs on one host (``--rdzv-backend=c10d
--rdzv-endpoint=localhost:PORT``, no ``--rdzv-id``) gives every job the run id ``none``. Before
the job identity was minted in the rendezvous store, a second such job on the same
``--checkpoint-dir`` took the first one's lock as its own, resumed its state and trained to the
end, while the first one's commits failed (measured: 14 ``checkpoint_failed``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import MANIFEST, read_manifest, step_folders
from tests.helpers import Finished, events, flags, free_port, torchrun

RUN = flags(
    batch_size=8,
    max_steps_per_epoch=8,
    max_val_samples=64,
    epochs=1,
    target_accuracy=1.0,
    image_size=16,
    checkpoint_every=2,
    hang_timeout=300,  # the first job's rank 0 is held while the second starts: no watchdog exit
    collective_timeout=300,
)
SYNC = ["--no-async-checkpoint"]  # step 2 is committed before the hold at step 3


def plain_c10d(port: int, restarts: int) -> list[str]:
    return [
        "--nnodes=1",
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
    ]


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.timeout(420)
def test_a_second_plain_c10d_job_on_the_same_directory_is_refused_and_the_first_keeps_every_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    first_logs, second_logs = tmp_path / "first", tmp_path / "second"
    # The first job: rank 0 holds at step 3 (after step 2's checkpoint) until the file "go"
    # appears; rank 1 raises at step 5, so the first job's workers restart once.
    faults = "hold:rank=0:step=3:until=go,raise:rank=1:step=5"
    results: dict[str, Finished] = {}

    def first_job() -> None:
        results["first"] = torchrun(
            plain_c10d(free_port(), restarts=3),
            [*RUN, *SYNC, "--log-dir", str(first_logs), "--checkpoint-dir", str(ckpt)],
            timeout=360,
            env={"ELASTIC_TRAIN_FAULTS": faults},
        )

    thread = threading.Thread(target=first_job)
    thread.start()
    try:
        assert _wait_for(ckpt / ".faults" / "fault-hold-rank0-step3-untilgo.fired", 180), "the first job never held"
        second = torchrun(
            plain_c10d(free_port(), restarts=0),
            [*RUN, "--log-dir", str(second_logs), "--checkpoint-dir", str(ckpt)],
            timeout=180,
        )
    finally:
        (ckpt / ".faults").mkdir(parents=True, exist_ok=True)
        (ckpt / ".faults" / "go").write_text("go\n")
        thread.join(400)
    assert "is in use by" in second.output, f"the second job was not refused:\n{second.output[-4000:]}"
    assert "exitcode  : 2" in second.output or "exitcode: 2" in second.output, second.output[-3000:]
    assert "Training completed successfully." not in second.stdout
    assert not (second_logs / "metrics.jsonl").exists(), "the second job trained"

    assert "first" in results, "the first job timed out"
    first = results["first"]
    assert first.returncode == 0, first.output[-4000:]
    assert "Resumed from" in first.stdout, "the first job's restart did not resume its own checkpoint"
    starts = events(first_logs, 0, "start")
    assert len(starts) == 2, "the first job's workers were not restarted exactly once"
    assert starts[0]["job"] == starts[1]["job"], "a worker restart changed the job's identity"
    assert not events(first_logs, 0, "checkpoint_failed"), "the first job lost commits"
    assert not events(first_logs, 0, "checkpoint_lock_lost")
    manifests = [read_manifest(f) for f in step_folders(ckpt) if (f / MANIFEST).exists()]
    assert manifests and {m.timeline for m in manifests} == {manifests[0].timeline}, "checkpoints of two lines"
    assert any(m.finished for m in manifests)
    committed = {e["step"] for e in events(first_logs, 0, "checkpoint_committed")}
    assert {m.step for m in manifests} <= committed, "a checkpoint here was committed by another job"
