"""The job scripts under a real Slurm: completion, preemption -> requeue -> exact resume, crash cap.

Needs a Slurm controller (`.ci/local-slurm.sh start` gives a single-node one; `.ci/run` does it
and sets ELASTIC_TRAIN_REQUIRE_SLURM=1, so in CI a missing cluster fails instead of skipping).
Every job runs the real scripts in jobs/ with the project's venv, on 2 CPU processes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic_train.outcome import PREEMPTED_MARKER, ExitCode
from elastic_train.testing.etcd import require_etcd
from tests.helpers import (
    ROOT,
    TOKEN_VAR,
    assert_bitwise_equal,
    base_env,
    final_state,
    flags,
    free_port,
    kill_tagged,
    reference_run,
    state_hash,
)
from tests.helpers import dirs as trainer_dirs

pytestmark = pytest.mark.timeout(600)
# What jobs/lib/common.sh prints when it requeues on the trainer's preemption marker.
PREEMPTED_LINE = re.compile(r"preempted by SIGUSR1 at step \d+ \(checkpoint committed\); requeueing job")

# A global batch of 16: the preemption, requeue and resume are the same at 32; this file took
# 343 CPU-s at 32 and 310 at 16 (Dec 7, alone on 2 cores: start-ups and Slurm's own waits are most of it).
RUN = flags(
    batch_size=16,
    max_steps_per_epoch=60,
    max_val_samples=64,
    epochs=2,
    target_accuracy=1.0,
    patience=0,
    checkpoint_every=5,
)
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def slurm_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not installed (start a local cluster: sudo .ci/local-slurm.sh start)"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if "is UP" not in ping.stdout:
        return f"no Slurm controller answers `scontrol ping` ({ping.stdout.strip()}{ping.stderr.strip()})"
    return None


@dataclass
class Job:
    id: str
    output: Path

    def info(self) -> dict[str, str]:
        done = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True, timeout=30)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def wait(self, timeout: float) -> dict[str, str]:
        """Until the job is over for good (a requeue passes through PENDING, never a terminal state)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(1)
        raise AssertionError(f"job {self.id} not finished after {timeout}s: {self.info()}\n{self.text()}")


class Cluster:
    """Submits jobs from the project root; cancels them and kills their processes afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = base_env({"ET_VENV": sys.prefix})
        self.jobs: list[Job] = []

    def submit(self, script: str, args: list[str], env: dict[str, str], *sbatch: str) -> Job:
        output = self.tmp / f"job-{len(self.jobs)}.out"
        cmd = ["sbatch", "--parsable", f"--output={output}", "--cpus-per-task=2", "--time=10", *sbatch, script, *args]
        done = subprocess.run(cmd, cwd=ROOT, env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        job = Job(done.stdout.strip().split(";")[0], output)
        self.jobs.append(job)
        return job

    def close(self) -> None:
        for job in self.jobs:
            subprocess.run(["scancel", job.id], capture_output=True, timeout=30)
        for job in self.jobs:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and job.info().get("JobState") not in TERMINAL:
                time.sleep(0.5)
        kill_tagged(self.env[TOKEN_VAR])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    problem = slurm_problem()
    if problem is not None:
        if os.environ.get("ELASTIC_TRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"ELASTIC_TRAIN_REQUIRE_SLURM=1 but {problem}")
        pytest.skip(problem)
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def dirs(base: Path) -> dict[str, str]:
    return {"ET_LOG_DIR": str(base / "logs"), "ET_CHECKPOINT_DIR": str(base / "ckpt")}


def committed(log_dir: Path) -> bool:
    """Rank 0 has logged a checkpoint commit (the log may not exist yet, or end mid-line)."""
    try:
        return '"event": "checkpoint_committed"' in (log_dir / "rank-0.jsonl").read_text()
    except FileNotFoundError:
        return False


def wait_for_checkpoint(job: Job, log_dir: Path, timeout: float = 180) -> None:
    """Until the job has committed its first checkpoint (so a signal lands mid-training)."""
    deadline = time.monotonic() + timeout
    while not committed(log_dir):
        info = job.info()
        assert info.get("JobState") not in TERMINAL, f"job ended early: {info}\n{job.text()}"
        assert time.monotonic() < deadline, f"no checkpoint after {timeout}s\n{job.text()}"
        time.sleep(0.2)


def uninterrupted(base: Path, args: list[str]) -> None:
    """The same training without Slurm and without a signal, by 2 forked ranks: the bitwise
    reference. jobs/train.sbatch passes the trainer its ``ET_*_DIR`` folders (``dirs``) and the
    arguments; its launch outside Slurm is tests/launch/test_train_sbatch.py's."""
    reference_run(2, [*args, *trainer_dirs(base)], timeout=240)


