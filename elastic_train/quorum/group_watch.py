"""A replica group of several workers leaves the quorum as soon as one of its workers freezes.

The Lighthouse learns that a group is alive from its Manager server, which runs in the group's
rank 0 only. When another worker of the group freezes (SIGSTOP, a process the kernel no longer
schedules), rank 0 keeps heartbeating, and torchft's Lighthouse will not form a quorum
from a minority of the groups it sees as healthy (its guard against split brain). With two
groups the survivors then wait until the frozen group's own collectives time out, measured at
the whole ``--group-timeout`` (9.1 s with 8 s) instead of the ~2 s a dead peer costs.

So every worker of a group of K > 1 runs a ``GroupWatch``: a thread that bumps a counter of
its own in the group's store (the torchrun agent's, shared by the group) every ``interval``, and
watches the others' counters. A counter that has not moved for ``silence_s`` (by this worker's
own monotonic clock: no clocks are compared across processes) means a frozen peer: the worker
exits at once (``ExitCode.HUNG``), SIGKILLing the frozen peer first when it runs on this host
(torchrun's agent would otherwise wait a fixed 30 s for it to act on SIGTERM, which a stopped
process never does, before it restarts the group), so rank 0's heartbeats stop, the Lighthouse
drops the group after its heartbeat timeout, and the other groups form their quorum without it.
The agent restarts the group and it heals. A store that does not answer within ``silence_s`` (a
frozen agent) counts as silence too.

What it does not see, and what it could misread:

* liveness is the watch thread's, not training progress: a main thread stuck in a call that
  releases the GIL (a deadlocked collective, a hung CUDA kernel or file system) keeps beating;
  that case ends at the group's collective timeout (``--group-timeout``);
* a C call that holds the GIL for longer than ``silence_s`` starves the thread (Python switches
  threads every 5 ms otherwise): choose ``silence_s`` above any such stretch. The heal transfer
  is not one (measured beside a 400 MB state: 12 ms at the source, 15 ms at the healer);
* a store call slower than ``silence_s`` (its client's timeout) reads as silence too;
* a pause of the whole group (a VM or job suspend) is not a freeze of one worker: a watcher
  whose own loop was late by more than half the bound judges nobody that round, only re-reads;
* a peer that has not published yet is given ``startup_s`` from this watcher's start (its imports
  and its Manager's connection may lag this one's).
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
        startup_s: float | None = None,
    ) -> None:
        if silence_s <= 0:
            raise ValueError(f"silence_s must be positive, got {silence_s}")
        self.store, self.rank, self.world, self.silence_s = store, rank, world, silence_s
        # A tenth of the bound, at most 0.2 s: a silence is noticed within 10% of it (three store
        # calls a round).
        self.interval_s = interval_s if interval_s is not None else min(0.2, silence_s / 10)
        self.prefix = f"elastic_train/alive/{attempt}/"
        self.on_silent, self.kill_silent_peer = on_silent, kill_silent_peer
        self.startup_s = startup_s if startup_s is not None else silence_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-watch", daemon=True)
        self._beats = 0
        # How close this group ran to ``silence_s``, logged when the watch stops: the longest a
        # peer's counter stood still before it moved again (rounds after a stall not counted),
        # the stalled rounds themselves, and the longest gap between this watcher's own rounds.
        self.longest_silence_s = 0.0
        self.stalled_rounds = 0
        self.longest_round_s = 0.0

    def start(self) -> GroupWatch:
        self.store.set(f"{self.prefix}pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()  # visible before the first look at the peers
        self._thread.start()
        return self

    def stop(self, left: bool = True) -> None:
        """Stop watching. ``left``: tell the peers this worker finished on purpose (one that
        finishes first must not read as frozen to one still writing its last files); after a
        failure it stays silent, so that its peers notice."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.silence_s + 1.0)
        if left:
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
        started = last_round = time.monotonic()
        peers = [r for r in range(self.world) if r != self.rank]
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            # This thread itself ran late (the whole group paused, or the host was starved):
            # the peers had no chance to beat either. Restart every peer's clock, judge nobody.
            stalled = now - last_round > self.interval_s + self.silence_s / 2
            self.stalled_rounds += stalled
            self.longest_round_s = max(self.longest_round_s, now - last_round)
            last_round = now
            try:
                self._beat()
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
                if value is None:  # not published yet: still starting, up to startup_s
                    if now - started > self.startup_s:
                        self._leave(peer, now - started)
                        return
                    continue
                last_value, since = seen.get(peer, (None, now))
                if value != last_value or stalled:
                    if value != last_value and not stalled and last_value is not None:
                        self.longest_silence_s = max(self.longest_silence_s, now - since)
                    seen[peer] = (value, now)
                elif now - since > self.silence_s:
                    self._leave(peer, now - since)
                    return

    def _leave(self, peer: int, silent_s: float) -> None:
        self._kill(peer)
        self.on_silent(
            f"group watch: worker {peer} of this replica group has been silent for {silent_s:.1f}s "
            f"(frozen?); worker {self.rank} leaves so the group drops out of the quorum and its agent "
            "restarts it"
        )
