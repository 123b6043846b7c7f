"""Early stopping: rank 0 decides, every rank obeys the broadcast decision.

Validation metrics are all-reduced, so every rank could decide by itself; the seed still lets
rank 0 decide and broadcasts the verdict, which guarantees that all ranks leave the loop in the
same epoch even if float results ever differed. The state is small and JSON-serialisable so a
checkpoint can carry it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastic_train.distributed.process_group import broadcast_flag


@dataclass
class EarlyStopper:
    """Stops on a target and on patience, watching one metric (``monitor``) in one direction
    (``mode``): the seed's ``val_acc``, higher is better, by default; a task may watch e.g.
    ``val_loss`` (lower is better). ``target_accuracy`` is the monitored metric's target (the name
    is the seed's, and checkpoints store it); None: patience only."""

    target_accuracy: float | None
    patience: int  # 0: never stop on patience
    best_accuracy: float = -1.0  # val_acc runs: the best so far (also what older checkpoints hold)
    epochs_without_improvement: int = 0
    reason: str = ""
    monitor: str = "val_acc"
    mode: str = "max"  # "max": higher is better; "min": lower
    best: float | None = None  # the best monitored value so far (None: no epoch yet)

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.mode == "max" else value < than

    def _reached(self, value: float) -> bool:
        target = self.target_accuracy
        return target is not None and (value >= target if self.mode == "max" else value <= target)

    def _best(self) -> float | None:
        if self.best is not None:
            return self.best
        # A checkpoint from before `best` existed: val_acc runs kept it in best_accuracy.
        return self.best_accuracy if self.monitor == "val_acc" and self.best_accuracy >= 0 else None

    def update(self, value: float) -> bool:
        """Record one epoch's monitored value; True when training should stop."""
        best = self._best()
        if best is None or self._better(value, best):
            self.best = best = value
            if self.monitor == "val_acc":
                self.best_accuracy = value
            self.epochs_without_improvement = 0
        else:
            self.epochs_without_improvement += 1
        sign = ">=" if self.mode == "max" else "<="
        if self._reached(value):
            self.reason = f"{self.monitor} {value:.4f} {sign} target {self.target_accuracy:.4f}"
            return True
        if self.patience and self.epochs_without_improvement >= self.patience:
            self.reason = f"no {self.monitor} improvement over {best:.4f} for {self.patience} epoch(s)"
            return True
        return False

    def stops_at(self, value: float) -> str:
        """Why a run whose last epoch's monitored value was ``value`` is over under this stopper's
        target and patience, or "" when it would train on (no update: the epoch was counted)."""
        if self._reached(value):
            flag = "--target-accuracy" if self.monitor == "val_acc" else "the task's target"
            sign = ">=" if self.mode == "max" else "<="
            return f"its last {self.monitor} {value:.4f} {sign} {flag} {self.target_accuracy:.4f}"
        if self.patience and self.epochs_without_improvement >= self.patience:
            stale = self.epochs_without_improvement
            return f"no {self.monitor} improvement for {stale} epoch(s) >= --patience {self.patience}"
        return ""

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def resume(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state``: its progress (best value, epochs without
        improvement), under this run's own target, patience and monitor (they may have changed)."""
        own = (self.target_accuracy, self.patience, self.monitor, self.mode)
        for key, value in state.items():
            setattr(self, key, value)
        self.target_accuracy, self.patience, self.monitor, self.mode = own


def decide_stop(stopper: EarlyStopper, val_accuracy: float, is_main: bool, device: torch.device) -> bool:
    """Collective: rank 0 updates its stopper and broadcasts; all ranks return the same bool.

    Every rank updates its own copy too, so that the state a checkpoint saves is the same on all.
    """
    local = stopper.update(val_accuracy)
    return broadcast_flag(local if is_main else False, device)
