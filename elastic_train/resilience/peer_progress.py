"""Progress shared across ranks, so that the stop grace counts the whole job's progress.

Why: ``StopGrace`` (``preemption.py``) ends a rank that has reached no agreed step boundary within
``--stop-grace`` of a stop signal and made no progress meanwhile. A rank's *own* progress is not
enough: one that waits in a collective for a healthy, slower peer (rank 0 writing a large
synchronous shard, a long evaluation, a step longer than the grace) makes none while the job does,
and ending it (exit 77) loses the checkpoint the stop was for. So the grace also counts the other
ranks' progress, and still expires when no rank progresses (a frozen or dead peer: every survivor
sits in a collective).

The channel. A blocked rank's main thread is inside C++, so only a thread can learn anything, and
not through the training group (its collectives are what is blocked). The beats go through the
c10d store the job's process group was created on, under the round's key prefix:

* every rank reaches it, on any node: it is the rendezvous endpoint (torchrun's agent store,
  ``python -m elastic_train.rendezvous``, or rank 0's own TCPStore when torchrun does not share
  its store);
* its keys live under the round's prefix (``distributed/round.py``): after a torchrun restart
  nothing of the previous round (nor of an orphan of it) is read as progress;
* no files: beats beside the checkpoints would add a write per rank per second to the shared
  filesystem (with NFS attribute caching to reason about) and leave files behind.

The store is *cloned* (``job_store``): a connection of this thread's own, so an operation that
blocks (the store's host frozen with rank 0) never holds the process group's client, and
``StopGrace`` never waits for one: it only reads ``last_seen``. A silent store reads as "no peer
progressing", and the grace expires as it did before.

The protocol: one counter per round, ``KEY``. A rank whose own progress moved adds 1 (atomic
``add``) at most every ``every_s``; a watching rank (one that got a stop signal) also reads it
(``add(KEY, 0)``) every ``every_s``, subtracts its own adds and notes, on its own monotonic
clock, when the others' count changed. One key: watching costs one round trip per rank and
interval whatever the world size, and no clocks of different hosts are ever compared.

Limit: a peer that keeps beating without reaching a boundary (its writer thread wedged on storage
while its main thread waits for it, beating) keeps the grace of every rank extended, as it did
for that rank alone before; the launcher's shutdown timeout (SIGKILL) stays the backstop.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

KEY = "elastic_train/stop_grace/beats"
# How often a rank publishes its progress and, once watching, reads its peers'. A peer's beat
# reaches a watcher within about two intervals plus the peer's own beat interval (a step, an
# evaluation batch, or the checkpoint writer's 1 s heartbeat): keep --stop-grace above ~3 s.
MAX_EVERY_S = 1.0


class CounterStore(Protocol):
    """What is used of a c10d ``Store``: an atomic add that returns the new value."""

    def add(self, key: str, value: int, /) -> int: ...


def job_store() -> CounterStore | None:
    """A connection of its own to the store of this process's default group (its round's
    prefix included), or None when there is no peer to hear from (a world of one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    # Private but stable since torch 1.x: the store the group was created on (the round prefix).
    store: CounterStore = dist.distributed_c10d._get_default_store().clone()
    return store


def interval_for(grace_s: float) -> float:
    """The publishing and reading interval for a grace of ``grace_s`` seconds."""
    return min(MAX_EVERY_S, grace_s / 5)


class PeerProgress:
    """This rank's progress published to ``store``, the other ranks' observed from it.

    ``local``: ``time.monotonic()`` of this rank's latest progress (the step watchdog's last beat).
    Thread-safe to read; the store is used by this object's daemon thread only.
    """

    def __init__(self, store: CounterStore, local: Callable[[], float], every_s: float) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s={every_s} must be > 0 (seconds between publications)")
        self.every_s = every_s
        self._store = store
        self._local = local
        self._published = local()  # the start is no progress
        self._mine = 0  # this rank's adds: the rest of the counter is its peers'
        self._others: int | None = None  # the peers' count at the latest read
        self._seen = -math.inf  # time.monotonic() when that count was last seen changing
        self._watching = threading.Event()
        self._stop = threading.Event()
        self._failed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="peer-progress", daemon=True)
            self._thread.start()

    def watch(self) -> None:
        """Read the peers' progress from now on, not only when publishing (a stop signal came)."""
        self._watching.set()

    def last_seen(self) -> float:
        """``time.monotonic()`` when another rank's progress was last seen (-inf: never)."""
        return self._seen

    def close(self) -> None:
        """Stop publishing. Does not wait for a store operation that blocks (daemon thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s * 2)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.tick()
            except Exception as exc:  # DistStoreError, a reset connection: the store went away
                if not self._failed:
                    self._failed = True
                    log.warning(
                        "peer_progress_unavailable",
                        error=repr(exc),
                        detail="the stop grace counts this rank's own progress only until the store answers",
                    )

    def tick(self) -> None:
        """One publication (if this rank progressed) and, when watching, one read."""
        progress = self._local()
        if progress != self._published:
            total = int(self._store.add(KEY, 1))
            self._mine += 1
            self._published = progress
        elif self._watching.is_set():
            total = int(self._store.add(KEY, 0))
        else:
            return
        self._failed = False
        others = total - self._mine
        if self._others is not None and others != self._others:
            self._seen = time.monotonic()
        self._others = others
