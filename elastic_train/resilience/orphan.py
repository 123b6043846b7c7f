"""A worker whose launcher died exits on its own instead of training on as an orphan.

torchrun starts every worker in a session of its own (``start_new_session=True``), so when the
agent is SIGKILLed (the OOM killer, a crashed node daemon) nothing signals its workers: they keep
training, holding their GPUs, and an agent restarted on that node starts a second set beside
them. Measured on torch 2.14.1: both workers of a SIGKILLed agent were still training 10 s later.

``ParentWatch`` remembers the parent's pid at start and polls ``os.getppid()``: when the parent
is gone the kernel has re-parented us (to init or a subreaper) and the pid changes. It then logs
``launcher_lost`` and ends the process with ``ExitCode.ORPHANED`` (78). ``PR_SET_PDEATHSIG`` is not used:
it fires when the *thread* that forked us exits, and torch's agent may start workers from a
thread that ends while the agent lives on.

With the warm launcher the parent is its forkserver, which exits when the agent dies: the
worker is re-parented just the same.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import structlog

from elastic_train.outcome import ExitCode

log = structlog.get_logger(__name__)

POLL_S = 0.5


class ParentWatch:
    def __init__(
        self,
        rank: int,
        parent: int | None = None,
        poll_s: float = POLL_S,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        """``parent``: the launcher's pid as read at the process start (default: now)."""
        self.rank = rank
        self.poll_s = poll_s
        self._exit = exit_fn
        self._parent = os.getppid() if parent is None else parent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="parent-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 2)
            self._thread = None

    def _watch(self) -> None:
        while True:  # checked at once too: the launcher may have died while we imported torch
            parent = os.getppid()
            if parent != self._parent:
                log.error(
                    "launcher_lost",
                    rank=self.rank,
                    launcher_pid=self._parent,
                    new_parent=parent,
                    exit_code=int(ExitCode.ORPHANED),
                    detail="the launcher died (its workers are not signalled): exiting instead of training on",
                )
                self._exit(ExitCode.ORPHANED)
                return
            if self._stop.wait(self.poll_s):
                return
