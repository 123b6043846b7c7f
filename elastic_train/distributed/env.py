"""The launcher's environment (torchrun, Slurm or none), read once into one frozen object.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and the
TORCHELASTIC_* variables for every worker. Without a launcher we run as a single process of a
world of one. Global rank decides who writes to shared storage; local rank only picks the device.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_train.errors import UsageError

# The job's identity, given by whoever launches it (any string; the same on every node and every
# restart of the job, different for every other job). Wins over everything below.
JOB_ID_VAR = "ELASTIC_TRAIN_JOB_ID"
# host:port of a store that outlives the job's worker restarts, where rank 0 mints the job's
# identity when nothing names it (``distributed/identity.py``). jobs/elastic-agent.sh sets it to
# its rendezvous endpoint; plain torchrun's shared agent store serves without it.
JOB_STORE_VAR = "ELASTIC_TRAIN_JOB_STORE"
# torchrun's default --rdzv-id, the same in every job: it names none. (Our own "torchrun" stands
# for a launcher that set RANK and WORLD_SIZE but no run id.)
UNNAMED_RUN_IDS = frozenset({"none", "torchrun"})


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(
            f"environment variable {name}={raw!r} is not an integer",
            f"unset {name} or launch with torchrun, which sets it",
        ) from None


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Immutable: read once at start-up."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    run_id: str = "local"
    launched: bool = False  # True under torchrun (or any launcher that set RANK/WORLD_SIZE)
    slurm_job_id: str = ""
    # The job's identity when the environment names one (JOB_ID_VAR, Slurm's job id, an explicit
    # --rdzv-id without JOB_STORE_VAR); "" when rank 0 must mint one (``identity.resolve_job``).
    job: str = ""
    # Where a minted identity is kept across worker restarts: "host:port", or "" for none.
    identity_store: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"WORLD_SIZE={self.world_size} must be >= 1", "check the launcher")
        if not 0 <= self.rank < self.world_size:
            raise UsageError(
                f"RANK={self.rank} is outside [0, WORLD_SIZE={self.world_size})",
                "check the launcher's RANK and WORLD_SIZE",
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise UsageError(
                f"LOCAL_RANK={self.local_rank} is outside [0, LOCAL_WORLD_SIZE={self.local_world_size})",
                "check the launcher's LOCAL_RANK and LOCAL_WORLD_SIZE",
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        launched = "RANK" in env and "WORLD_SIZE" in env
        slurm = env.get("SLURM_JOB_ID", "")
        if not launched:
            run_id = slurm or uuid.uuid4().hex[:12]
            return cls(run_id=run_id, slurm_job_id=slurm, job=_named_job(env) or run_id)
        world_size = _int(env, "WORLD_SIZE", 1)
        run_id = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "torchrun"
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=world_size,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
            node_rank=_int(env, "GROUP_RANK", 0),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            run_id=run_id,
            launched=True,
            slurm_job_id=slurm,
            job=_named_job(env) or ("" if run_id in UNNAMED_RUN_IDS or env.get(JOB_STORE_VAR) else run_id),
            identity_store=_identity_store(env),
        )

    # Named predicates: "who does this" is decided here, never by scattered `rank == 0`.
    @property
    def is_main(self) -> bool:
        """Rank 0: console output, metrics file, shared-storage writes, early-stop decisions."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def job_id(self) -> str:
        """The job across restarts and requeues (the checkpoint lock's owner): ``JOB_ID_VAR``,
        else ``slurm-<job id>``, else the identity rank 0 minted in ``JOB_STORE_VAR``'s store, else
        an explicit torchrun run id, else one minted in torchrun's shared store
        (``distributed.identity.resolve_job``); the bare run id only before the minting."""
        return self.job or self.run_id

    @property
    def needs_minted_job(self) -> bool:
        """Nothing in the environment names the job: torchrun's default ``--rdzv-id`` (``none``)
        is the same in every job on the host, so it cannot tell two jobs apart."""
        return self.launched and not self.job


def _named_job(env: Mapping[str, str]) -> str:
    """The job's identity as the launcher's environment gives it, or ""."""
    given = env.get(JOB_ID_VAR, "").strip()
    if given:
        return given
    slurm = env.get("SLURM_JOB_ID", "")
    return f"slurm-{slurm}" if slurm else ""


def _identity_store(env: Mapping[str, str]) -> str:
    """The store a minted identity survives worker restarts in: ``JOB_STORE_VAR``, else the
    agent's store torchrun shares with its workers (TORCHELASTIC_USE_AGENT_STORE=True: one TCPStore
    per agent lifetime, so per job), else "" (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every
    round a new one)."""
    given = env.get(JOB_STORE_VAR, "").strip()
    if given:
        return given
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if shared and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return ""


def should_print_console(env: DistEnv) -> bool:
    """Only the main rank writes the human-readable console lines."""
    return env.is_main


def should_prepare_dataset(env: DistEnv) -> bool:
    """Only the main rank extracts archives; the others wait (data dirs are on shared storage)."""
    return env.is_main


def should_write_metrics(env: DistEnv) -> bool:
    return env.is_main
