"""A replica group of several workers leaves the quorum as soon as one of its workers freezes.

The Lighthouse learns that a group is alive from its Manager server, which runs in the group's
rank 0 only. When another worker of the group freezes (SIGSTOP, a hung host process, a GPU
stuck in a kernel), rank 0 keeps heartbeating, and torchft's Lighthouse will not form a quorum
from a minority of the groups it sees as healthy (its guard against split brain). With two
groups the survivors then wait until the frozen group's own collectives time out, measured at
the whole ``--group-timeout`` (9.1 s with 8 s) instead of the ~2 s a dead peer costs.

So every worker of a group of K > 1 runs a ``GroupWatch``: a thread that bumps a counter of
its own in the group's store (the torchrun agent's, shared by the group) every ``interval``, and
watches the others' counters. A counter that has not moved for ``silence_s`` (by this worker's
own monotonic clock: no clocks are compared across processes) means a frozen peer: the worker
exits at once (``ExitCode.HUNG``), SIGKILLing the frozen peer first when it runs on this host
(torchrun's agent would otherwise wait a fixed 30 s for it to act on SIGTERM, which a stopped
process never does, before it restarts the group), so rank 0's heartbeats stop, the Lighthouse drops the group
after its heartbeat timeout, and the other groups form their quorum without it. The agent
restarts the group and it heals. A store that does not answer within ``silence_s`` (a frozen
agent) counts as silence too. A thread runs only when the main thread lets go of the GIL, which
every collective, sleep and kernel does; a Python loop that never yields for ``silence_s``
would read as frozen (choose ``silence_s`` above any such stretch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_train.outcome import ExitCode

LEFT = "left"  # a worker's counter once it stopped watching on purpose


def _exit_hung(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(ExitCode.HUNG)


class GroupWatch:
    """Publish this worker's liveness and end the process when a peer of its group goes silent."""

    def __init__(
        self,
        store: Any,
        attempt: int,
        rank: int,
        world: int,
        silence_s: float,
        interval_s: float | None = None,
        on_silent: Callable[[str], None] = _exit_hung,
        kill_silent_peer: bool = True,
    ) -> None:
        if silence_s <= 0:
            raise ValueError(f"silence_s must be positive, got {silence_s}")
        self.store, self.rank, self.world, self.silence_s = store, rank, world, silence_s
        self.interval_s = interval_s if interval_s is not None else min(0.2, silence_s / 5)
        self.prefix = f"elastic_train/alive/{attempt}/"
        self.on_silent, self.kill_silent_peer = on_silent, kill_silent_peer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-watch", daemon=True)
        self._beats = 0

    def start(self) -> GroupWatch:
        self.store.set(f"{self.prefix}pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()  # visible before the first look at the peers
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching, and tell the peers this worker left on purpose (a worker that finishes
        first must not read as frozen to one still writing its last files)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.silence_s + 1.0)
        with contextlib.suppress(Exception):  # the agent's store is gone too: nobody is left to tell
            self.store.set(f"{self.prefix}{self.rank}", LEFT)

    def _kill(self, peer: int) -> None:
        """SIGKILL a silent peer on this host (a stopped process cannot act on the agent's SIGTERM)."""
        if not self.kill_silent_peer:
            return
        with contextlib.suppress(Exception):  # best effort: the agent kills it in the end anyway
            key = f"{self.prefix}pid/{peer}"
            if not self.store.check([key]):  # it froze before it published: the agent's job
                return
            host, pid = self.store.get(key).decode().split()
            if host == socket.gethostname() and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{self.prefix}{self.rank}", str(self._beats))

    def _run(self) -> None:
        seen: dict[int, tuple[bytes | None, float]] = {}
        started = time.monotonic()
        peers = [r for r in range(self.world) if r != self.rank]
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._beat()
                # Only peers that have published (a peer still starting counts from our start).
                present = [r for r in peers if self.store.check([f"{self.prefix}{r}"])]
                values = dict(zip(present, self.store.multi_get([f"{self.prefix}{r}" for r in present]), strict=True))
            except Exception as exc:  # the store did not answer within its timeout: a frozen agent
                if self._stop.is_set():
                    return
                self.on_silent(f"group watch: worker {self.rank} cannot reach the group's store ({exc!r}); leaving")
                return
            for peer in peers:
                value = values.get(peer)
                if value == LEFT.encode():
                    continue
                last_value, since = seen.get(peer, (None, started))
                if value != last_value:
                    seen[peer] = (value, now)
                elif now - since > self.silence_s:
                    self._kill(peer)
                    self.on_silent(
                        f"group watch: worker {peer} of this replica group has been silent for "
                        f"{now - since:.1f}s (frozen?); worker {self.rank} leaves so the group drops "
                        "out of the quorum and its agent restarts it"
                    )
                    return
