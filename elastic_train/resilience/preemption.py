"""Stop requests: signals ask the run to checkpoint at an agreed step boundary and exit.

Two kinds, told apart by the signal:

* **preemption** (SIGUSR1, SIGUSR2): the scheduler is taking the allocation (Slurm's
  ``--signal=B:USR1@120``; the job scripts relay a SIGTERM they receive as SIGUSR2). The run
  commits a checkpoint, rank 0 writes ``<checkpoint-dir>/.preempted.json`` (the job script
  requeues on it) and every process exits with ``ExitCode.PREEMPTED`` (75).
* **stop** (SIGTERM): the launcher stops its workers: torchrun does so before *every* restart (a
  peer failed, a node joined or left) and when it shuts down. The run commits a checkpoint the
  same way, but nothing is booked as a preemption: rank 0 writes ``.stopped.json`` (read by the
  next attempt's goodput accounting) and every process exits with ``ExitCode.STOPPED`` (76).
* **interrupt** (SIGINT): a person pressed Ctrl-C. In a terminal it reaches ``python -m
  elastic_train`` directly; torchrun (whose workers sit in sessions of their own) and our
  launchers forward it to their workers. Same checkpoint, ``.interrupted.json``, exit
  ``ExitCode.INTERRUPTED`` (130, as a shell reports Ctrl-C), and a line saying how to continue.
  A *second* Ctrl-C ends the process at once (exit 130, no checkpoint: the last committed one
  stays ``latest``), from the grace thread too, so it works while the main thread is blocked.

Codes, marker files and their writer live in ``elastic_train.outcome``.

The handlers only record the request. At the next step boundary the ranks agree on it (see
``boundary.StepBoundary``), so a signal that reached one rank stops all of them at the same step.
Repeated signals are ignored: Slurm and torchrun often deliver each signal twice. A repeated
SIGINT is a second Ctrl-C only when it comes ``DOUBLE_DELIVERY_S`` or more after the first: a
launcher's forwarded copy of the same Ctrl-C arrives within milliseconds of the terminal's. So
is a SIGTERM that late after a SIGINT: torch's agent, interrupted a second time while it waits
for its workers, shuts them down with SIGTERM, not with the second SIGINT. While the signal
thread runs (``StopGrace``), it alone judges the timing, from when each signal arrived; the
Python handler runs late when the main thread is in C++, and would take one press for two.

**The grace period.** A Python handler runs only when the main thread is back in the
interpreter. A rank blocked inside a collective (a dead NCCL peer, a frozen host: its peers sit
in an all-reduce that never returns) never runs it, and the launcher would wait its whole
shutdown timeout for SIGKILL, on every restart. ``StopGrace`` therefore watches the signals from
a thread (CPython's C-level handler writes each signal number to a wakeup fd at once, whatever
the main thread is doing): a rank that has not reached an agreed stop boundary within
``--stop-grace`` seconds after the first signal, or after the latest progress *of any rank* (a
step, an evaluation batch, a checkpoint write), logs ``stop_grace_expired`` and exits with
``ExitCode.STOP_GRACE_EXPIRED`` (77). Any rank's: a rank waiting in a collective for a healthy,
slower peer (rank 0 writing a large shard) must not end the job's stop; the ranks' progress
reaches the grace thread through the job's c10d store (``peer_progress.py`` says why there).
Nothing is lost: the last committed checkpoint stays ``latest``. Keep the grace above two step
times (the boundary agreement runs one step behind), above ~3 s (a peer's progress takes that
long to arrive) and well inside the launcher's shutdown timeout (torchrun: 30 s by default).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from types import FrameType
from typing import Any

import structlog

from elastic_train.outcome import (
    ExitCode,
    RestartCause,
)
from elastic_train.resilience.peer_progress import CounterStore, PeerProgress, interval_for

log = structlog.get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
DEFAULT_GRACE_S = 10.0
# Two SIGINTs closer than this are one Ctrl-C delivered twice (the terminal's, and a launcher's
# forwarded copy); a person's second press comes later.
DOUBLE_DELIVERY_S = 0.5


class StopKind(IntEnum):
    """What a rank was asked to do; ranks agree on the MAX. A preemption anywhere wins (the job
    script must requeue); a launcher's stop outranks a Ctrl-C (torchrun is restarting the group,
    and the next attempt must book it so)."""

    NONE = 0
    INTERRUPT = 1
    STOP = 2
    PREEMPT = 3

    @classmethod
    def of_signal(cls, signum: int) -> StopKind:
        if signum in PREEMPT_SIGNALS:
            return cls.PREEMPT
        return cls.INTERRUPT if signum == signal.SIGINT else cls.STOP

    @property
    def exit_code(self) -> ExitCode:
        """The code a stop of this kind exits with; NONE is no stop and has none."""
        if self is StopKind.NONE:
            raise ValueError("StopKind.NONE is no stop: it has no exit code")
        return _EXIT_CODES[self]

    @property
    def cause(self) -> RestartCause:
        """How the next attempt books this stop; NONE has no cause."""
        if self is StopKind.NONE:
            raise ValueError("StopKind.NONE is no stop: it has no restart cause")
        return _CAUSES[self]

    @property
    def verb(self) -> str:
        """ "Preempted", "Stopped" or "Interrupted": the console's word for it."""
        return {StopKind.PREEMPT: "Preempted", StopKind.INTERRUPT: "Interrupted"}.get(self, "Stopped")


