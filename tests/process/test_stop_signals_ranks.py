"""Stop signals sent to real ranks: a preemption (SIGUSR1) commits and leaves the requeue marker, the
launcher's stop (SIGTERM) commits and exits as stopped, the grace period ends a rank blocked in a
collective on a frozen peer but not one waiting for a healthy slow peer (tests/unit/test_stop_signals.py
has the in-process rules)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from elastic_train.faults import ENV_VAR as FAULTS_VAR
from elastic_train.outcome import PREEMPTED_MARKER, STOPPED_MARKER, ExitCode, Marker, read_marker
from tests.helpers import events, flags, kill_group, ranks, wait_all

# Long enough never to finish during a test; the watchdog is off so only the grace can end a rank.
LONG = flags(
    batch_size=32,
    max_steps_per_epoch=500,
    max_val_samples=64,
    epochs=20,
    target_accuracy=1.0,
    patience=0,
    hang_timeout=0,
)


def dirs(base: Path) -> list[str]:
    return ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt")]


def wait_for_steps(log_dir: Path, steps: int, timeout: float = 90) -> None:
    progress = log_dir.parent / "ckpt" / ".progress.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] >= steps:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"training did not reach step {steps} within {timeout}s")


def wait_for_fault(ckpt: Path, kind: str, timeout: float = 90) -> None:
    """Until the fault has fired: its marker is written (and fsynced) just before it acts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list((ckpt / ".faults").glob(f"fault-{kind}-*.fired")):
            return
        time.sleep(0.05)
    raise AssertionError(f"the {kind} fault did not fire within {timeout}s")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("frozen", [1, 0], ids=["peer", "store-host"])
def test_sigterm_to_a_rank_blocked_in_an_allreduce_on_a_frozen_peer_exits_within_the_grace(
    tmp_path: Path, frozen: int
) -> None:
    """No rank progresses, so the grace is not extended, even when the frozen rank hosts the store
    the ranks share their progress through (rank 0 without an agent): its silence reads as none."""
    grace = 3.0
    blocked = 1 - frozen
    with ranks(2, [*LONG, *dirs(tmp_path), "--stop-grace", str(grace), "--collective-timeout", "600"]) as procs:
        wait_for_steps(tmp_path / "logs", 3)
        os.kill(procs[frozen].pid, signal.SIGSTOP)  # a frozen peer: the other rank blocks in the next all-reduce
        try:
            time.sleep(1.5)
            assert procs[blocked].poll() is None
            sent = time.monotonic()
            procs[blocked].send_signal(signal.SIGTERM)
            code = procs[blocked].wait(timeout=grace + 30)
            took = time.monotonic() - sent
        finally:
            kill_group(procs[frozen])
        out, err = procs[blocked].communicate()
    print(f"blocked rank exited {took:.2f}s after SIGTERM (grace {grace}s)")
    assert code == ExitCode.STOP_GRACE_EXPIRED, out + err
    assert took < grace + 2, f"rank {blocked} exited {took:.1f}s after SIGTERM (grace {grace}s)"
    (expired,) = events(tmp_path / "logs", blocked, "stop_grace_expired")
    assert expired["signal"] == "SIGTERM" and expired["exit_code"] == ExitCode.STOP_GRACE_EXPIRED
    # Nothing was booked as a preemption, and no checkpoint claims this step.
    assert not (tmp_path / "ckpt" / PREEMPTED_MARKER).exists()


@pytest.mark.timeout(180)
def test_sigterm_commits_a_checkpoint_and_exits_as_stopped_not_preempted(tmp_path: Path) -> None:
    with ranks(2, [*LONG, *dirs(tmp_path)]) as procs:
        wait_for_steps(tmp_path / "logs", 3)
        procs[1].send_signal(signal.SIGTERM)  # one rank is enough: the ranks agree on it
        results = wait_all(procs, 90)
    assert [r.returncode for r in results] == [ExitCode.STOPPED, ExitCode.STOPPED], results[0].output
    assert not (tmp_path / "ckpt" / PREEMPTED_MARKER).exists(), "a launcher's stop was booked as a preemption"
    marker = read_marker(tmp_path / "ckpt" / STOPPED_MARKER)
    assert isinstance(marker, Marker) and marker.committed and marker.exit_code is ExitCode.STOPPED
    (stopped,) = events(tmp_path / "logs", 1, "preempted")
    assert stopped["signal"] == "SIGTERM" and stopped["kind"] == "STOP" and stopped["step"] == marker.step
    latest = json.loads((tmp_path / "ckpt" / "latest" / "manifest.json").read_text())
    assert latest["step"] == marker.step
    assert f"Stopped by a peer's signal at step {marker.step}: checkpoint committed" in results[0].stdout


@pytest.mark.timeout(180)
def test_sigusr1_is_a_preemption_with_the_requeue_marker(tmp_path: Path) -> None:
    with ranks(2, [*LONG, *dirs(tmp_path)]) as procs:
        wait_for_steps(tmp_path / "logs", 3)
        procs[0].send_signal(signal.SIGUSR1)
        results = wait_all(procs, 90)
    assert [r.returncode for r in results] == [ExitCode.PREEMPTED, ExitCode.PREEMPTED], results[0].output
    marker = read_marker(tmp_path / "ckpt" / PREEMPTED_MARKER)
    assert isinstance(marker, Marker) and marker.committed and marker.signal == "SIGUSR1"
    assert marker.exit_code is ExitCode.PREEMPTED
    assert not (tmp_path / "ckpt" / STOPPED_MARKER).exists()


@pytest.mark.timeout(240)
def test_a_preemption_while_rank_0_writes_a_shard_longer_than_the_grace_commits_and_every_rank_exits_75(
    tmp_path: Path,
) -> None:
    """Rank 1 waits in the commit's all-gather for rank 0's slow shard: it makes no progress of its
    own for longer than the grace, but rank 0 does, so the grace extends and the preemption
    checkpoint is written. (Before the grace counted the whole job's progress, rank 1 exited 77.)"""
    grace, slow = 5.0, 20.0
    save_step = 4
    run_flags = [*LONG, *dirs(tmp_path), "--stop-grace", str(grace), "--collective-timeout", "600"]
    run_flags += ["--checkpoint-every", str(save_step), "--no-async-checkpoint"]
    faults = {FAULTS_VAR: f"slow_save:rank=0:step={save_step}:seconds={slow:g}"}
    with ranks(2, run_flags, env=faults) as procs:
        wait_for_fault(tmp_path / "ckpt", "slow_save")  # rank 0's writer sleeps from now on
        sent = time.monotonic()
        for proc in procs:  # as torchrun or Slurm deliver it: to every rank
            proc.send_signal(signal.SIGUSR1)
        results = wait_all(procs, slow + 90)
        took = time.monotonic() - sent
    print(f"both ranks exited {took:.2f}s after SIGUSR1 (grace {grace}s, shard write slowed by {slow}s)")
    assert [r.returncode for r in results] == [ExitCode.PREEMPTED, ExitCode.PREEMPTED], (
        results[1].output + results[0].output
    )
    assert took > slow - 2, "the stop did not wait for rank 0's slow shard: was the fault injected?"
    assert not events(tmp_path / "logs", 1, "stop_grace_expired")
    (extended,) = events(tmp_path / "logs", 1, "stop_grace_extended")
    assert extended["by"] == "peers"
    marker = read_marker(tmp_path / "ckpt" / PREEMPTED_MARKER)
    assert isinstance(marker, Marker) and marker.committed and marker.step > save_step
    latest = json.loads((tmp_path / "ckpt" / "latest" / "manifest.json").read_text())
    assert latest["step"] == marker.step
