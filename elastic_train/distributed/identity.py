"""The job's identity when nothing in the environment names it: minted once, kept in a store.

Why: the checkpoint lock's owner is the job (``DistEnv.job_id``): the same job takes its own lock
back after a restart, any other job is refused. torchrun's documented way to run several jobs on
one host (``--rdzv-backend=c10d --rdzv-endpoint=localhost:PORT``, no ``--rdzv-id``) gives every
job the run id ``none``, so a second job on the same directory took the first one's lock as its
own (measured: it resumed the first job's state and trained to the end while the first one's
commits failed).

How: the first rank 0 that starts sets ``elastic_train/job_id/<run id>`` in a store that outlives
the job's worker restarts, with ``compare_set`` (atomic: of racing starters one wins, the others
read its value); every later start of the same job reads it back. The store:

* ``ELASTIC_TRAIN_JOB_STORE`` (host:port) when set: jobs/elastic-agent.sh gives its rendezvous
  endpoint (a ``python -m elastic_train.rendezvous`` store, or the hosting agent's), which lives
  as long as the job;
* else torchrun's agent store, which it shares with its workers by default
  (``TORCHELASTIC_USE_AGENT_STORE=True``, MASTER_ADDR/MASTER_PORT): rank 0's agent creates it
  once, at its first rendezvous, and keeps it for its lifetime. A worker restart finds the same
  store; another job, even one that later reuses the same rendezvous port, has its own.

Without either (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each round a new store) the
identity is the launcher process's (host, pid, start time): the same across restarts of one
agent's workers, but not across agents. Limit: when rank 0 moves to another node, the old lock
is then judged like another job's (it frees once its holder is gone on this host or its TTL
passed); name the job (``ELASTIC_TRAIN_JOB_ID`` or ``--rdzv-id``) for multi-node jobs.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from dataclasses import replace
from typing import Protocol

import structlog

from elastic_train.distributed.env import DistEnv

log = structlog.get_logger(__name__)

KEY_PREFIX = "elastic_train/job_id/"
# Seconds to reach the identity store. It is the store the process group was just created on
# (or the rendezvous endpoint the agent reached): an answer is expected at once.
CONNECT_TIMEOUT_S = 30.0


class SettableStore(Protocol):
    """What is used of a c10d ``Store``: an atomic compare-and-set that returns the value held."""

    def compare_set(self, key: str, expected_value: str, desired_value: str, /) -> bytes: ...


def mint_in_store(store: SettableStore, run_id: str) -> str:
    """The job id kept in ``store`` for the rendezvous ``run_id``: set now if absent (this is the
    job's first start), else the one the first start set."""
    fresh = f"job-{uuid.uuid4().hex[:12]}"
    return store.compare_set(KEY_PREFIX + run_id, "", fresh).decode()


def launcher_identity(pid: int) -> str:
    """The launcher process ``pid`` as an id: host, pid and its start time (a reused pid differs)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            started = fh.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks
    except (OSError, IndexError):
        started = "0"
    return f"agent-{socket.gethostname()}-{pid}-{started}"


def _connect(address: str) -> SettableStore:
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    store: SettableStore = dist.TCPStore(  # type: ignore[attr-defined]
        host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S)
    )
    return store


def resolve_job(env: DistEnv, launcher_pid: int | None = None) -> DistEnv:
    """``env`` with its job identity settled (see the module docstring). Only the process that
    holds the checkpoint lock needs it; a failure to reach the store falls back to the launcher's
    identity, logged, rather than refusing the run."""
    if not env.needs_minted_job:
        return env
    source = "launcher"
    job = ""
    if env.identity_store:
        try:
            job = mint_in_store(_connect(env.identity_store), env.run_id)
            source = f"store {env.identity_store}"
        except (RuntimeError, ValueError, OSError) as exc:  # DistStoreError is a RuntimeError
            log.warning("job_identity_store_unreachable", store=env.identity_store, error=repr(exc))
    if not job:
        job = launcher_identity(launcher_pid if launcher_pid is not None else os.getppid())
    log.info("job_identity", job=job, source=source, run_id=env.run_id)
    return replace(env, job=job)