_EXIT_CODES = {
    StopKind.INTERRUPT: ExitCode.INTERRUPTED,
    StopKind.STOP: ExitCode.STOPPED,
    StopKind.PREEMPT: ExitCode.PREEMPTED,
}
_CAUSES = {
    StopKind.INTERRUPT: RestartCause.INTERRUPT,
    StopKind.STOP: RestartCause.STOP,
    StopKind.PREEMPT: RestartCause.PREEMPTION,
}


class SecondPress:
    """The rule for a second Ctrl-C, kept once for the handler and the signal thread: a SIGINT,
    then a SIGINT or SIGTERM ``DOUBLE_DELIVERY_S`` or more later, ends the process at once."""

    def __init__(self, exit_fn: Callable[[int], Any]) -> None:
        self._exit = exit_fn
        self._first: float | None = None  # monotonic time of the first SIGINT

    def note(self, signum: int) -> bool:
        """Record ``signum``; True when it was a second press (the process is being ended)."""
        if signum not in (signal.SIGINT, signal.SIGTERM):
            return False
        now = time.monotonic()
        if self._first is None:
            if signum == signal.SIGINT:
                self._first = now
            return False
        if now - self._first < DOUBLE_DELIVERY_S:
            return False
        end_at_once("Second Ctrl-C", self._exit)
        return True


def end_at_once(why: str, exit_fn: Callable[[int], Any] = os._exit) -> None:
    """A second Ctrl-C: leave now. Nothing is written (the last committed checkpoint stays
    ``latest``); one line on stderr says so. Safe from a signal handler or any thread."""
    with contextlib.suppress(OSError):
        fd = os.dup(2)  # non-blocking on a copy: a stalled terminal must not hold the exit up
        try:
            os.set_blocking(fd, False)
            os.write(fd, f"\n{why}: exiting now without a checkpoint (the last committed one is kept)\n".encode())
        finally:
            os.close(fd)
    exit_fn(ExitCode.INTERRUPTED)


class Preempted(Exception):
    """Raised by the trainer after the stop checkpoint; ``run`` turns it into exit 75 or 76."""

    def __init__(self, step: int, committed: bool, kind: StopKind = StopKind.PREEMPT) -> None:
        super().__init__(f"{kind.verb.lower()} at step {step} (checkpoint {'committed' if committed else 'FAILED'})")
        self.step = step
        self.committed = committed
        self.kind = kind


