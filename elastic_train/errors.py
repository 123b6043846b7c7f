"""Error types that map to process exit codes (the codes themselves: ``elastic_train.outcome``).

A ``UsageError`` (bad flags, bad environment or bad input data) ends every rank with
``ExitCode.USAGE`` (2) before any training step and before anything on disk changes: retrying
will not help. Any other exception is a crash; torchrun may restart the group.
"""

from __future__ import annotations

import sys
from typing import Protocol


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


_last_reported: list[str] = []


def last_usage_error() -> str | None:
    """The message of the latest ``report_usage_error`` in this process (every rank's, printed or not)."""
    return _last_reported[-1] if _last_reported else None


def report_usage_error(exc: UsageError, env: _Ranked | None) -> None:
    """One message for the whole job: printed by rank 0 (or by a process that does not know its rank)."""
    _last_reported.append(str(exc))
    if env is None or env.is_main:
        print(f"elastic-train: error: {exc}", file=sys.stderr, flush=True)
