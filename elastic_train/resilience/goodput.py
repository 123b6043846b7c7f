"""Goodput: how much of the job's wall time went into steps that count.

* ``job_start``: when the job first started (kept across restarts and requeues).
* productive time: the training time of every step in the final timeline, each counted once
  (the per-epoch ``epoch_time`` values: a resumed epoch adds the time before the failure, saved
  in the checkpoint, to the time after it; recomputed steps are timed once, when they count).
* a recovery: from the last progress before a failure until the resumed run is back at the step
  it had reached. Its cost covers detection, restart, loading and recomputation.
* time between launches (``away_s``): from the end of an attempt that ended the launch (Ctrl-C,
  a preemption: their markers' time) to the start of the next launch's launcher (torchrun's
  agent, or the process itself). It is nobody's loss: not counted as lost, and left out of the
  wall time goodput is taken over (a requeue's wait in the queue, a night between two runs).
* ``Goodput = productive time / (now - job_start - away_s)``: the share of the job's own wall
  time spent in training steps that count. Start-up, evaluation, checkpoint waits and recoveries
  all count against it, so a short fault-free run shows well under 1.

Rank 0 keeps ``<checkpoint-dir>/.progress.json`` (job start, the highest step reached and when),
rewritten after every step, so the next attempt knows exactly how far the failed one got. The
write is a ~100-byte atomic replace; where it is slow against the steps (three writes in a row
over both ``SLOW_WRITE_S`` and ``SLOW_WRITE_SHARE`` of the step time, as on a loaded shared
filesystem) it is throttled to one every ``THROTTLED_EVERY_S``, and the step count of a
recovery may then be short by the steps of that interval. The
accounting itself travels in every checkpoint. Limits: an attempt that dies before its first
checkpoint starts the job afresh, and its time is not counted as lost.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.outcome import RestartCause

PROGRESS = ".progress.json"
SLOW_WRITE_S = 0.002
SLOW_WRITE_SHARE = 0.05  # of the time between steps
THROTTLED_EVERY_S = 0.2


@dataclass
class Accounting:
    job_start: float
    restarts: dict[str, int] = field(default_factory=dict)  # RestartCause value -> count
    lost_s: float = 0.0
    recomputed_steps: int = 0
    away_s: float = 0.0  # between launches: not the job's wall time

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Accounting:
        return cls(
            float(raw["job_start"]),
            dict(raw.get("restarts", {})),
            float(raw.get("lost_s", 0.0)),
            int(raw.get("recomputed_steps", 0)),
            float(raw.get("away_s", 0.0)),
        )

    def wall(self, now: float) -> float:
        """The job's own wall time: since its start, less the time between its launches."""
        return max(now - self.job_start - self.away_s, 1e-9)

    def goodput(self, productive_s: float, now: float) -> float:
        return min(1.0, productive_s / self.wall(now))

    def summary_lines(self, productive_s: float, now: float) -> list[str]:
        wall = self.wall(now)
        causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(self.restarts.items()))
        between = f" ({self.away_s:.3f} s between launches not counted)" if self.away_s > 0 else ""
        return [
            f"Wall time since job start: {wall:.3f} seconds{between}",
            f"Productive step time: {productive_s:.3f} seconds",
            f"Restarts: {sum(self.restarts.values())}" + (f" ({causes})" if causes else ""),
            f"Time lost to recovery: {self.lost_s:.3f} seconds",
            f"Steps recomputed: {self.recomputed_steps}",
            f"Goodput: {self.goodput(productive_s, now):.2f}",
        ]


def read_progress(checkpoint_dir: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((checkpoint_dir / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and {"job_start", "step", "time"} <= raw.keys() else None


class ProgressTracker:
    """Rank 0's view of the job's progress, and the bookkeeping of the recovery in flight."""

    def __init__(
        self,
        checkpoint_dir: Path,
        accounting: Accounting,
        enabled: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = checkpoint_dir / PROGRESS
        self.accounting = accounting
        self.enabled = enabled
        self._clock = clock  # wall clock; injectable so the throttle can be tested without timing
        self._last_write = 0.0
        self._write_every = 0.0  # every step until writes prove slow
        self._slow_writes = 0  # consecutive; one hiccup of a busy disk is not a slow filesystem
        self._last_step = clock()
        self._recovering_until: int | None = None  # step the failed attempt had reached
        self._progress_time = 0.0

    def begin_recovery(
        self, cause: str, resumed_step: int, previous: dict[str, Any] | None, away_s: float = 0.0
    ) -> None:
        """A run resumed from a checkpoint: count it, and time it until it is back where it was.

        ``cause``: a ``RestartCause`` (``outcome.previous_exit_cause``); its value is the key stored.
        ``away_s``: of the time since the last progress, how much lay between two launches (see
        the module docstring); it is neither lost nor the job's wall time.
        """
        key = RestartCause(cause).value  # a typo'd cause fails here, not as a new key in every checkpoint
        self.accounting.restarts[key] = self.accounting.restarts.get(key, 0) + 1
        reached = int(previous["step"]) if previous else resumed_step
        self.accounting.recomputed_steps += max(0, reached - resumed_step)
        self.accounting.away_s += max(0.0, away_s)
        self._progress_time = (float(previous["time"]) if previous else self._clock()) + max(0.0, away_s)
        self._recovering_until = max(reached, resumed_step)

    def on_step(self, step: int) -> None:
        now = self._clock()
        step_s, self._last_step = now - self._last_step, now
        if self._recovering_until is not None and step >= self._recovering_until:
            self.accounting.lost_s += max(0.0, now - self._progress_time)
            self._recovering_until = None
        if self.enabled and now - self._last_write >= self._write_every:
            self._last_write = now
            record = {"job_start": self.accounting.job_start, "step": step, "time": now}
            tmp = self.path.with_name(f"{PROGRESS}.tmp-{os.getpid()}")
            began = self._clock()
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, self.path)
            except OSError:
                pass  # bookkeeping only: never fail training over it
            took = self._clock() - began
            slow = took > SLOW_WRITE_S and took > SLOW_WRITE_SHARE * step_s
            self._slow_writes = self._slow_writes + 1 if slow else 0
            if self._slow_writes >= 3:
                self._write_every = THROTTLED_EVERY_S
