"""Stop signals: a preemption (SIGUSR1/2) versus the launcher's stop (SIGTERM), and the grace period
that ends a rank blocked in a collective instead of leaving it to the launcher's SIGKILL; in this
process (tests/process/test_stop_signals_ranks.py sends the signals to real ranks)."""

from __future__ import annotations

import os
import signal
import threading
import time

from elastic_train.outcome import ExitCode
from elastic_train.resilience.preemption import (
    PreemptionFlag,
    StopGrace,
    StopKind,
)


def test_a_preemption_signal_outranks_a_stop_and_a_stop_never_downgrades_it() -> None:
    flag = PreemptionFlag()
    flag._handle(signal.SIGTERM, None)
    assert flag.kind is StopKind.STOP and flag.signal_name == "SIGTERM"
    flag._handle(signal.SIGUSR1, None)
    assert flag.kind is StopKind.PREEMPT and flag.signal_name == "SIGUSR1"
    flag._handle(signal.SIGTERM, None)
    assert flag.kind is StopKind.PREEMPT
    assert StopKind.PREEMPT.exit_code == ExitCode.PREEMPTED and StopKind.STOP.exit_code == ExitCode.STOPPED


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
    assert codes == [ExitCode.STOP_GRACE_EXPIRED] and 0.4 < took < 2.5


def test_progress_after_the_signal_extends_the_grace_period() -> None:
    """A rank evaluating or saving for longer than the grace is not ended: only a silent one is."""
    codes: list[int] = []
    exited = threading.Event()
    grace = StopGrace(0.5, rank=0, exit_fn=lambda c: (codes.append(c), exited.set()))
    busy_until = time.monotonic() + 1.5  # "progress" (beats) for 1.5 s after the signal
    grace.progress = lambda: min(time.monotonic(), busy_until)
    took = _deliver_and_wait(grace, exited, disarm=False)
    assert codes == [ExitCode.STOP_GRACE_EXPIRED] and 1.9 < took < 3.0, took


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
