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
    target_accuracy: float
    patience: int  # 0: never stop on patience
    best_accuracy: float = -1.0
    epochs_without_improvement: int = 0
    reason: str = ""

    def update(self, val_accuracy: float) -> bool:
        """Record one epoch's validation accuracy; True when training should stop."""
        if val_accuracy > self.best_accuracy:
            self.best_accuracy = val_accuracy
            self.epochs_without_improvement = 0
        else:
            self.epochs_without_improvement += 1
        if val_accuracy >= self.target_accuracy:
            self.reason = f"val_acc {val_accuracy:.4f} >= target {self.target_accuracy:.4f}"
            return True
        if self.patience and self.epochs_without_improvement >= self.patience:
            self.reason = f"no val_acc improvement over {self.best_accuracy:.4f} for {self.patience} epoch(s)"
            return True
        return False

    def stops_at(self, val_accuracy: float) -> str:
        """Why a run whose last epoch reached ``val_accuracy`` is over under this stopper's target
        and patience, or "" when it would train on (no update: the epoch was counted already)."""
        if val_accuracy >= self.target_accuracy:
            return f"its last val_acc {val_accuracy:.4f} >= --target-accuracy {self.target_accuracy:.4f}"
        if self.patience and self.epochs_without_improvement >= self.patience:
            return (
                f"no val_acc improvement for {self.epochs_without_improvement} epoch(s) >= --patience {self.patience}"
            )
        return ""

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def resume(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state``: its progress (best accuracy, epochs without
        improvement), under this run's own target and patience (they may have changed)."""
        target, patience = self.target_accuracy, self.patience
        for key, value in state.items():
            setattr(self, key, value)
        self.target_accuracy, self.patience = target, patience


def decide_stop(stopper: EarlyStopper, val_accuracy: float, is_main: bool, device: torch.device) -> bool:
    """Collective: rank 0 updates its stopper and broadcasts; all ranks return the same bool.

    Every rank updates its own copy too, so that the state a checkpoint saves is the same on all.
    """
    local = stopper.update(val_accuracy)
    return broadcast_flag(local if is_main else False, device)
