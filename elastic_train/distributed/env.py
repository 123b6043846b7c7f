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
            return cls(run_id=slurm or uuid.uuid4().hex[:12], slurm_job_id=slurm)
        world_size = _int(env, "WORLD_SIZE", 1)
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=world_size,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
            node_rank=_int(env, "GROUP_RANK", 0),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "torchrun",
            launched=True,
            slurm_job_id=slurm,
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
        """The job across restarts and requeues: the Slurm job id if any, else the run id."""
        return f"slurm-{self.slurm_job_id}" if self.slurm_job_id else self.run_id


def should_print_console(env: DistEnv) -> bool:
    """Only the main rank writes the human-readable console lines."""
    return env.is_main


def should_prepare_dataset(env: DistEnv) -> bool:
    """Only the main rank extracts archives; the others wait (data dirs are on shared storage)."""
    return env.is_main


def should_write_metrics(env: DistEnv) -> bool:
    return env.is_main