class StopGrace:
    """Ends the process ``grace_s`` after the first stop signal unless ``disarm`` came first.

    Works while the main thread is blocked in C++ (a collective, a CUDA sync): the signal number
    reaches a socket through ``signal.set_wakeup_fd``, written by CPython's C-level handler, and a
    daemon thread reads it. ``exit_fn`` is ``os._exit`` (the main thread cannot be interrupted);
    tests pass their own. ``share_progress`` adds the other ranks' progress to this rank's.
    """

    def __init__(self, grace_s: float, rank: int, exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.grace_s = grace_s
        self.rank = rank
        self._exit = exit_fn
        # ``time.monotonic()`` of the main thread's latest progress (a step, an evaluation batch,
        # a checkpoint being written: the step watchdog's last beat), once training runs. The
        # grace counts from the later of the signal and that progress: a rank that evaluates or
        # saves for longer than the grace is not ended, one blocked in a collective is.
        self.progress: Callable[[], float] | None = None
        # The other ranks' progress (``share_progress``): a rank waiting in a collective for a
        # peer that progresses is not ended either; only one that waits for nobody is.
        self.peers: PeerProgress | None = None
        self._disarmed = threading.Event()
        self._closed = threading.Event()
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None
        self._presses = SecondPress(exit_fn)

    def install(self) -> None:
        """From the main thread, after the Python handlers are installed."""
        if self.grace_s <= 0:
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C handler must never block
        self._sockets = (reader, writer)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        _forget_wakeup_fd_in_children()
        self._thread = threading.Thread(target=self._watch, name="stop-grace", daemon=True)
        self._thread.start()

    def share_progress(self, store: CounterStore | None) -> None:
        """Publish this rank's progress to ``store`` (``peer_progress.job_store()``: None for a
        world of one) and count the other ranks' in the grace, until ``stop_sharing``."""
        if self.grace_s <= 0 or store is None or self.peers is not None:
            return
        self.peers = PeerProgress(store, self._own_progress, interval_for(self.grace_s))
        self.peers.start()

    def stop_sharing(self) -> None:
        """Before the store goes away (the process group's teardown): own progress only."""
        peers, self.peers = self.peers, None
        if peers is not None:
            peers.close()

    def _own_progress(self) -> float:
        return self.progress() if self.progress is not None else -math.inf

    def disarm(self) -> None:
        """The ranks agreed on a stop boundary: the stop proceeds at its own pace."""
        self._disarmed.set()

    def uninstall(self) -> None:
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        self._closed.set()
        self._disarmed.set()  # wakes a watcher sleeping out the grace: it must not outlive us
        reader, writer = self._sockets
        writer.close()
        with contextlib.suppress(OSError):
            reader.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv
        if self._thread is not None:
            self._thread.join(timeout=5)
        reader.close()
        self._sockets = None

    def _first_signal(self) -> int | None:
        assert self._sockets is not None
        reader = self._sockets[0]
        while not self._closed.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return None
            if not data:
                return None
            for i, signum in enumerate(data):
                if signum in SIGNALS:
                    self._note_interrupts(data[i:])
                    return signum
        return None

    @property
    def watching(self) -> bool:
        """Whether the signal thread runs (it then judges a second Ctrl-C, not the handler)."""
        return self._sockets is not None

    def _note_interrupts(self, signums: bytes) -> None:
        """A second Ctrl-C ends the process at once, whatever the main thread is doing."""
        for signum in signums:
            self._presses.note(signum)

    def _listen_for_interrupts(self) -> None:
        """After the first stop signal, from a second thread: only a second Ctrl-C matters."""
        assert self._sockets is not None
        reader = self._sockets[0]
        while not self._closed.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            self._note_interrupts(data)

    def _watch(self) -> None:
        signum = self._first_signal()
        if signum is None:
            return
        threading.Thread(target=self._listen_for_interrupts, name="stop-grace-interrupts", daemon=True).start()
        received = time.monotonic()
        peers = self.peers
        if peers is not None:
            peers.watch()
        extended = False
        while True:
            own = max(received, self._own_progress())
            last = max(own, peers.last_seen() if peers is not None else -math.inf)
            now = time.monotonic()
            left = last + self.grace_s - now
            if left <= 0:
                break
            if not extended and now > own + self.grace_s:  # only the peers' progress keeps it alive
                extended = True
                log.warning("stop_grace_extended", rank=self.rank, by="peers", grace_s=self.grace_s)
            # Progress only moves the deadline later: sleeping until the earliest one is enough.
            if self._disarmed.wait(left) or self._closed.is_set():
                return
        log.error(
            "stop_grace_expired",
            rank=self.rank,
            signal=signal.Signals(signum).name,
            grace_s=self.grace_s,
            exit_code=int(ExitCode.STOP_GRACE_EXPIRED),
            detail="no rank progressed and no agreed step boundary came in time (blocked in a collective on a"
            " frozen or dead peer?); the last committed checkpoint is kept",
        )
        self._exit(ExitCode.STOP_GRACE_EXPIRED)


_AT_FORK_REGISTERED = False


def _forget_wakeup_fd_in_children() -> None:
    """A forked child (a DataLoader worker) inherits the wakeup fd: a signal sent to it alone
    would start its parent's grace period. Children drop it (their own stop is their parent's)."""
    global _AT_FORK_REGISTERED
    if not _AT_FORK_REGISTERED:
        os.register_at_fork(after_in_child=_drop_wakeup_fd)
        _AT_FORK_REGISTERED = True


def _drop_wakeup_fd() -> None:
    with contextlib.suppress(ValueError):  # forked from a thread other than the main one
        signal.set_wakeup_fd(-1)


class PreemptionFlag:
    """Set by a signal handler; read at step boundaries. Install from the main thread only."""

    def __init__(self, grace: StopGrace | None = None, exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.signal_name: str | None = None
        self.kind = StopKind.NONE
        self.grace = grace
        self._previous: dict[int, Any] = {}
        self._presses = SecondPress(exit_fn)

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.grace is not None:
            self.grace.install()

    def uninstall(self) -> None:
        if self.grace is not None:
            self.grace.uninstall()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def acknowledge(self) -> None:
        """Every rank agreed to stop at this boundary: the grace period no longer applies."""
        if self.grace is not None:
            self.grace.disarm()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: no logging, no I/O inside a handler (a second Ctrl-C's one line aside).
        # A preemption outranks a stop, a stop a Ctrl-C.
        watched = self.grace is not None and self.grace.watching  # the signal thread judges then
        if not watched and self._presses.note(signum):
            return
        kind = StopKind.of_signal(signum)
        if kind > self.kind:
            self.kind = kind
            self.signal_name = signal.Signals(signum).name
