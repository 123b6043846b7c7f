"""DDP whose gradient buckets are the same in every run of a model, so that a resume is bitwise.

DDP reduces its first step's gradients in one bucket of every parameter, then rebuilds its
buckets in the order the gradients became ready. A run resumed from a checkpoint starts that
over: its first step after the resume reduces with other bucket boundaries than the
uninterrupted run's same step. With two ranks that is harmless (a + b == b + a), but from three
on a ring all-reduce (gloo's, NCCL's) adds the ranks' values in an order set by where an element
falls in its bucket's chunks, so the resumed run drifts from its first step (measured: 2.7e-5 in
the weights 5 steps after a kill at 4 workers, where 2 workers end bitwise equal).

``replicate`` rebuilds the buckets once, at construction, from the parameters' registration
order (what DDP's own ``Join`` hook does), so the layout is a function of the model alone and
DDP never changes it. The price: buckets are launched in that order, not in the order backward
produces the gradients, so less of the all-reduce overlaps the backward of a model that needs
several buckets (25 MB each). A task that sets ``find_unused_parameters`` never rebuilds anyway.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def replicate(module: nn.Module, device_ids: list[int] | None, **kwargs: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(module, ...)`` with its bucket layout fixed for the run.

    Every rank calls it at the same point (the rebuild agrees the layout in a collective)."""
    ddp = DistributedDataParallel(module, device_ids=device_ids, **kwargs)
    fix_buckets(ddp)
    return ddp


def fix_buckets(ddp: DistributedDataParallel) -> None:
    """Rebuild ``ddp``'s buckets now, once, from the registration order (no-op where DDP never
    rebuilds: ``find_unused_parameters``)."""
    reducer = ddp.reducer
    reducer._push_all_rebuilt_params()  # torch's Join hook calls the same pair
    reducer._rebuild_buckets()
