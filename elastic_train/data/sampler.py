"""World-size-independent data order.

The seed's ``DistributedSampler`` shuffles with ``seed + epoch`` and deals indices round-robin to
ranks, so the sequence of samples each optimizer step sees depends on the world size. Here the
order is defined on GLOBAL batches instead:

* epoch ``e`` permutes ``range(N)`` with a generator seeded by ``seed + e`` (a new shuffle each
  epoch, the same on every rank, whatever the world size);
* global batch ``b`` is ``perm[b*G:(b+1)*G]``; the last incomplete batch is dropped, so every
  optimizer step sees exactly ``G`` samples (documented limitation: up to ``G - 1`` samples per
  epoch are not trained on, a different set each epoch);
* rank ``r`` of ``W`` takes the contiguous slice ``[r*G/W, (r+1)*G/W)`` of each global batch.

So the union over ranks of step ``b`` is the same set of samples for any ``W``, and a run can
resume at any world size from ``(epoch, batches consumed)`` alone. Each item is the pair
``(epoch, index)`` so that per-sample augmentation can be seeded from it, independent of which
rank or worker loads the sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shuffle: identical on every rank and for every world size."""
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=gen)


def num_global_batches(num_samples: int, global_batch: int, max_steps: int | None = None) -> int:
    full = num_samples // global_batch
    return full if max_steps is None else min(full, max_steps)


def global_batches(
    num_samples: int, global_batch: int, seed: int, epoch: int, max_steps: int | None = None
) -> torch.Tensor:
    """All global batches of an epoch as a ``[num_batches, global_batch]`` index tensor."""
    count = num_global_batches(num_samples, global_batch, max_steps)
    perm = epoch_permutation(num_samples, seed, epoch)
    return perm[: count * global_batch].view(count, global_batch)


def rank_slice(batch: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of one global batch (requires ``len % world_size == 0``)."""
    per_rank = batch.numel() // world_size
    if per_rank * world_size != batch.numel():
        raise ValueError(f"global batch of {batch.numel()} does not split over {world_size} ranks")
    return batch[rank * per_rank : (rank + 1) * per_rank]


class GlobalBatchSampler:
    """A ``batch_sampler`` for ``DataLoader`` yielding this rank's ``(epoch, index)`` pairs.

    ``set_epoch(epoch, start_batch)`` selects the epoch and, on resume, how many global batches
    of it were already consumed (by any number of ranks).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        max_steps_per_epoch: int | None = None,
    ) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size}")
        if num_samples < global_batch:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.max_steps_per_epoch = max_steps_per_epoch
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return num_global_batches(self.num_samples, self.global_batch, self.max_steps_per_epoch)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start batch {start_batch} outside [0, {self.batches_per_epoch}]")
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batches = global_batches(self.num_samples, self.global_batch, self.seed, self.epoch, self.max_steps_per_epoch)
        for b in range(self.start_batch, batches.shape[0]):
            mine = rank_slice(batches[b], self.world_size, self.rank)
            yield [(self.epoch, int(i)) for i in mine]


def eval_shard(num_samples: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s contiguous block of the validation set: no padding, no overlap.

    Blocks differ in length by at most one, so every sample is evaluated exactly once and the
    SUM-reduced metrics equal a single-process evaluation.
    """
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class EvalBatchSampler:
    """Batches over this rank's validation shard, in order."""

    def __init__(self, num_samples: int, batch_size: int, world_size: int, rank: int) -> None:
        self.shard = eval_shard(num_samples, world_size, rank)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.shard) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, len(self.shard), self.batch_size):
            yield list(self.shard[start : start + self.batch_size])
