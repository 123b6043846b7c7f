"""Stop signals: a preemption (SIGUSR1/2) versus the launcher's stop (SIGTERM), and the grace period
that ends a rank blocked in a collective instead of leaving it to the launcher's SIGKILL, unless a
peer is progressing; in this process (tests/process/test_stop_signals_ranks.py sends the signals to
real ranks)."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from elastic_train.outcome import ExitCode, RestartCause
from elastic_train.resilience.peer_progress import KEY, PeerProgress
from elastic_train.resilience.preemption import (
    DOUBLE_DELIVERY_S,
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


def _deliver_and_wait(grace: StopGrace, exited: threading.Event, disarm: bool, wait_s: float = 3) -> float:
    flag = PreemptionFlag(grace)
    flag.install()
    try:
        start = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        if disarm:
            flag.acknowledge()
        exited.wait(wait_s)
        return time.monotonic() - start
    finally:
        flag.uninstall()
        grace.stop_sharing()


class Counter:
    """The job's store as the grace sees it: one atomic counter, shared by "ranks" in this process."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, key: str, value: int, /) -> int:
        assert key == KEY
        with self._lock:
            self.value += value
            return self.value


class FrozenStore:
    """A store whose host is frozen: every operation blocks."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def add(self, key: str, value: int, /) -> int:
        self.released.wait()
        raise ConnectionError("store gone")


def _peer_beating(store: Counter, seconds: float) -> threading.Thread:
    """Another rank that progresses (publishes beats) for ``seconds``, then freezes."""

    def beat() -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            store.add(KEY, 1)
            time.sleep(0.05)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


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


def test_a_peers_progress_extends_the_grace_and_when_no_rank_progresses_it_expires() -> None:
    """This rank makes no progress (blocked in a collective) while a peer does for 2 s: it is not
    ended until the grace has passed after the peer's last progress."""
    codes: list[int] = []
    exited = threading.Event()
    store = Counter()
    grace = StopGrace(0.5, rank=1, exit_fn=lambda c: (codes.append(c), exited.set()))
    grace.progress = lambda: 0.0  # long ago
    grace.share_progress(store)
    _peer_beating(store, 2.0)
    took = _deliver_and_wait(grace, exited, disarm=False, wait_s=8)
    assert codes == [ExitCode.STOP_GRACE_EXPIRED] and 2.3 < took < 5.0, took


def test_a_store_that_blocks_never_delays_the_grace() -> None:
    """The peers' progress comes from a thread of its own: a frozen store host reads as no progress."""
    codes: list[int] = []
    exited = threading.Event()
    store = FrozenStore()
    grace = StopGrace(0.5, rank=1, exit_fn=lambda c: (codes.append(c), exited.set()))
    grace.progress = lambda: 0.0
    grace.share_progress(store)  # after the signal it reads the store: that read never returns
    try:
        took = _deliver_and_wait(grace, exited, disarm=False)
    finally:
        store.released.set()
    assert codes == [ExitCode.STOP_GRACE_EXPIRED] and 0.4 < took < 2.5, took


def test_a_ranks_own_progress_is_never_taken_for_a_peers() -> None:
    store = Counter()
    own = [1.0]
    peers = PeerProgress(store, lambda: own[0], every_s=1.0)
    peers.watch()
    for beat in range(2, 6):
        own[0] = float(beat)
        peers.tick()  # publishes this rank's progress: the counter moves, by its own adds only
    assert store.value == 4 and peers.last_seen() == -math.inf
    store.add(KEY, 1)  # another rank's progress
    before = time.monotonic()
    peers.tick()
    assert peers.last_seen() >= before


def test_ranks_share_progress_through_clones_of_one_c10d_store() -> None:
    """What ``job_store`` returns: a clone (a connection of its own) of the group's prefixed store;
    every clone of the same round sees the others' beats, another round's prefix sees none."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    this_round = dist.PrefixStore("elastic_train/round/2/", server)  # type: ignore[attr-defined]
    older_round = dist.PrefixStore("elastic_train/round/1/", server).clone()  # type: ignore[attr-defined]
    progress = {0: 0.0, 1: 0.0}
    rank0 = PeerProgress(this_round.clone(), lambda: progress[0], every_s=1.0)
    rank1 = PeerProgress(this_round.clone(), lambda: progress[1], every_s=1.0)
    rank1.watch()
    rank1.tick()  # its first read
    older_round.add(KEY, 5)  # an earlier round's beats (an orphan) are not this round's progress
    rank1.tick()
    assert rank1.last_seen() == -math.inf
    progress[0] = 1.0
    rank0.tick()  # rank 0 progressed and published
    rank1.tick()
    assert rank1.last_seen() > -math.inf


def test_ctrl_c_is_the_weakest_stop_and_its_exit_code_is_130() -> None:
    flag = PreemptionFlag(exit_fn=lambda code: pytest.fail(f"exited {code}"))
    flag._handle(signal.SIGINT, None)
    assert flag.kind is StopKind.INTERRUPT and flag.signal_name == "SIGINT"
    assert StopKind.INTERRUPT.exit_code == ExitCode.INTERRUPTED == 130
    assert StopKind.INTERRUPT.cause is RestartCause.INTERRUPT
    flag._handle(signal.SIGTERM, None)  # torchrun restarting the group outranks it
    assert flag.kind is StopKind.STOP
    flag._handle(signal.SIGUSR1, None)
    assert flag.kind is StopKind.PREEMPT
    assert StopKind.NONE < StopKind.INTERRUPT < StopKind.STOP < StopKind.PREEMPT  # the ranks agree on the MAX


def test_a_second_ctrl_c_ends_the_process_but_a_copy_of_the_first_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    codes: list[int] = []
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    flag = PreemptionFlag(exit_fn=codes.append)
    flag._handle(signal.SIGINT, None)
    clock[0] += DOUBLE_DELIVERY_S / 10  # the launcher's forwarded copy of the same Ctrl-C
    flag._handle(signal.SIGINT, None)
    assert codes == [] and flag.kind is StopKind.INTERRUPT
    clock[0] += DOUBLE_DELIVERY_S  # a person pressing again
    flag._handle(signal.SIGINT, None)
    assert codes == [ExitCode.INTERRUPTED]


def test_a_second_ctrl_c_ends_the_process_from_the_grace_thread_while_the_main_thread_is_blocked() -> None:
    """The main thread here sleeps in C (time.sleep stands for a collective); the grace thread
    reads the signals from the wakeup fd and ends the process on the second Ctrl-C."""
    codes: list[int] = []
    exited = threading.Event()
    grace = StopGrace(30.0, rank=0, exit_fn=lambda c: (codes.append(c), exited.set()))
    flag = PreemptionFlag(grace, exit_fn=lambda c: None)  # only the grace thread may end it here
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(DOUBLE_DELIVERY_S + 0.2)
        os.kill(os.getpid(), signal.SIGINT)
        assert exited.wait(3), "the second Ctrl-C did not end the process"
    finally:
        flag.uninstall()
    assert codes == [ExitCode.INTERRUPTED]
