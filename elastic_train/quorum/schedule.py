"""Which samples a participant trains on at a global step, for the quorum formed for that step.

In quorum mode the membership can change at every step: a step that failed is redone by the
survivors, and a replacement joins at a step boundary. The data order must not notice. As in
``data.sampler`` the run is a fixed sequence of GLOBAL batches (a function of the seed and the
epoch only); step ``s`` trains on global batch ``s``, whatever the quorum, split over the ``W``
participants of the attempt that commits it (``split_evenly``: shares differ by at most one).
So an attempt that is discarded and redone over a new membership trains on exactly the same
samples, each committed step covers its global batch exactly once, and the global batch stays
constant. The only state is the step counter, which the quorum agrees on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from elastic_train.data.sampler import global_batches, loss_weight, num_global_batches, split_evenly


@dataclass(frozen=True)
class StepShare:
    step: int  # global step, 0-based: the index of the global batch in the run
    epoch: int
    batch: int  # the global batch's index within its epoch
    indices: tuple[int, ...]  # this participant's samples (dataset indices)
    weight: float  # factor for this share's mean loss: the update is the global batch's mean


class QuorumSchedule:
    """Global batch ``s`` of a run, cut for any membership ``(world, rank)``."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, max_steps_per_epoch: int | None = None):
        if num_samples < global_batch:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.max_steps_per_epoch = max_steps_per_epoch

    @property
    def batches_per_epoch(self) -> int:
        return num_global_batches(self.num_samples, self.global_batch, self.max_steps_per_epoch)

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, batch in epoch)`` of global step ``step``."""
        return divmod(step, self.batches_per_epoch)

    @lru_cache(maxsize=2)  # noqa: B019 (one schedule per run: the current and the next epoch)
    def _epoch(self, epoch: int) -> torch.Tensor:
        return global_batches(self.num_samples, self.global_batch, self.seed, epoch, self.max_steps_per_epoch)

    def share(self, step: int, world: int, rank: int) -> StepShare:
        """Participant ``rank`` of ``world``'s samples at ``step``. Every participant of an
        attempt must use the same ``world`` (the quorum's size) and a distinct ``rank``."""
        if not 0 <= rank < world <= self.global_batch:
            raise ValueError(f"rank {rank} of {world} participants cannot share a global batch of {self.global_batch}")
        epoch, batch = self.position(step)
        part = split_evenly(self.global_batch, world, rank)
        indices = self._epoch(epoch)[batch, part.start : part.stop]
        return StepShare(
            step=step,
            epoch=epoch,
            batch=batch,
            indices=tuple(int(i) for i in indices),
            weight=loss_weight(len(part), self.global_batch, world),
        )