def test_train_sbatch_runs_to_completion(cluster: Cluster, tmp_path: Path) -> None:
    # The command of README.md and docs/slurm.md: sbatch --cpus-per-task=2 jobs/train.sbatch ...
    job = cluster.submit("jobs/train.sbatch", ["--epochs", "2", "--max-steps-per-epoch", "10"], dirs(tmp_path))
    info = job.wait(240)
    text = job.text()
    assert info["JobState"] == "COMPLETED", text
    assert "Training started with 2 processes" in text and "Training completed successfully." in text
    assert "(restart 0)" in text and "requeueing" not in text


def test_usr1_checkpoints_requeues_and_resumes_exactly(cluster: Cluster, tmp_path: Path) -> None:
    uninterrupted(tmp_path / "reference", RUN)
    base = tmp_path / "slurm"
    job = cluster.submit("jobs/train.sbatch", RUN, dirs(base))
    wait_for_checkpoint(job, base / "logs", timeout=150)
    subprocess.run(["scancel", "-s", "USR1", "-b", job.id], check=True, timeout=30)
    info = job.wait(200)
    text = job.text()
    assert info["JobState"] == "COMPLETED", text
    assert info["Restarts"] == "1", info  # SLURM_RESTART_COUNT=1 in the second run
    first, _, second = text.partition("(restart 1)")
    assert second, f"the requeued run did not start:\n{text}"
    assert "forwarding SIGUSR1" in first and PREEMPTED_LINE.search(first), first
    assert "requeueing job" in first, first
    assert f"Resumed from {base / 'ckpt'}" in second, second
    assert "(preemption: 1)" in second and "Steps recomputed: 0" in second, second
    assert "Training completed successfully." in second
    assert_bitwise_equal(final_state(tmp_path / "reference"), final_state(base))


def test_a_crash_is_requeued_at_most_the_cap_then_fails_with_its_cause(cluster: Cluster, tmp_path: Path) -> None:
    env = {**dirs(tmp_path), "ELASTIC_TRAIN_FAULTS": "raise:rank=1:step=3:always", "ET_MAX_REQUEUES": "2"}
    job = cluster.submit(
        "jobs/train.sbatch", ["--max-steps-per-epoch", "5", "--epochs", "2", "--max-val-samples", "64"], env
    )
    info = job.wait(240)
    text = job.text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "2", info
    assert text.count("requeueing job") == 2, text
    assert "not requeued: SLURM_RESTART_COUNT=2 has reached the cap of 2" in text
    assert "InjectedFault" in text and "injected fault: raise at step 3" in text  # torchrun's root cause


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_multinode_sbatch_preempts_requeues_and_resumes(cluster: Cluster, tmp_path: Path, backend: str) -> None:
    # One node here: the store, srun's signal relay and the agent's requeue loop are the same as on
    # many (two agents losing and regaining a node are in tests/launch/test_elastic.py; an etcd
    # member lost with a node in tests/launch/test_etcd_rendezvous.py). With etcd the job starts a
    # member per node (one here) beside the agents, and its requeued run a new cluster.
    if backend == "etcd":
        require_etcd()
    env = {**dirs(tmp_path), "ET_RDZV_PORT": str(free_port()), "ET_NPROC": "2", "ET_RDZV_BACKEND": backend}
    job = cluster.submit("jobs/multinode.sbatch", RUN, env, "--nodes=1")
    wait_for_checkpoint(job, tmp_path / "logs", timeout=150)
    subprocess.run(["scancel", "-s", "USR1", "-b", job.id], check=True, timeout=30)
    info = job.wait(200)
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    first, _, second = text.partition("(restart 1)")
    assert "forwarding SIGUSR1" in first and PREEMPTED_LINE.search(first), first
    assert "requeueing job" in first, first
    assert "Resumed from" in second and "Steps recomputed: 0" in second, second
    assert "Training completed successfully." in second
    if backend == "etcd":
        assert first.count("etcd rendezvous on") == 1 and second.count("etcd rendezvous on") == 1, text
        assert "rendezvous etcd-v2" in first and "rendezvous etcd-v2" in second, text
        # Each run's member stopped cleanly, at the end or at the requeue (SIGTERM, exit 0): no
        # failure reported, no etcd left running, no data left behind.
        assert "etcd ended with no stop asked" not in text and "elastic-train etcd:" not in text, text
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        assert not list(tmp.glob(f"elastic-train-etcd-{job.id}-*")), "a member's data folder was left behind"
        left = subprocess.run(["pgrep", "-f", f"elastic-train-etcd-{job.id}-"], capture_output=True, text=True)
        assert not left.stdout.strip(), f"etcd still running: {left.stdout}"


