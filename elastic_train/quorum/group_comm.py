"""The collectives inside one replica group: its K workers, torchrun's (or the quorum agent's) group.

The quorum's collectives (``Replica.sum``, ``Replica.average``) join each worker with the worker
of the same group rank in every other group, so a sum over the quorum is two hops: across the
groups (per group rank), then inside the group (``sum``). The second hop also makes the group
agree: a sibling whose cross-group collective failed (a peer group died mid-step) turns the
whole group's attempt into a failed one, so that no worker of a group goes on with sums its
siblings do not hold. A group of one worker has nothing to add: every call returns its input.

The tensors here are small (exact sums, position blocks, buffers, votes) and on the CPU: on a
NCCL job they travel in a gloo group of the same workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupComm:
    """This worker's replica group: ``size`` workers, this one ``rank`` among them."""

    size: int = 1
    rank: int = 0
    group: Any = None  # a gloo process group of the replica group's workers (None: the default group)

    @classmethod
    def of_default_group(cls) -> GroupComm:
        """The initialised default process group (torchrun's for this replica group). Collective
        when its backend is not gloo: every worker of the group must call it, in the same order
        as the group's other ``new_group`` calls."""
        if not dist.is_initialized():
            return cls()
        size, rank = dist.get_world_size(), dist.get_rank()
        group = None
        if size > 1 and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        return cls(size, rank, group)

    @property
    def is_first(self) -> bool:
        """Group rank 0: the worker that holds the checkpoint lock when its group saves."""
        return self.rank == 0

    def sum(self, tensor: torch.Tensor, ok: bool = True) -> bool:
        """SUM ``tensor`` (CPU) in place over the group, and agree on ``ok``: True when every
        worker's was True. When any was False, ``tensor`` holds nothing meaningful."""
        if self.size == 1:
            return ok
        flat = torch.cat([tensor.detach().reshape(-1).to(torch.float64), torch.tensor([0.0 if ok else 1.0])])
        dist.all_reduce(flat, group=self.group)
        if flat[-1] > 0:
            return False
        with torch.no_grad():
            tensor.copy_(flat[:-1].view_as(tensor).to(tensor.dtype))
        return True

    def all(self, ok: bool) -> bool:
        """True when every worker of the group says True."""
        return self.sum(torch.zeros(0, dtype=torch.float64), ok)
