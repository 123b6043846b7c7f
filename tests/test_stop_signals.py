"""Stop signals: a preemption (SIGUSR1/2) versus the launcher's stop (SIGTERM), and the grace period
that ends a rank blocked in a collective instead of leaving it to the launcher's SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from elastic_train.resilience.preemption import (
    EXIT_PREEMPTED,
    EXIT_STOP_GRACE_EXPIRED,
    EXIT_STOPPED,
    MARKER,
    STOP_MARKER,
    PreemptionFlag,
    StopGrace,
    StopKind,
)
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


# ---------------------------------------------------------------------------------------- unit


def test_a_preemption_signal_outranks_a_stop_and_a_stop_never_downgrades_it() -> None:
    flag = PreemptionFlag()
    flag._handle(signal.SIGTERM, None)
    assert flag.kind is StopKind.STOP and flag.signal_name == "SIGTERM"
    flag._handle(signal.SIGUSR1, None)
    assert flag.kind is StopKind.PREEMPT and flag.signal_name == "SIGUSR1"
    flag._handle(signal.SIGTERM, None)
    assert flag.kind is StopKind.PREEMPT
    assert StopKind.PREEMPT.exit_code == EXIT_PREEMPTED and StopKind.STOP.exit_code == EXIT_STOPPED


def _deliver_and_wait(grace: StopGrace, exited: threading.Event, disarm: bool) -> float:
    flag = PreemptionFlag(grace)
    flag.install()
    try:
        start = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        if disarm:
            flag.acknowledge()
        exited.wait(3)
        return time.monotonic() - start
    finally:
        flag.uninstall()


def test_the_grace_period_ends_the_process_when_no_boundary_is_agreed_in_time() -> None:
    codes: list[int] = []
    exited = threading.Event()

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    took = _deliver_and_wait(StopGrace(0.5, rank=0, exit_fn=fake_exit), exited, disarm=False)
    assert codes == [EXIT_STOP_GRACE_EXPIRED] and 0.4 < took < 2.5


def test_progress_after_the_signal_extends_the_grace_period() -> None:
    """A rank evaluating or saving for longer than the grace is not ended: only a silent one is."""
    codes: list[int] = []
    exited = threading.Event()
    grace = StopGrace(0.5, rank=0, exit_fn=lambda c: (codes.append(c), exited.set()))
    busy_until = time.monotonic() + 1.5  # "progress" (beats) for 1.5 s after the signal
    grace.progress = lambda: min(time.monotonic(), busy_until)
    took = _deliver_and_wait(grace, exited, disarm=False)
    assert codes == [EXIT_STOP_GRACE_EXPIRED] and 1.9 < took < 3.0, took


def test_an_agreed_boundary_disarms_the_grace_period() -> None:
    codes: list[int] = []
    exited = threading.Event()
    _deliver_and_wait(StopGrace(0.5, rank=0, exit_fn=lambda c: (codes.append(c), exited.set())), exited, disarm=True)
    assert codes == []


def test_signals_other_than_the_stop_signals_do_not_start_the_grace_period() -> None:
    codes: list[int] = []
    grace = StopGrace(0.3, rank=0, exit_fn=codes.append)
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    flag = PreemptionFlag(grace)
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGALRM)
        time.sleep(0.8)
    finally:
        flag.uninstall()
        signal.signal(signal.SIGALRM, previous)
    assert codes == []


# ---------------------------------------------------------------------------------------- processes


@pytest.mark.multiprocess
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
    assert code == EXIT_STOP_GRACE_EXPIRED, out + err
    assert took < grace + 2, f"rank 0 exited {took:.1f}s after SIGTERM (grace {grace}s)"
    (expired,) = events(tmp_path / "logs", 0, "stop_grace_expired")
    assert expired["signal"] == "SIGTERM" and expired["exit_code"] == EXIT_STOP_GRACE_EXPIRED
    # Nothing was booked as a preemption, and no checkpoint claims this step.
    assert not (tmp_path / "ckpt" / MARKER).exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sigterm_commits_a_checkpoint_and_exits_as_stopped_not_preempted(tmp_path: Path) -> None:
    with ranks(2, [*LONG, *dirs(tmp_path)]) as procs:
        wait_for_steps(tmp_path / "logs", 3)
        procs[1].send_signal(signal.SIGTERM)  # one rank is enough: the ranks agree on it
        results = wait_all(procs, 90)
    assert [r.returncode for r in results] == [EXIT_STOPPED, EXIT_STOPPED], results[0].output
    assert not (tmp_path / "ckpt" / MARKER).exists(), "a launcher's stop was booked as a preemption"
    marker = json.loads((tmp_path / "ckpt" / STOP_MARKER).read_text())
    assert marker["committed"] and marker["exit_code"] == EXIT_STOPPED
    (stopped,) = events(tmp_path / "logs", 1, "preempted")
    assert stopped["signal"] == "SIGTERM" and stopped["kind"] == "STOP" and stopped["step"] == marker["step"]
    latest = json.loads((tmp_path / "ckpt" / "latest" / "manifest.json").read_text())
    assert latest["step"] == marker["step"]
    assert f"Stopped by a peer's signal at step {marker['step']}: checkpoint committed" in results[0].stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sigusr1_is_a_preemption_with_the_requeue_marker(tmp_path: Path) -> None:
    with ranks(2, [*LONG, *dirs(tmp_path)]) as procs:
        wait_for_steps(tmp_path / "logs", 3)
        procs[0].send_signal(signal.SIGUSR1)
        results = wait_all(procs, 90)
    assert [r.returncode for r in results] == [EXIT_PREEMPTED, EXIT_PREEMPTED], results[0].output
    marker = json.loads((tmp_path / "ckpt" / MARKER).read_text())
    assert marker["committed"] and marker["signal"] == "SIGUSR1" and marker["exit_code"] == EXIT_PREEMPTED
    assert not (tmp_path / "ckpt" / STOP_MARKER).exists()
