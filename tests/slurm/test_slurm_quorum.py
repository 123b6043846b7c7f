"""``ET_FT=quorum`` under a real Slurm: preemption -> requeue -> resume, every sample exactly once.

jobs/train.sbatch launches ``python -m elastic_train.quorum.launch`` (two replica groups of one
worker on the one node, the Lighthouse started by the agent) instead of torchrun; the signal
forwarding, the preemption marker and the requeue are the same shell code as in restart mode
(tests/slurm/test_slurm.py), so what is checked here is that the quorum agent and its trainer
keep that contract. The exactly-once check of the final checkpoint against the data order is
tests/launch/test_quorum_trainer.py's, for this shorter run.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from elastic_train.checkpoint.manager import load
from elastic_train.data.sampler import global_batches
from elastic_train.metrics import format_digest, index_digest
from elastic_train.testing.etcd import require_etcd
from tests.helpers import flags, free_port
from tests.slurm.test_slurm import TERMINAL, Cluster, Job, cluster, dirs

__all__ = ["cluster"]  # the fixture, shared with test_slurm.py

pytestmark = pytest.mark.timeout(240)
EPOCHS, STEPS, BATCH, SEED, TRAIN_SAMPLES = 2, 20, 32, 42, 4096  # synthetic: 4096 training images
TOTAL = EPOCHS * STEPS
# SGD, as in test_quorum_trainer.py; a checkpoint every 5 steps, so the signal can follow the first.
RUN = flags(
    epochs=EPOCHS, max_steps_per_epoch=STEPS, batch_size=BATCH, seed=SEED, target_accuracy=1.0, patience=0,
    optimizer="sgd", base_lr=0.05, checkpoint_every=5, max_val_samples=64,
)  # fmt: skip
WORKER = re.compile(r"replica group (\d+): worker pid (\d+) \(restart (\d+)\)")  # the quorum agent's line
# What jobs/lib/common.sh prints when it requeues on the trainer's preemption marker (test_slurm.py's
# PREEMPTED_LINE, with the step captured).
PREEMPTED = re.compile(r"preempted by SIGUSR1 at step (\d+) \(checkpoint committed\); requeueing job")
RESUMED = re.compile(r"Resumed from (\S+) at epoch \d+, step (\d+)")
SEATED = re.compile(r"Lighthouse at \S+ \(pid \d+\), bound to \S+, holding its seat")


def wait_for_latest(job: Job, checkpoints: Path, timeout: float = 120) -> None:
    """Until the run has committed a checkpoint (``latest`` exists), so a signal lands mid-training."""
    deadline = time.monotonic() + timeout
    while not (checkpoints / "latest").exists():
        info = job.info()
        assert info.get("JobState") not in TERMINAL, f"job ended early: {info}\n{job.text()}"
        assert time.monotonic() < deadline, f"no checkpoint after {timeout}s\n{job.text()}"
        time.sleep(0.2)


def assert_one_worker_per_group(run: str) -> None:
    """A stop is not a failure: the agent restarts no worker for it."""
    workers = [(int(group), int(restart)) for group, _, restart in WORKER.findall(run)]
    assert sorted(workers) == [(0, 0), (1, 0)], f"one worker per replica group, none restarted: {workers}"


def assert_exactly_once(checkpoints: Path) -> None:
    """The final checkpoint: finished at the last step, every epoch's samples exactly once (the
    sample digest the trainer SUM-reduced over the quorum, against the data order computed here)."""
    done = load((checkpoints / "latest").resolve())
    assert done.manifest.finished and done.manifest.step == TOTAL, (done.manifest.step, done.manifest.finished)
    history = done.payload.app["history"]
    assert [r["epoch"] for r in history] == list(range(1, EPOCHS + 1)), history
    for epoch, record in enumerate(history):
        order = global_batches(TRAIN_SAMPLES, BATCH, SEED, epoch, STEPS).reshape(-1)
        assert record["samples_seen"] == STEPS * BATCH, record
        assert record["sample_digest"] == format_digest(index_digest(order)), f"epoch {epoch + 1}: skipped or repeated"


def test_a_quorum_job_is_preempted_requeued_and_resumes_with_every_sample_exactly_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    env = {**dirs(tmp_path), "ET_FT": "quorum", "ET_NPROC": "2"}
    job = cluster.submit("jobs/train.sbatch", RUN, env)
    wait_for_latest(job, tmp_path / "ckpt")
    subprocess.run(["scancel", "-s", "USR1", "-b", job.id], check=True, timeout=30)
    info = job.wait(150)
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    first, _, second = text.partition(f"job {job.id} (restart 1)")
    assert second, f"the requeued run did not start:\n{text}"
    for run in (first, second):
        assert "ft quorum" in run and "[quorum-agent] Lighthouse at http://127.0.0.1:" in run, run
        # A stop is not a failure: the agent restarts no worker for it, in either run.
        assert_one_worker_per_group(run)
    assert "forwarding SIGUSR1" in first, first
    preempted = PREEMPTED.search(first)
    assert preempted, f"the first run was not preempted (did it finish before the signal?):\n{first}"
    stopped_at = int(preempted.group(1))
    assert 0 < stopped_at < TOTAL, stopped_at
    assert "Training completed successfully." not in first
    # The whole quorum starts at step 0 after a requeue: its first attempt loads the checkpoint
    # committed at the preemption step (no step lost, none recomputed).
    resumed = RESUMED.search(second)
    assert resumed, f"the requeued run did not resume from the checkpoint:\n{second}"
    assert Path(resumed.group(1)).parent == tmp_path / "ckpt", resumed.group()
    assert int(resumed.group(2)) == stopped_at, (resumed.group(), stopped_at)
    assert "Training completed successfully." in second and "training finished (exit 0)" in second
    assert_exactly_once(tmp_path / "ckpt")


def test_a_multinode_quorum_job_with_the_lighthouses_seat_in_etcd_is_preempted_requeued_and_resumes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``ET_FT=quorum ET_RDZV_BACKEND=etcd sbatch jobs/multinode.sbatch``: the job starts an etcd
    member per node (one here), every agent is a candidate for the Lighthouse's seat, and the
    holder runs it; the preemption, requeue and resume are those above. (The seat moving when its
    node is lost: tests/launch/test_quorum_lighthouse_seat.py; this single-node cluster cannot
    lose one.)"""
    require_etcd()
    env = {**dirs(tmp_path), "ET_FT": "quorum", "ET_NPROC": "2", "ET_RDZV_BACKEND": "etcd"}
    env["ET_RDZV_PORT"] = str(free_port())
    job = cluster.submit("jobs/multinode.sbatch", RUN, env, "--nodes=1")
    wait_for_latest(job, tmp_path / "ckpt")
    subprocess.run(["scancel", "-s", "USR1", "-b", job.id], check=True, timeout=30)
    info = job.wait(200)
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    first, _, second = text.partition(f"job {job.id} (restart 1)")
    assert second, f"the requeued run did not start:\n{text}"
    for run in (first, second):
        assert "Lighthouse seat in etcd on" in run and "took the Lighthouse seat" in run, run
        assert SEATED.search(run), run
        assert_one_worker_per_group(run)
    assert PREEMPTED.search(first), f"the first run was not preempted:\n{first}"
    assert RESUMED.search(second) and "Training completed successfully." in second, second
    assert_exactly_once(tmp_path / "ckpt")
    # Each run's member stopped cleanly (SIGTERM, exit 0): no etcd left running, no data left.
    assert "etcd ended with no stop asked" not in text and "elastic-train etcd:" not in text, text
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    assert not list(tmp.glob(f"elastic-train-etcd-{job.id}-*")), "a member's data folder was left behind"
