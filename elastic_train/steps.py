"""The fault-tolerance modes for a loop of your own: one loop, either mode.

The built-in trainer chooses its mode through a ``StepStrategy`` (``strategy.py``); a custom loop
gets the same choice through the smaller interface here, the shape of torchft's Manager as a
plain loop uses it. Every step of the loop is::

    attempt = steps.begin_step()            # who takes part, this member's share of batch s
    ...forward and backward on attempt.share.indices, loss weighted by attempt.share.weight...
    steps.average_gradients(params, extras)  # the data-parallel average (+ exact sums)
    if steps.commit(apply):                  # apply: optimizer, scheduler, sums
        ...the step is part of the run: save, log...

``RestartSteps`` (``--ft restart``): the group is fixed for an attempt of the job; the module's
wrapper (``wrap``: DDP) averages the gradients inside backward; every step commits. A failure
ends the attempt and torchrun restarts the group, which resumes from the loop's checkpoint
(``resume_at``). ``QuorumSteps`` (``--ft quorum``): each member is a replica in a quorum formed
every step (``quorum.replica.Replica``); a failed attempt is not committed and is trained again
by the survivors; a restarted member heals from a live peer's state (``register_state``).

In both, step ``s`` trains global batch ``s`` of the run (``QuorumSchedule``, the sampler's
plan), cut over the step's members: every sample once per epoch, the global batch constant,
whatever the membership. ``examples/char_lm.py --ft restart|quorum`` is one loop run both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Protocol, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_train.distributed.ddp import replicate
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.shard_state import load_module_shards, load_optimizer_shards, local_shard, local_state
from elastic_train.errors import UsageError
from elastic_train.quorum.replica import Replica, StepAttempt
from elastic_train.quorum.schedule import QuorumSchedule

T = TypeVar("T")


class LoopSteps(Protocol):
    """What a custom loop asks of a fault-tolerance mode (module docstring)."""

    schedule: QuorumSchedule

    @property
    def committed_steps(self) -> int:
        """Steps committed so far: the index of the next global batch."""
        ...

    def wrap(self, module: nn.Module) -> nn.Module: ...
    def register_state(self, name: str, load: Callable[[T], None], state: Callable[[], T]) -> None: ...
    def register_model(self, name: str, module: nn.Module) -> None: ...
    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None: ...
    def begin_step(self) -> StepAttempt: ...
    def average_gradients(self, parameters: Iterable[nn.Parameter], extras: Sequence[torch.Tensor] = ()) -> bool: ...
    def commit(self, apply: Callable[[], None]) -> bool: ...


class RestartSteps:
    """``--ft restart`` for a custom loop: ``env.world_size`` processes, rank ``env.rank`` of
    them, every step commits. Call ``resume_at`` with the restored checkpoint's step."""

    def __init__(self, schedule: QuorumSchedule, env: DistEnv, device: torch.device) -> None:
        self.schedule, self.env, self.device = schedule, env, device
        self._step = 0

    @property
    def committed_steps(self) -> int:
        return self._step

    def resume_at(self, step: int) -> None:
        """Continue after ``step`` committed steps (a restored checkpoint's ``Position.step``)."""
        if step < 0:
            raise ValueError(f"a run resumes at a step >= 0, not {step}")
        self._step = step

    def wrap(self, module: nn.Module) -> nn.Module:
        """DDP: rank 0's weights broadcast; from three ranks on with its buckets fixed, so that a
        resume is bitwise (``elastic_train.distributed.ddp``)."""
        return replicate(module, [self.device.index] if self.device.type == "cuda" else None)

    def register_state(self, name: str, load: Callable[[T], None], state: Callable[[], T]) -> None:
        """Nothing to register: restart mode's state after a failure is the checkpoint's."""
        del name, load, state

    def register_model(self, name: str, module: nn.Module) -> None:
        del name, module  # as register_state

    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        del name, optimizer  # as register_state

    def begin_step(self) -> StepAttempt:
        world, rank = self.env.world_size, self.env.rank
        share = self.schedule.share(self._step, world, rank)
        return StepAttempt(self._step, world, rank, share, heal=None, quorum_seconds=0.0)

    def average_gradients(self, parameters: Iterable[nn.Parameter], extras: Sequence[torch.Tensor] = ()) -> bool:
        """The wrapper averaged the gradients in backward; ``extras`` are averaged here, in one
        all-reduce (as ``QuorumSteps`` averages them with the gradients)."""
        del parameters
        if extras:
            _average_in_group(extras, self.env.world_size)
        return True

    def commit(self, apply: Callable[[], None]) -> bool:
        apply()
        self._step += 1
        return True


