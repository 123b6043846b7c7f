"""Quorum mode composes with the rest: preemption and resume, checkpoints across modes, early
stop, bad input. Real agents (``python -m elastic_train.quorum.launch``) and real torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_train.checkpoint.manager import load
from elastic_train.faults import ENV_VAR as FAULTS
from elastic_train.outcome import ExitCode
from tests.helpers import BIN, ROOT, TOKEN_VAR, base_env, cli, final_state, kill_tagged, read_jsonl, torchrun
from tests.launch.test_quorum_trainer import RUN, TOTAL, Job, assert_exactly_once, events, max_abs_diff

AGENT = [str(BIN / "python"), "-m", "elastic_train.quorum.launch"]
STANDALONE_2 = ["--standalone", "--nproc-per-node=2"]


def launch(
    base: Path, *extra: str, nproc: int = 2, timeout: float = 120, faults: str = ""
) -> subprocess.CompletedProcess[str]:
    env = base_env({FAULTS: faults} if faults else None)
    command = [*AGENT, "--nproc-per-node", str(nproc), "-m", "elastic_train", *RUN, *extra]
    command += ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt")]
    try:
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    finally:
        kill_tagged(env[TOKEN_VAR])


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fault_free")
    done = launch(base)
    assert done.returncode == 0, done.stdout[-3000:]
    return base


def test_a_preempted_quorum_job_checkpoints_one_agreed_step_and_resumes_exactly(
    tmp_path: Path, fault_free: Path
) -> None:
    job = Job(tmp_path, base_env())
    try:
        node = job.start("--nproc-per-node", "2")
        job.until("training", lambda: job.committed_steps(0) >= 25)
        node.proc.send_signal(signal.SIGUSR1)  # as Slurm's preemption signal reaches the agent
        assert job.wait(node) == ExitCode.PREEMPTED, job.output()
    finally:
        kill_tagged(job.env[TOKEN_VAR])
    stopped = load((tmp_path / "ckpt" / "latest").resolve())
    assert 25 <= stopped.manifest.step < TOTAL and not stopped.manifest.finished
    out = (tmp_path / "node0.out").read_text()
    assert out.count(f"Preempted at step {stopped.manifest.step}: checkpoint committed") == 1, out[-2000:]
    resumed = launch(tmp_path)  # the requeued job: every replica at step 0 loads latest
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"Resumed from {tmp_path / 'ckpt'}" in resumed.stdout
    assert_exactly_once(tmp_path)
    assert max_abs_diff(final_state(tmp_path), final_state(fault_free)) < 1e-5


def test_checkpoints_cross_modes_both_ways_without_losing_a_sample(tmp_path: Path) -> None:
    """Restart mode (2 torchrun ranks) preempted mid-epoch 2, quorum mode resumes it and is
    preempted mid-epoch 3, restart mode finishes: every epoch's samples exactly once."""
    dirs = ["--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = torchrun(STANDALONE_2, [*RUN, *dirs], env=base_env({FAULTS: "preempt:rank=0:step=55"}))
    assert first.returncode != 0 and "Preempted" in first.stdout, first.stdout[-2000:]
    middle = launch(tmp_path, faults="preempt:rank=1:step=95")
    assert middle.returncode == ExitCode.PREEMPTED, middle.stdout[-3000:]
    assert "Resumed from" in middle.stdout and "Epoch 2/3" in middle.stdout
    last = torchrun(STANDALONE_2, [*RUN, *dirs])
    assert last.returncode == 0, last.stdout[-2000:]
    assert "Epoch 3/3" in last.stdout
    assert_exactly_once(tmp_path)


def test_early_stop_in_quorum_mode_ends_every_replica_after_the_same_epoch(tmp_path: Path) -> None:
    done = launch(tmp_path, "--target-accuracy", "0.05")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Early stopping at epoch 1" in done.stdout and "Training Summary:" in done.stdout
    final = load((tmp_path / "ckpt" / "latest").resolve())
    assert final.manifest.finished and len(final.payload.app["history"]) == 1
    lines = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")]
    assert [r["epoch"] for r in lines] == [1], "one epoch line, written once"


def test_quorum_mode_without_a_lighthouse_or_under_plain_torchrun_is_refused_with_the_fix(tmp_path: Path) -> None:
    env = base_env()
    plain = cli(["--ft", "quorum", "--checkpoint-dir", str(tmp_path / "c")], env={**env, "TORCHFT_LIGHTHOUSE": ""})
    assert plain.returncode == ExitCode.USAGE
    assert "needs a Lighthouse" in plain.stderr + plain.stdout and "elastic_train.quorum.launch" in plain.stderr
    started = time.monotonic()
    under_torchrun = torchrun(
        STANDALONE_2, ["--ft", "quorum", "--lighthouse", "http://127.0.0.1:9", "--checkpoint-dir", str(tmp_path / "d")]
    )
    assert under_torchrun.returncode != 0 and time.monotonic() - started < 60
    assert "one worker per replica group" in under_torchrun.stdout + under_torchrun.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").glob("step-*"))


def test_losing_every_replica_at_once_resumes_from_the_checkpoint_and_keeps_samples_exactly_once(
    tmp_path: Path, fault_free: Path
) -> None:
    job = Job(tmp_path, base_env())
    try:
        node = job.start("--nproc-per-node", "2")
        job.until("a checkpoint past step 20", lambda: job.committed_steps(0) >= 25 and job.committed_steps(1) >= 25)
        lost_at = time.time()
        for group in (0, 1):  # no live peer left to heal from
            os.kill(node.pid(group), signal.SIGKILL)
        assert job.wait(node) == 0, job.output()
    finally:
        kill_tagged(job.env[TOKEN_VAR])
    # The first quorum after the loss loads latest; a replica that comes up after it heals from it.
    resumed = [e for g in (0, 1) for e in events(job, g, "resumed", lost_at)]
    assert resumed and len({e["step"] for e in resumed}) == 1, resumed
    assert 20 <= resumed[0]["step"] < TOTAL
    for group in (0, 1):
        assert events(job, group, "resumed", lost_at) or events(job, group, "healed", lost_at), group
    assert_exactly_once(tmp_path)
    assert max_abs_diff(final_state(tmp_path), final_state(fault_free)) < 1e-5
