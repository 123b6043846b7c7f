"""What differs between the fault-tolerance modes, as one interface the training loop calls.

The loop (``trainer.Trainer.fit``) is the same in every mode: it asks the strategy for this
step's ``Attempt`` (who takes part, which share of the global batch this member trains), runs
forward and backward on the share, asks the strategy to combine the step (average gradients,
sum the exact metric sums) and to commit it, and applies a committed step. The epoch's
evaluation is a round of its own, run the same way. The strategy answers:

* who takes part in a step and which share each member trains (``begin_step``);
* how gradients are averaged and the step's sums combined (``reduce_step``, ``reduce_eval``);
* whether the step commits (``commit``), and what a discarded attempt costs (``discarded``);
* where a joining member's state comes from (a checkpoint in restart mode; a live peer in
  quorum mode, fetched inside ``begin_step``);
* how the decisions between steps are agreed (``boundary``: saves and stops).

``RestartStrategy`` is the trivial one (``--ft restart``): the group is fixed for an attempt of
the whole job (torchrun restarts it on a failure), DDP or FSDP2 averages the gradients inside
backward, and every step commits. Quorum mode's strategy (``quorum.strategy.QuorumStrategy``)
wraps torchft's Manager (``quorum.replica.Replica``) in the same shape, as torchft's
Manager + OptimizerWrapper wrap a plain loop: quorum at ``begin_step``, the gradient average in
``reduce_step``, the vote in ``commit``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_train.boundary import Decision, StepBoundary
from elastic_train.data import make_loaders
from elastic_train.distributed.ddp import replicate
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import Placement, all_reduce_max, all_reduce_sum
from elastic_train.early_stop import decide_stop
from elastic_train.metrics import EpochRecord, MetricSums, Totals
from elastic_train.progress import ProgressBar
from elastic_train.resilience.goodput import Accounting, ProgressTracker

if TYPE_CHECKING:
    from elastic_train.trainer import Trainer

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Share:
    """The samples one member trains at a step: a collated batch (inputs and targets, as the
    task's ``to_device`` takes them), their dataset indices, and the factor for the share's mean
    loss that makes the members' average the global batch's mean (``data.sampler.loss_weight``)."""

    batch: list[Any]
    indices: torch.Tensor
    weight: float

    @property
    def size(self) -> int:
        return int(self.indices.numel())


@dataclass(frozen=True)
class Attempt:
    """One try at a step: ``world`` members take part, this one as ``rank``. ``share`` None: the
    epoch's evaluation round. ``keep_grads``: the share adds to gradients kept from a failed
    attempt of the same step (quorum mode's salvage), so the loop does not zero them first."""

    world: int
    rank: int
    share: Share | None
    keep_grads: bool = False

    @property
    def is_first(self) -> bool:
        """This member speaks for the step (console, curve), as rank 0 does in the seed."""
        return self.rank == 0


class StepStrategy(Protocol):
    """What the loop asks of a fault-tolerance mode (module docstring). Every method is called
    by every member in the same order; ``bind`` first, once the loop has built its model."""

    processes: int  # processes (or replica groups) the run reports in its summary

    def wrap(self, module: nn.Module, loop: Trainer) -> nn.Module: ...
    def bind(self, loop: Trainer) -> None: ...
    def start(self) -> None: ...
    def begin_step(self) -> Attempt | None: ...
    def val_batches(self, attempt: Attempt) -> Iterable[list[Any]]: ...
    def reduce_step(self, attempt: Attempt, sums: MetricSums) -> MetricSums | None: ...
    def reduce_eval(
        self, attempt: Attempt, sums: MetricSums, extra: torch.Tensor
    ) -> tuple[Totals, torch.Tensor] | None: ...
    def commit(self, apply: Callable[[], None]) -> bool: ...
    def on_apply(self) -> None: ...
    def discarded(self, attempt: Attempt, evaluating: bool, began: float) -> None: ...
    def committed(self, attempt: Attempt) -> None: ...
    def epoch_totals(self, sums: MetricSums) -> Totals: ...
    def epoch_time(self, elapsed: float) -> float: ...
    def publish(self, record: EpochRecord) -> bool: ...
    def decide_stop(self, value: float) -> bool: ...
    def boundary(self, attempt: Attempt, evaluated: bool) -> Decision: ...
    def accounting(self) -> Accounting | None: ...
    def close(self) -> None: ...


class RestartStrategy:
    """``--ft restart``: a fixed group of ``env.world_size`` processes, each reading its rank's
    share of every global batch through a ``DataLoader`` (``GlobalBatchSampler``); DDP or FSDP2
    averages the gradients in backward; every step commits. Decisions between steps are the
    ``StepBoundary``'s (one agreement per step on the control plane). A failure ends the attempt:
    torchrun restarts the group, which resumes from the last checkpoint."""

    def __init__(
        self,
        env: DistEnv,
        placement: Placement,
        boundary: StepBoundary | None = None,
        tracker: ProgressTracker | None = None,
    ) -> None:
        self.env, self.placement, self.boundary_ = env, placement, boundary
        self.tracker = tracker
        self.processes = env.world_size
        self.progress = ProgressBar.for_terminal(env.is_main)
        self._batches: Iterator[list[Any]] | None = None
        self._stepped = False
        self._fills = 0

    # ------------------------------------------------------------------ the group
    def wrap(self, module: nn.Module, loop: Trainer) -> nn.Module:
        """DDP (rank 0's weights broadcast), or FSDP2 in place (``--parallel fsdp``)."""
        cfg = loop.cfg
        self.train_loader, self.sampler, self.val_loader = make_loaders(
            loop.data, cfg, self.env, self.placement.is_cuda
        )
        if cfg.parallel == "fsdp":
            from elastic_train.distributed.fsdp import mesh_for, shard_model  # DTensor: only when used

            task = loop.task
            blocks = task.fsdp_blocks(module) if task.fsdp_blocks is not None else None
            # In place: ``module`` is the sharded root, called directly (no wrapper).
            return shard_model(module, mesh_for(loop.device, self.env.world_size), blocks, loop.precision.dtype)
        return replicate(
            module,
            [loop.device.index] if self.placement.is_cuda else None,
            gradient_as_bucket_view=True,
            find_unused_parameters=loop.task.find_unused_parameters,
        )

    def bind(self, loop: Trainer) -> None:
        self.loop = loop

    def start(self) -> None:
        self.loop.announce()

    # ------------------------------------------------------------------ one step
    def begin_step(self) -> Attempt:
        loop = self.loop
        if loop.evaluating:
            if self._batches is not None:  # the sampler yielded the epoch's last share: end its iterator
                if next(self._batches, None) is not None:
                    raise RuntimeError("the train loader yielded more batches than the epoch has")
                self._batches = None
            self.progress.close()
            return Attempt(self.env.world_size, self.env.rank, None)
        if self._batches is None:  # the epoch's first step in this process
            loop.model.train()  # type: ignore[no-untyped-call]
            self.sampler.set_epoch(loop.state.epoch, loop.state.batch_in_epoch)
            self._batches = iter(self.train_loader)
            self.progress.start(
                f"Epoch {loop.state.epoch + 1}/{loop.cfg.epochs}",
                self.sampler.batches_per_epoch,
                done=loop.state.batch_in_epoch,
            )
        *batch, indices = next(self._batches)
        share = Share(batch, indices, self.sampler.loss_weight(int(indices.numel())))
        return Attempt(self.env.world_size, self.env.rank, share)

    def reduce_step(self, attempt: Attempt, sums: MetricSums) -> MetricSums:
        """DDP / FSDP2 averaged the gradients in backward; the sums stay this rank's until the
        epoch ends (one all-reduce an epoch)."""
        return sums

    def commit(self, apply: Callable[[], None]) -> bool:
        apply()
        return True

    def on_apply(self) -> None:
        pass

    def discarded(self, attempt: Attempt, evaluating: bool, began: float) -> None:
        raise AssertionError("restart mode never discards a step")  # commit is always True

    def committed(self, attempt: Attempt) -> None:
        loop = self.loop
        if attempt.share is None:
            return
        if not self._stepped:
            self._stepped = True  # recovery timing: the first step of this process and group size
            log.info("first_step", step=loop.state.step, world_size=self.env.world_size)
        self.progress.update(loop.state.batch_in_epoch)
        if self.tracker is not None:
            self.tracker.on_step(loop.state.step)

    # ------------------------------------------------------------------ evaluation
    def val_batches(self, attempt: Attempt) -> Iterable[list[Any]]:
        """This rank's validation shard (disjoint shards, no padding). Eval runs the bare module
        (shards may differ in length: no DDP collectives there); rank 0's buffers (BatchNorm
        statistics) are made everyone's first, as DDP does before each forward."""
        loop = self.loop
        for buffer in loop.module.buffers():
            torch.distributed.broadcast(buffer, src=0)
        if loop.cfg.parallel == "fsdp":
            # Every FSDP forward gathers parameters (a collective), so each rank runs as many
            # forwards as the longest shard. The count is agreed before the first forward: a
            # rank that agreed after its own shard would meet its peers' gathers with an
            # all-reduce (a mismatched collective: a hang on NCCL, a crash on gloo).
            mine = len(self.val_loader)
            self._fills = int(all_reduce_max(float(mine), loop.device)) - mine
        return self.val_loader

    def reduce_eval(self, attempt: Attempt, sums: MetricSums, extra: torch.Tensor) -> tuple[Totals, torch.Tensor]:
        loop = self.loop
        if loop.cfg.parallel == "fsdp":
            from elastic_train.distributed.fsdp import reshard_all

            # This rank's missing forwards (counted in val_batches), on an input whose results
            # are dropped, so that every rank joins each of its peers' parameter gathers.
            for _ in range(self._fills):
                loop.forward_filler()
            self._fills = 0
            reshard_all(loop.module)
        totals = sums.reduce()
        return totals, all_reduce_sum(extra) if extra.numel() else extra

    # ------------------------------------------------------------------ the epoch
    def epoch_totals(self, sums: MetricSums) -> Totals:
        return sums.reduce()

    def epoch_time(self, elapsed: float) -> float:
        """The MAX over ranks, as the seed reports it."""
        return all_reduce_max(elapsed, self.loop.device)

    def publish(self, record: EpochRecord) -> bool:
        loop = self.loop
        loop.console.line(record.console_line(loop.cfg.epochs, loop.task.rate_unit, loop.task.accuracy))
        loop.metrics_file.append(record.to_json())
        return self.env.is_main

    def decide_stop(self, value: float) -> bool:
        """The seed's rule: rank 0 decides, everyone follows (a broadcast)."""
        return decide_stop(self.loop.stopper, value, self.env.is_main, self.loop.device)

    def boundary(self, attempt: Attempt, evaluated: bool) -> Decision:
        """The ``StepBoundary``: after a step, the stop / commit / save decisions; after the
        evaluation round, the epoch's save (synchronous for the last)."""
        loop, boundary = self.loop, self.boundary_
        if boundary is None:
            return Decision(committed=True)
        if evaluated:
            finished = loop.state.finished
            return boundary.epoch_end(lambda: loop.snapshot(finished=finished), finished=finished)
        epoch_end = loop.evaluating
        return boundary.after_step(loop.state.step, loop.snapshot, epoch_end=epoch_end)

    def accounting(self) -> Accounting | None:
        return self.tracker.accounting if self.tracker is not None else None

    def close(self) -> None:
        """Release the loaders' workers."""
        self._batches = None
        for loader in (getattr(self, "train_loader", None), getattr(self, "val_loader", None)):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate this micro-batch's gradients locally: DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)`` (the last micro-batch reduces the sum); a bare module
    (quorum mode: the strategy averages after backward) needs nothing."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)
