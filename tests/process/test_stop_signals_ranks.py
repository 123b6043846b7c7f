"""Stop signals sent to real ranks: a preemption (SIGUSR1) commits and leaves the requeue marker, the
launcher's stop (SIGTERM) commits and exits as stopped, and the grace period ends a rank blocked in
a collective on a frozen peer (tests/unit/test_stop_signals.py has the in-process rules)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from elastic_train.outcome import PREEMPTED_MARKER, STOPPED_MARKER, ExitCode, Marker, read_marker
from tests.helpers import events, flags, kill_group, ranks, wait_all

# Long enough never to finish during a test; the watchdog is off so only the grace can end a rank.
LONG = flags(batch_size=32, max_steps_per_epoch=500, epochs=20, target_accuracy=1.0, patience=0, hang_timeout=0)


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


@pytest.mark.timeout(180)
def test_sigterm_to_a_rank_blocked_in_an_allreduce_on_a_frozen_peer_exits_within_the_grace(tmp_path: Path) -> None:
    grace = 3.0
    with ranks(2, [*LONG, *dirs(tmp_path), "--stop-grace", str(grace), "--collective-timeout", "600"]) as procs:
        wait_for_steps(tmp_path / "logs", 3)
        os.kill(procs[1].pid, signal.SIGSTOP)  # a frozen peer: rank 0 blocks in the next all-reduce
        try:
            time.sleep(1.5)
            assert procs[0].poll() is None
            sent = time.monotonic()
            procs[0].send_signal(signal.SIGTERM)
            code = procs[0].wait(timeout=grace + 30)
            took = time.monotonic() - sent
        finally:
            kill_group(procs[1])
        out, err = procs[0].communicate()
    print(f"blocked rank exited {took:.2f}s after SIGTERM (grace {grace}s)")
    assert code == ExitCode.STOP_GRACE_EXPIRED, out + err
    assert took < grace + 2, f"rank 0 exited {took:.1f}s after SIGTERM (grace {grace}s)"
    (expired,) = events(tmp_path / "logs", 0, "stop_grace_expired")
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
