"""Error types that map to process exit codes.

The exit code is the contract with whoever launched us (a shell, torchrun, an sbatch script):

* ``EXIT_OK`` (0): training finished (target reached, patience exhausted or all epochs done).
* ``EXIT_USAGE`` (2): bad flags, bad environment or bad input data. Retrying will not help, so
  every rank exits with this code before any training step and before anything on disk changes.
* anything else: a crash; torchrun may restart the group.
"""

from __future__ import annotations

import sys
from typing import Protocol

EXIT_OK = 0
EXIT_USAGE = 2


class UsageError(Exception):
    """A problem the user has to fix: names the problem and, in ``hint``, the fix."""

    def __init__(self, problem: str, hint: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.problem}. Fix: {self.hint}" if self.hint else self.problem


class DataError(UsageError):
    """The dataset is missing, malformed or corrupt."""


class _Ranked(Protocol):
    @property
    def is_main(self) -> bool: ...


def report_usage_error(exc: UsageError, env: _Ranked | None) -> None:
    """One message for the whole job: printed by rank 0 (or by a process that does not know its rank)."""
    if env is None or env.is_main:
        print(f"elastic-train: error: {exc}", file=sys.stderr, flush=True)
