"""A step watchdog: a rank whose training stops advancing exits, so torchrun restarts the group.

The trainer calls ``beat`` after every step and evaluation batch. A daemon thread checks the
time since the last beat; past ``--hang-timeout`` seconds it logs the rank, the step and what it
was doing, dumps every thread's Python stack to stderr (where the rank is stuck), writes
``<marker-dir>/.hang-rank-<r>.json`` when given a marker directory (the next attempt books its
restart as a ``hang`` from it, see ``elastic_train.outcome``; the write waits at most
``outcome.HANG_MARKER_WRITE_S``, as the hang may be the disk's), kills its DataLoader workers
(``os._exit`` would leave them behind) and ends the process with ``ExitCode.HUNG`` (124, as
timeout(1) uses). This catches a rank stuck outside collectives (a deadlocked loader, a wedged
filesystem) and the peers of a stopped rank, which sit in a collective until it returns;
``--collective-timeout`` is the backstop inside the backend.

The timeout must exceed the longest legitimate pause between beats: the first step (CUDA
initialisation, compilation), a synchronous checkpoint of a large model, an evaluation batch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from elastic_train.outcome import ExitCode, Marker, RestartCause, write_marker_best_effort

log = structlog.get_logger(__name__)


class StepWatchdog:
    def __init__(
        self,
        timeout_s: float,
        rank: int,
        poll_s: float | None = None,
        marker_dir: Path | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        """``rank``: the global rank (it names the hang marker). ``marker_dir``: where the hang
        marker goes, the checkpoint directory (None: none is written). ``exit_fn``: ``os._exit``
        (the main thread is stuck, so no exception can reach it); tests pass their own."""
        self.timeout_s = timeout_s
        self.rank = rank
        self.poll_s = poll_s if poll_s is not None else max(0.5, min(5.0, timeout_s / 10))
        self.marker_dir = marker_dir
        self._exit = exit_fn
        self._last = time.monotonic()
        self._step = 0
        self._phase = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int, phase: str = "train") -> None:
        self._last = time.monotonic()
        self._step = step
        self._phase = phase

    @property
    def last_progress(self) -> float:
        """``time.monotonic()`` of the latest beat (also kept when the watchdog is off)."""
        return self._last

    def alive(self, phase: str = "checkpoint") -> None:
        """Progress without a finished step (e.g. a large checkpoint being written)."""
        self._last = time.monotonic()
        self._phase = phase

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 2)
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        log.error(
            "hang_detected",
            rank=self.rank,
            step=self._step,
            phase=self._phase,
            seconds_without_progress=round(idle, 1),
            exit_code=int(ExitCode.HUNG),
        )
        # Where the stuck thread is: the main thread's stack says which collective, which
        # loader, which file. Native code is dumped safely (faulthandler reads frames, not locks).
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(all_threads=True)
        if self.marker_dir is not None:
            marker = Marker(RestartCause.HANG, self._step, self.rank, phase=self._phase)
            if not write_marker_best_effort(self.marker_dir, marker):
                log.warning("hang_marker_not_written", rank=self.rank, marker_dir=str(self.marker_dir))
        if self._exit is os._exit:
            end_worker_processes()
        # torchrun sees the exit code and restarts the group from the latest checkpoint.
        self._exit(ExitCode.HUNG)


def end_worker_processes() -> None:
    """SIGKILL this process's multiprocessing children (DataLoader workers) before an
    ``os._exit``. Daemonic children are ended only by a normal exit's atexit hook, which
    ``os._exit`` skips; a loader worker that is itself the hang (deadlocked in a dataset's code)
    never notices its parent is gone, and would outlive it holding memory and the launcher's
    output pipes."""
    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()
    for child in children:  # reaped here: no zombie outlives this process either
        with contextlib.suppress(Exception):
            child.join(timeout=1.0)
