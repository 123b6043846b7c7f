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
from tests.helpers import (
    BIN,
    ROOT,
    TOKEN_VAR,
    base_env,
    cli,
    final_state,
    kill_tagged,
    read_jsonl,
    shared_once,
    torchrun,
)
from tests.launch.test_quorum_trainer import (
    RUN,
    TOTAL,
    Job,
    assert_exactly_once,
    events,
    max_abs_diff,
    run_fault_free,
)

AGENT = [str(BIN / "python"), "-m", "elastic_train.quorum.launch"]
STANDALONE_2 = ["--standalone", "--nproc-per-node=2"]


def launch(
    base: Path, *extra: str, nproc: int = 2, timeout: float = 200, faults: str = ""
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
    """The fault-free 2-replica run, shared with test_quorum_trainer.py (one per test session)."""
    return shared_once(tmp_path_factory, "quorum-fault-free", run_fault_free)


def test_a_preempted_three_replica_job_checkpoints_one_agreed_step_and_resumes_exactly_on_two(
    tmp_path: Path, fault_free: Path
) -> None:
    """Three replicas (shares of 6, 5 and 5 samples of the global batch of 16) are preempted;
    the requeued job has two (8 + 8) and ends where the fault-free 2-replica run ends."""
    job = Job(tmp_path, base_env())
    try:
        node = job.start("--nproc-per-node", "3")
        job.until("training", lambda: job.committed_steps(0) >= 25)
        assert any(e["world"] == 3 for e in events(job, 0, "quorum_changed")), job.output()
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
    # Three shares sum each step's gradient in another order than two: measured 4e-7 after 120
    # SGD steps at a global batch of 16 (1.6e-5 and 2.9e-6 at 32). A share weighted 1/3 instead
    # of 6/16, or a sample lost, moves the weights by orders of magnitude more.
    assert max_abs_diff(final_state(tmp_path), final_state(fault_free)) < 1e-4


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
    # Plain torchrun's workers are one replica group of 2 (--procs-per-replica's shape), which
    # has no job secret to sign a heal with: refused, naming the launcher that mints one.
    said = under_torchrun.stdout + under_torchrun.stderr
    assert "ELASTIC_TRAIN_QUORUM_SECRET is unset" in said and "elastic_train.quorum.launch" in said
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


def test_batchnorm_statistics_count_each_committed_step_once_across_a_kill(tmp_path: Path) -> None:
    """ResNet-18 carries BatchNorm buffers: they follow participant 0 after every step, and a
    discarded attempt's forward is undone. ``num_batches_tracked`` counts forwards in training
    mode, so after a kill it still equals the committed steps (a discarded attempt left in it
    would count twice), and the replicas' statistics stayed one (the saved ones are finite).
    The kill is injected at the start of step 6, inside an attempt whose quorum includes the
    victim: the survivor's allreduce fails, so its attempt (and forward) is surely discarded."""
    epochs, steps = 2, 10
    job = Job(tmp_path, {**base_env(), FAULTS: "kill:rank=1:step=6"})
    # 16-pixel images: the same layers and buffers at a quarter of the convolutions' cost.
    short = ["--model", "resnet18", "--image-size", "16", "--epochs", str(epochs), "--max-steps-per-epoch", str(steps)]
    short += ["--max-val-samples", "64"]
    started = time.time()
    try:
        node = job.start("--nproc-per-node", "2", "--max-restarts", "2", flags=short)
        job.until("the killed replica healed", lambda: bool(events(job, 1, "healed", started)))
        assert job.wait(node, timeout=240) == 0, job.output()  # ResNet-18 at 16 px: ~0.6 s a step on 2 loaded cores
    finally:
        kill_tagged(job.env[TOKEN_VAR])
    restarted = [r for g, _, r in node.workers() if g == 1]
    assert restarted == [0, 1], f"replica 1 was not killed once and restarted: {restarted}\n{job.output()}"
    # Replica 0 survived: its buffers are participant 0's, the ones every replica holds and saves.
    assert events(job, 0, "discarded", started), f"the kill discarded no attempt of the survivor\n{job.output()}"
    assert_exactly_once(tmp_path, epochs, steps)
    state = final_state(tmp_path)
    tracked = {k: int(v) for k, v in state.items() if k.endswith("num_batches_tracked")}
    assert tracked and set(tracked.values()) == {epochs * steps}, tracked
    for name, value in state.items():
        if name.endswith(("running_mean", "running_var")):
            assert bool(value.isfinite().all()), name


def test_mixed_precision_in_quorum_mode_survives_a_kill_and_keeps_samples_exactly_once(tmp_path: Path) -> None:
    """``--amp`` (bf16 autocast on the CPU; on a GPU bf16, or fp16 with a loss scaler whose state
    is replicated like the optimizer's): a replica killed inside an attempt heals and the run
    still trains every sample of every epoch once."""
    epochs, steps = 1, 20  # the survivor has steps left to train when the replacement asks to join
    job = Job(tmp_path, {**base_env(), FAULTS: "kill:rank=1:step=4"})
    try:
        node = job.start(
            "--nproc-per-node",
            "2",
            # bf16 autocast on a CPU is slow (5 s a step on a loaded 2-core machine at 32 px): 16 px
            flags=[
                "--amp",
                "--epochs",
                str(epochs),
                "--max-steps-per-epoch",
                str(steps),
                "--image-size",
                "16",
                "--max-val-samples",
                "64",
            ],
        )
        assert job.wait(node, timeout=240) == 0, job.output()
    finally:
        kill_tagged(job.env[TOKEN_VAR])
    assert "precision: bf16" in node.out.read_text(), job.output()
    assert [r for g, _, r in node.workers() if g == 1] == [0, 1], job.output()
    assert events(job, 1, "healed"), f"the killed replica did not heal\n{job.output()}"
    assert_exactly_once(tmp_path, epochs, steps)
