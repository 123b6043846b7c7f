"""Exact, SUM-reduced epoch metrics and the digest that proves which samples were trained on.

Each rank keeps raw sums (correct, loss_sum, samples), never local averages; one all-reduce of
the sums gives the global values exactly, however the data was split. The sample digest is an
order-independent fingerprint of the multiset of dataset indices trained on in an epoch: two
epochs have the same digest if (with overwhelming probability) they trained on the same
samples, each the same number of times, whatever the world size or how often the run restarted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastic_train.distributed.process_group import all_reduce_sum

# A Mersenne prime: sums of indices and of squared indices are kept modulo it so they fit in
# int64 after an all-reduce over thousands of ranks.
DIGEST_PRIME = (1 << 31) - 1


class MetricSums:
    """Per-rank running sums, kept on the compute device to avoid a sync per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # correct, loss_sum, samples: float64 so large sums stay exact enough.
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        # index sum, index-square sum (mod DIGEST_PRIME): int64, on the CPU where indices live.
        self.digest = torch.zeros(2, dtype=torch.int64)

    def add_batch(self, logits: torch.Tensor, labels: torch.Tensor, mean_loss: torch.Tensor) -> None:
        count = labels.shape[0]
        correct = (logits.argmax(dim=1) == labels).sum()
        batch = torch.stack(
            [
                correct.to(torch.float64),
                mean_loss.detach().to(torch.float64) * count,
                torch.tensor(count, dtype=torch.float64, device=self.device),
            ]
        )
        self.sums += batch

    def add_indices(self, indices: torch.Tensor) -> None:
        # +1 so that index 0 counts too (it would add nothing to either sum).
        idx = (indices.to(torch.int64) + 1) % DIGEST_PRIME
        self.digest[0] = (self.digest[0] + idx.sum()) % DIGEST_PRIME
        self.digest[1] = (self.digest[1] + (idx * idx % DIGEST_PRIME).sum()) % DIGEST_PRIME

    def add_digest(self, other: torch.Tensor) -> None:
        """Fold in another digest (e.g. the partial epoch of a rank that no longer exists)."""
        self.digest[:] = (self.digest + other.to(torch.int64)) % DIGEST_PRIME

    def reduce(self) -> Totals:
        """All-reduce (SUM) across ranks. Collective: every rank must call it."""
        sums = all_reduce_sum(self.sums.clone())
        digest = all_reduce_sum(self.digest.clone().to(self.device)).cpu() % DIGEST_PRIME
        correct, loss_sum, samples = (float(v) for v in sums.cpu())
        return Totals(
            correct=correct,
            loss_sum=loss_sum,
            samples=int(samples),
            digest=f"{int(digest[0]):08x}-{int(digest[1]):08x}",
        )


@dataclass(frozen=True)
class Totals:
    correct: float
    loss_sum: float
    samples: int
    digest: str

    @property
    def loss(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else float("nan")


@dataclass(frozen=True)
class EpochRecord:
    """One line of ``metrics.jsonl``."""

    epoch: int  # 1-based, as printed
    world_size: int
    train_loss: float
    train_acc: float
    val_loss: float
    val_acc: float
    epoch_time: float  # MAX over ranks of the training phase, seconds
    throughput: float  # global training images / epoch_time
    samples_seen: int  # global training samples this epoch
    sample_digest: str
    val_samples: int
    step: int  # global optimizer steps completed at the end of the epoch

    def console_line(self, epochs: int) -> str:
        """The seed's epoch line, same fields and number formats."""
        return (
            f"Epoch {self.epoch}/{epochs}: time={self.epoch_time:.3f}s, train_loss={self.train_loss:.4f}, "
            f"train_acc={self.train_acc:.4f}, val_loss={self.val_loss:.4f}, val_acc={self.val_acc:.4f}, "
            f"throughput={self.throughput:.1f} img/s"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
