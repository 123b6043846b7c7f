"""A key namespace that every rank of one rendezvous round provably agrees on.

Why: with torch's defaults (``TORCHELASTIC_USE_AGENT_STORE=True``, i.e. without
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) the agent hosts ONE TCPStore for its workers and keeps
it across rendezvous rounds. ``init_process_group("env://")`` uses it without a per-round prefix
(torch 2.14.1's ``_create_c10d_store`` assumes "a new TCPStore for every retry", which is not
true in that mode), so a restarted rank can read the previous round's gloo/NCCL addresses under
the same keys and hang in ProcessGroupGloo's full-mesh connect (measured: 3 of 4 plain
``torchrun --max-restarts=3`` runs hung after a worker raised). A retried ``init_process_group``
after a half-finished attempt meets the same stale keys.

The launcher gives workers nothing that names the round (TORCHELASTIC_RESTART_COUNT is per
agent), so the ranks agree on one through the store itself, with a proof of liveness:

1. rank 0 takes a fresh generation ``g`` with the store's atomic ``add`` (never reused, since
   the store outlives the rounds) and publishes ``announce = g``;
2. every other rank reads ``announce``, writes a fresh random nonce under ``g/join/<rank>`` and
   waits (briefly) for ``g/members``, which rank 0 writes once it has every rank's nonce;
3. a rank accepts ``g`` only if ``g/members`` lists *its own fresh nonce*. An announcement left
   by an earlier round (read before this round's rank 0 wrote its own) names a generation whose
   rank 0 is gone, frozen or busy training (an orphan): nobody answers with this rank's nonce,
   so after ``POLL_S`` it reads ``announce`` again.

Keys of generation ``g`` are written only by this round's ranks, so the process group created
under the prefix ``elastic_train/round/<g>`` sees nothing stale. The cost is two store round
trips per rank at start-up. Everything runs on torch's own store and c10d rendezvous: this only
chooses a key prefix inside it.
"""

from __future__ import annotations

import datetime
import secrets
import time

import structlog
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

log = structlog.get_logger(__name__)

PREFIX = "elastic_train/round"
# How long a rank waits for rank 0's answer before it suspects a stale announcement and reads
# it again. Short: a stale announcement is the common case right after a restart.
POLL_S = 1.0


class RoundAgreementTimeout(TimeoutError):
    """No live rank 0 answered within the deadline (it died, or the store is unreachable)."""


def _wait(store: Store, key: str, seconds: float) -> bool:
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except (dist.DistStoreError, RuntimeError) as exc:  # torch raises DistStoreError on a wait timeout
        if "timeout" in str(exc).lower() or isinstance(exc, dist.DistStoreError):
            return False
        raise
    return True


def agree_round(store: Store, rank: int, world_size: int, timeout_s: float) -> str:
    """Return the key prefix for this round's process group. Collective over the store."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = int(store.add(f"{PREFIX}/generation", 1))
        store.set(f"{PREFIX}/announce", str(generation))
        nonces = []
        for peer in range(1, world_size):
            key = f"{PREFIX}/{generation}/join/{peer}"
            if not _wait(store, key, max(0.1, deadline - time.monotonic())):
                raise RoundAgreementTimeout(f"rank {peer} did not join round generation {generation} in {timeout_s}s")
            nonces.append(store.get(key).decode())
        store.set(f"{PREFIX}/{generation}/members", ",".join(nonces))
        log.debug("round_agreed", generation=generation)
        return f"{PREFIX}/{generation}/"
    nonce = secrets.token_hex(8)
    while time.monotonic() < deadline:
        # Blocks until some rank 0 has ever announced (the store's own timeout bounds it).
        generation = int(store.get(f"{PREFIX}/announce").decode())
        store.set(f"{PREFIX}/{generation}/join/{rank}", nonce)
        members_key = f"{PREFIX}/{generation}/members"
        if _wait(store, members_key, min(POLL_S, max(0.1, deadline - time.monotonic()))):
            members = store.get(members_key).decode().split(",")
            # Our nonce proves a live rank 0 answered. It must also still be the announced one:
            # an earlier round's rank 0 frozen inside this function and resumed could answer too,
            # and this round's rank 0 overwrites its announcement.
            current = int(store.get(f"{PREFIX}/announce").decode())
            if len(members) >= rank and members[rank - 1] == nonce and current == generation:
                log.debug("round_agreed", generation=generation)
                return f"{PREFIX}/{generation}/"
            time.sleep(0.05)  # an earlier round's answer: wait for this round's rank 0 to announce
        # Stale (an earlier round's rank 0 will never answer) or not ready yet: look again.
    raise RoundAgreementTimeout(f"rank {rank}: no live rank 0 announced a round within {timeout_s}s")
