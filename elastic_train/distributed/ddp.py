"""DDP whose gradient buckets are the same in every run of a model, so that a resume is bitwise.

DDP reduces its first step's gradients in one bucket of every parameter, then rebuilds its
buckets in the order the gradients became ready. A run resumed from a checkpoint starts that
over: its first step after the resume reduces with other bucket boundaries than the
uninterrupted run's same step. With two ranks that is harmless (a + b == b + a), but from three
on a ring all-reduce (gloo's, NCCL's) adds the ranks' values in an order set by where an element
falls in its bucket's chunks, so the resumed run drifts from its first step (measured: 2.7e-5 in
the weights 5 steps after a kill at 4 workers, where 2 workers end bitwise equal).

``replicate`` with ``fixed_buckets`` rebuilds the buckets once, at construction, from the
parameters' registration order (the pair of reducer calls DDP's own ``Join`` hook makes), so the
layout is a function of the model alone and DDP never changes it. The price: DDP reduces its
buckets strictly in index order, and bucket 0 now holds the first-registered parameters, whose
gradients backward produces last, so no all-reduce overlaps the backward. Restart mode pays it
only where it buys something, from three ranks on; quorum mode (results equal up to float
summation order) and two ranks keep DDP's own buckets. A task that sets
``find_unused_parameters`` never rebuilds anyway (both calls are then no-ops).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

ORDER_FREE_RANKS = 2  # a sum of two values is the same in either order


def replicate(
    module: nn.Module, device_ids: list[int] | None, *, fixed_buckets: bool = True, **kwargs: Any
) -> DistributedDataParallel:
    """``DistributedDataParallel(module, device_ids, **kwargs)``; with ``fixed_buckets`` (and more
    than two ranks) its bucket layout is fixed for the run, so a resume at the same world size
    is bitwise. Every rank calls it at the same point (the rebuild agrees the layout in a
    collective)."""
    ddp = DistributedDataParallel(module, device_ids=device_ids, **kwargs)
    if fixed_buckets and needs_fixed_buckets(dist.get_world_size(ddp.process_group)):
        reducer = ddp.reducer
        reducer._push_all_rebuilt_params()
        reducer._rebuild_buckets()
    return ddp


def needs_fixed_buckets(world_size: int) -> bool:
    """Whether DDP's bucket layout changes the sums: from three ranks on."""
    return world_size > ORDER_FREE_RANKS
