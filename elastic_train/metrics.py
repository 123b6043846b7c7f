"""Exact, SUM-reduced epoch metrics and the digest that proves which samples were trained on.

Each rank keeps raw sums (correct, loss_sum, samples), never local averages; one all-reduce of
the sums gives the global values exactly, however the data was split.

The sample digest is an order-independent hash of the MULTISET of dataset indices trained on in
an epoch: each index is mixed by splitmix64 (salted, in two lanes) and the mixed values are
added modulo 2^64. Addition makes it independent of order, batching, world size and restarts
(partial digests of ranks and attempts simply add up); the mix makes any change of the multiset
(a skipped, repeated or swapped sample) change each lane like a random 64-bit value, so two
different epochs share a digest with probability about 2^-128. (The previous digest, sums of
i and i^2 modulo a prime, collided for swaps such as {0, 4, 5} vs {1, 2, 6}.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from elastic_train.distributed.process_group import all_reduce_sum

U64 = npt.NDArray[np.uint64]
# One salt per lane: the lanes are independent hash functions of the same index. Digits of pi
# (nothing up the sleeve); any two distinct constants would do.
LANE_SALTS = np.array([0x243F6A8885A308D3, 0x13198A2E03707344], dtype=np.uint64)
_LOW32 = np.uint64(0xFFFFFFFF)


def splitmix64(x: U64) -> U64:
    """Vigna's splitmix64 output function, elementwise on ``uint64`` (arithmetic wraps mod 2^64).

    A bijection of 64-bit values that mixes every input bit into every output bit.
    """
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def index_digest(indices: torch.Tensor) -> U64:
    """The two lanes of the digest of ``indices``: ``sum(splitmix64(i ^ salt)) mod 2^64`` each."""
    idx = indices.detach().cpu().numpy().astype(np.uint64).reshape(-1, 1)
    mixed = splitmix64(idx ^ LANE_SALTS)  # [n, 2]
    lanes: U64 = mixed.sum(axis=0, dtype=np.uint64)
    return lanes


def format_digest(lanes: U64) -> str:
    return "-".join(f"{int(lane):016x}" for lane in lanes)


class MetricSums:
    """Per-rank running sums, kept on the compute device to avoid a sync per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # correct, loss_sum, samples: float64 so large sums stay exact enough.
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        # The digest's two uint64 lanes, stored bit for bit as int64 (the dtype checkpoints and
        # collectives support), on the CPU where the indices live.
        self.digest = torch.zeros(2, dtype=torch.int64)

    def add_batch(self, correct: torch.Tensor, count: int, mean_loss: torch.Tensor) -> None:
        """``correct``: how many of the batch's ``count`` samples count as correct (a tensor on
        the device: no sync); ``mean_loss``: the batch's mean loss."""
        batch = torch.stack(
            [
                correct.to(torch.float64),
                mean_loss.detach().to(torch.float64) * count,
                # A fill kernel with the count as its argument: no host-to-device copy, no sync
                # (torch.tensor(count, device=cuda) would copy and synchronise every step).
                torch.full((), count, dtype=torch.float64, device=self.device),
            ]
        )
        self.sums += batch

    def _lanes(self) -> U64:
        """The digest's lanes as a writable ``uint64`` view of ``self.digest``."""
        lanes: U64 = self.digest.numpy().view(np.uint64)
        return lanes

    def add_indices(self, indices: torch.Tensor) -> None:
        lanes = self._lanes()
        lanes += index_digest(indices)

    def add_digest(self, other: torch.Tensor) -> None:
        """Fold in another digest (e.g. the partial epoch of a rank that no longer exists)."""
        lanes = self._lanes()
        lanes += other.detach().cpu().to(torch.int64).numpy().view(np.uint64)

    def digest_hex(self) -> str:
        """This rank's digest so far, formatted as ``Totals.digest``."""
        return format_digest(self._lanes())

    def reduce(self) -> Totals:
        """All-reduce (SUM) across ranks. Collective: every rank must call it."""
        sums = all_reduce_sum(self.sums.clone())
        correct, loss_sum, samples = (float(v) for v in sums.cpu())
        return Totals(correct=correct, loss_sum=loss_sum, samples=int(samples), digest=self._reduce_digest())

    def _reduce_digest(self) -> str:
        """Sum the lanes over ranks mod 2^64 without relying on a backend's integer overflow:
        each lane travels as two 32-bit halves in int64 (exact for up to 2^31 ranks)."""
        lanes = self._lanes()
        halves = np.concatenate([lanes & _LOW32, lanes >> np.uint64(32)]).astype(np.int64)
        summed = all_reduce_sum(torch.from_numpy(halves).to(self.device)).cpu().numpy().astype(np.uint64)
        return format_digest(summed[:2] + (summed[2:] << np.uint64(32)))


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
    val_metrics: dict[str, float] = field(default_factory=dict)  # a task's extra metrics, per val sample

    @classmethod
    def of(
        cls,
        epoch: int,
        world_size: int,
        train: Totals,
        val: Totals,
        elapsed: float,
        step: int,
        val_metrics: dict[str, float],
    ) -> EpochRecord:
        """The record of 0-based ``epoch`` from its exact sums (both fault-tolerance modes)."""
        return cls(
            epoch=epoch + 1,
            world_size=world_size,
            train_loss=train.loss,
            train_acc=train.accuracy,
            val_loss=val.loss,
            val_acc=val.accuracy,
            epoch_time=elapsed,
            throughput=train.samples / elapsed if elapsed > 0 else 0.0,
            samples_seen=train.samples,
            sample_digest=train.digest,
            val_samples=val.samples,
            step=step,
            val_metrics=val_metrics,
        )

    def console_line(self, epochs: int, unit: str = "img", accuracy: bool = True) -> str:
        """The seed's epoch line, same fields and number formats (``unit``: what a sample is;
        ``accuracy`` False: a task without one, its two fields left out)."""
        train_acc = f"train_acc={self.train_acc:.4f}, " if accuracy else ""
        val_acc = f"val_acc={self.val_acc:.4f}, " if accuracy else ""
        return (
            f"Epoch {self.epoch}/{epochs}: time={self.epoch_time:.3f}s, train_loss={self.train_loss:.4f}, "
            f"{train_acc}val_loss={self.val_loss:.4f}, {val_acc}"
            f"throughput={self.throughput:.1f} {unit}/s"
            + "".join(f", {name}={value:.4f}" for name, value in self.val_metrics.items())
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.val_metrics:
            del out["val_metrics"]  # the seed's tasks have none: their lines stay as they were
        return out