class QuorumSteps:
    """``--ft quorum`` for a custom loop: this process is one worker of a replica group in a
    quorum formed every step by torchft's Lighthouse (``Replica``); ``register_state`` what a
    healing peer fetches (model, optimizer, scheduler, running sums).

    A group of K workers (one ``torchrun --nproc-per-node=K`` agent per group; the caller has
    initialised the group's process group) trains DDP (``parallel="ddp"``) or FSDP2
    (``parallel="fsdp"``: torchft's fault-tolerant HSDP shape, the shard dimension inside the
    group, the replicate dimension managed by the quorum) inside the group; the quorum averages
    across groups, each worker with the worker of the same group rank in every other group, and
    a restarted group heals worker by worker from a live group: under FSDP2 each worker fetches
    only its own shard (``register_model`` / ``register_optimizer``), and nothing is gathered.
    The step's members are the quorum's groups times K, so each trains ``1 / (groups x K)`` of the
    global batch."""

    def __init__(self, replica: Replica, schedule: QuorumSchedule, parallel: str = "ddp") -> None:
        if parallel not in ("ddp", "fsdp"):
            raise ValueError(f"parallel={parallel!r}: choose 'ddp' or 'fsdp'")
        self.replica, self.schedule, self.parallel = replica, schedule, parallel
        self.group_size = replica.group.world_size
        if self.group_size > schedule.global_batch:
            raise UsageError(
                f"a replica group of {self.group_size} workers cannot share a global batch of "
                f"{schedule.global_batch}: each worker needs a sample",
                f"use a global batch of {self.group_size} or more, or fewer workers per group",
            )
        if (self.group_size > 1 or parallel == "fsdp") and not torch.distributed.is_initialized():
            raise RuntimeError(
                f"a replica group of {self.group_size} workers trains {parallel.upper()} inside the group: call "
                "torch.distributed.init_process_group() (torchrun's group) before QuorumSteps"
            )

    @property
    def committed_steps(self) -> int:
        return self.replica.committed_steps

    def wrap(self, module: nn.Module) -> nn.Module:
        """FSDP2: ``module`` sharded in place over the group (per repeated block, then the root).
        DDP: the bare module for one worker per group (the average is one collective after
        backward over whichever replicas the step's quorum holds), DDP inside a larger group."""
        if self.parallel == "fsdp":
            from elastic_train.distributed.fsdp import mesh_for, shard_model

            device = next(module.parameters()).device
            return shard_model(module, mesh_for(device, self.group_size))
        if self.group_size == 1:
            return module
        # Plain DDP: quorum mode is equal up to summation order, so its own buckets (which overlap
        # the backward) stay.
        return DistributedDataParallel(module, device_ids=[torch.cuda.current_device()] if _on_cuda(module) else None)

    def register_state(self, name: str, load: Callable[[T], None], state: Callable[[], T]) -> None:
        self.replica.register_state(name, load, state)

    def register_model(self, name: str, module: nn.Module) -> None:
        """The module's parameters and buffers, as this worker holds them: a sharded parameter
        as its local shard, which the healing worker of the same group rank copies into its own."""
        self.replica.register_state(name, partial(load_module_shards, module), lambda: local_state(module.state_dict()))

    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state (moments, step counts) as this worker holds it: the moments of
        a sharded parameter as their local shard, made sharded again on load."""
        self.replica.register_state(
            name, partial(load_optimizer_shards, optimizer), lambda: local_state(optimizer.state_dict())
        )

    def begin_step(self) -> StepAttempt:
        return self.replica.begin_step(self.schedule)

    def average_gradients(self, parameters: Iterable[nn.Parameter], extras: Sequence[torch.Tensor] = ()) -> bool:
        """Across the quorum's groups (inside a group DDP averaged the gradients in backward; the
        extras are averaged over the group here first). False: a peer group failed mid-step;
        ``commit`` then votes the attempt down."""
        if self.group_size > 1 and extras:
            _average_in_group(extras, self.group_size)
        if self.parallel == "ddp":
            return self.replica.average_gradients(parameters, extras)
        # FSDP2 reduce-scattered each gradient over the group; the quorum averages each worker's
        # shard with the same shard of every other group (zeros for an unused parameter).
        shards = []
        for p in parameters:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                shards.append(local_shard(p.grad))
        return self.replica.average([*shards, *extras])

    def commit(self, apply: Callable[[], None]) -> bool:
        return self.replica.commit(apply)


def _average_in_group(tensors: Sequence[torch.Tensor], size: int) -> None:
    """Average ``tensors`` in place over the default process group of ``size`` ranks, in one
    float64 all-reduce (exact sums of counts and losses)."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    torch.distributed.all_reduce(flat)
    flat /= size
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _on_cuda(module: nn.Module) -> bool:
    return any(p.is_cuda for p in module.parameters())