def test_a_cancelled_job_saves_but_is_not_requeued(cluster: Cluster, tmp_path: Path) -> None:
    job = cluster.submit("jobs/train.sbatch", RUN, dirs(tmp_path))
    wait_for_checkpoint(job, tmp_path / "logs", timeout=150)
    subprocess.run(["scancel", job.id], check=True, timeout=30)  # SIGTERM to the job, then SIGKILL
    info = job.wait(120)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    time.sleep(10)  # longer than a requeue would take to show (cred_expire=5, .ci/local-slurm.sh)
    info = job.info()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", f"{info}\n{job.text()}"


def test_a_node_joining_a_multinode_job_is_not_a_preemption_and_the_job_completes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """torchrun stops its workers with SIGTERM when a node joins: they checkpoint and restart at the
    larger size. That must not be booked as a preemption, and the job must not requeue for it."""
    from elastic_train.testing.agents import Agent, all_events

    port = free_port()
    env = {**dirs(tmp_path), "ET_RDZV_PORT": str(port), "ET_NPROC": "1", "ET_NNODES": "1:2"}
    long_run = flags(
        batch_size=32, max_steps_per_epoch=30, max_val_samples=64, epochs=2, target_accuracy=1.0, patience=0
    )
    job = cluster.submit("jobs/multinode.sbatch", [*long_run, "--checkpoint-every", "5"], env, "--nodes=1")
    wait_for_checkpoint(job, tmp_path / "logs", timeout=150)
    # "A node joins": a second agent, outside the allocation, in the job's rendezvous.
    joiner = Agent("joiner", tmp_path, f"127.0.0.1:{port}", job.id, [*long_run, "--checkpoint-every", "5"])
    try:
        info = job.wait(300)
        joiner.wait(120)
    finally:
        joiner.cleanup()
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{text}"
    assert "requeueing" not in text and "Training completed successfully." in text + joiner.output
    assert not (tmp_path / "ckpt" / PREEMPTED_MARKER).exists()
    stops = [e for e in all_events(tmp_path, "exit") if e.get("reason") == "stopped"]
    assert stops and all(e["code"] == ExitCode.STOPPED for e in stops), "the membership change did not stop the workers"
    assert any(e["world_size"] == 2 for e in all_events(tmp_path, "first_step")), "the job never grew to 2"


TASK_RUN = [
    "--task",
    "examples.lm_task:task",
    *flags(epochs=2, batch_size=16, target_accuracy=1.0, checkpoint_every=5),  # 70 steps per epoch
]


def test_a_plug_in_task_job_is_preempted_requeued_and_resumes_bit_for_bit(cluster: Cluster, tmp_path: Path) -> None:
    """jobs/train.sbatch --task ...: the plug-in gets the Slurm machinery unchanged, its extra
    state (an EMA of the weights) included."""
    reference = tmp_path / "reference"
    uninterrupted(reference, TASK_RUN)
    base = tmp_path / "slurm"
    job = cluster.submit("jobs/train.sbatch", TASK_RUN, dirs(base))
    wait_for_checkpoint(job, base / "logs", timeout=150)
    subprocess.run(["scancel", "-s", "USR1", "-b", job.id], check=True, timeout=30)
    info = job.wait(200)
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    assert "char-lm (examples.lm_task:task)" in text and "bits_per_char=" in text
    for family in (("model.",), ("extra.",)):
        assert state_hash(base / "ckpt", family) == state_hash(reference / "ckpt", family), family
