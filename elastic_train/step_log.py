"""Per-step curves: every ``--log-every`` steps, rank 0 appends one line to ``<log-dir>/steps.jsonl``
and, when TensorBoard is installed (``pip install 'elastic-train[tensorboard]'``), writes the same
scalars under ``<log-dir>/tensorboard``.

A line: ``{"step", "time", "epoch", "loss", "lr", "samples_per_s", "world_size"}``. In restart
mode ``loss`` is rank 0's share of the step (its mean; the exact global figures stay per epoch in
``metrics.jsonl``: a global per-step loss would cost a collective each time); in quorum mode the
step's participant 0 writes the global batch's loss, exact (the step's sums are exchanged
anyway). ``samples_per_s`` is the global batch over the wall time since the previous line, per
step. After a restart the steps after the
checkpoint are logged again (they were recomputed): ``python -m elastic_train.report`` draws them
against wall-clock time, where the repeat shows as the time the failure cost.

Writing is best effort: a full disk never fails training over a curve.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

STEPS_FILE = "steps.jsonl"


class StepLog:
    def __init__(self, log_dir: Path, every: int, enabled: bool, global_batch: int) -> None:
        self.every = every
        self.enabled = enabled and every > 0
        self.path = log_dir / STEPS_FILE
        self.global_batch = global_batch
        self._last: tuple[int, float] | None = None  # (step, monotonic time) of the previous line
        self._writer: Any = None
        if self.enabled:
            self._writer = _tensorboard(log_dir / "tensorboard")

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    def step(self, step: int, epoch: int, loss: float, lr: float, world_size: int) -> None:
        """After optimizer step ``step`` (from 1); writes on every ``every``-th."""
        if not self.due(step):
            return
        now = time.monotonic()
        rate = None
        if self._last is not None and step > self._last[0]:
            rate = self.global_batch * (step - self._last[0]) / max(now - self._last[1], 1e-9)
        self._last = (step, now)
        record = {
            "step": step,
            "time": time.time(),
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "samples_per_s": rate,
            "world_size": world_size,
        }
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        if self._writer is not None:
            with contextlib.suppress(Exception):  # a curve never fails training
                for key in ("loss", "lr", "samples_per_s", "world_size"):
                    if record[key] is not None:
                        self._writer.add_scalar(f"train/{key}", record[key], step)

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None


def _tensorboard(folder: Path) -> Any:
    """A ``SummaryWriter`` when the optional ``tensorboard`` package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    try:
        return SummaryWriter(log_dir=str(folder))
    except OSError as exc:
        log.warning("tensorboard_unavailable", error=repr(exc))
        return None


def read_steps(log_dir: Path) -> list[dict[str, Any]]:
    """Every complete line of ``steps.jsonl`` (a line cut short by a kill is skipped)."""
    out = []
    try:
        text = (log_dir / STEPS_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out
