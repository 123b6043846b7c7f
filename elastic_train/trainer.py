"""The training loop: one epoch of DDP training, an exact evaluation, early stop, the summary.

Readable top to bottom: ``fit`` runs epochs; ``train_epoch`` runs steps; ``evaluate`` runs the
validation shard. Every collective (metric reductions, the early-stop broadcast) is issued by
all ranks in the same order; nothing a single rank decides alone can gate one.

Everything the runtime provides, the trainer takes from the library's public pieces
(``elastic_train.__all__``): a ``Task`` says what to train, the ``GlobalBatchSampler`` what each
rank reads, ``StepBoundary`` what happens between steps, ``capture``/``restore`` what a
checkpoint holds, ``StepWatchdog``, ``FaultInjector`` and ``ProgressTracker`` the rest. What it
keeps private is the seed's presentation and policy (console lines, progress bar, early stop,
the --amp choice): tests/unit/test_trainer_surface.py holds that line. A custom loop can do
everything it does (examples/char_lm.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from elastic_train.boundary import Decision, FinalCheckpointFailed, StepBoundary
from elastic_train.checkpoint.manager import Loaded
from elastic_train.checkpoint.snapshot import Position, Snapshot, capture, restore
from elastic_train.config import TrainConfig
from elastic_train.data import make_loaders
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import Placement, all_reduce_max, all_reduce_sum
from elastic_train.early_stop import EarlyStopper, decide_stop
from elastic_train.errors import UsageError
from elastic_train.faults import FaultInjector
from elastic_train.logs import Console, MetricsFile, file_only
from elastic_train.metrics import EpochRecord, MetricSums, Totals
from elastic_train.precision import Precision, choose_precision
from elastic_train.progress import ProgressBar
from elastic_train.resilience.goodput import ProgressTracker
from elastic_train.resilience.preemption import Preempted
from elastic_train.resilience.watchdog import StepWatchdog
from elastic_train.step_log import StepLog
from elastic_train.task import ExtraState, Task, TaskData

log = structlog.get_logger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.base_lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=cfg.base_lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay
    )


def build_schedule(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``--warmup-steps``, then cosine decay to zero at the last step.

    Defined on global optimizer steps, which do not depend on the world size.
    """
    warmup = min(cfg.warmup_steps, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume_on_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer) -> None:
    """After a restore: the learning rate of the built-in schedule at the restored step.

    The schedule is a function of (step, --epochs). A resume with another --epochs (an extended
    run) goes on on the new curve from this step, while the restored optimizer holds the old
    curve's rate; with the same --epochs this is the very value the old run set (LambdaLR's own
    step computes it the same way), so an exact resume stays bitwise."""
    for group, fn, base in zip(optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)


@dataclass
class TrainState:
    """Where the run is. Plain values, so a checkpoint can store it as JSON."""

    epoch: int = 0  # epochs completed
    step: int = 0  # global optimizer steps completed, counted across epochs
    batch_in_epoch: int = 0  # global batches of the current epoch already trained on
    history: list[EpochRecord] = field(default_factory=list)


@dataclass(frozen=True)
class TrainerCheckpoint:
    """The trainer's own JSON state in a checkpoint (``Payload.app``)."""

    early_stop: dict[str, Any]
    history: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"early_stop": self.early_stop, "history": self.history}

    @classmethod
    def from_json(cls, app: Mapping[str, Any]) -> TrainerCheckpoint:
        try:
            return cls(early_stop=dict(app["early_stop"]), history=list(app["history"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"checkpoint has no trainer state ({exc!r}): written by a custom loop?") from None


def restore_extra(extra: ExtraState | None, saved: dict[str, torch.Tensor], task: Task, folder: object) -> None:
    """Put a checkpoint's extra state back into the task's (refused when the task keeps some and
    the checkpoint has none: it was written by another task)."""
    if extra is not None and not saved:
        raise UsageError(
            f"checkpoint {folder} has no extra state, but task {task.name} keeps some",
            "resume with the task that wrote it, or start fresh with another --checkpoint-dir",
        )
    if extra is not None:
        extra.load_state_dict(saved)
    elif saved:
        log.warning("extra_state_dropped", tensors=len(saved), detail="the task keeps no extra state")


# Per-rank checkpoint tensors of a partly trained epoch.
TRAIN_SUMS, TRAIN_DIGEST, ELAPSED = "metrics.train_sums", "metrics.train_digest", "metrics.elapsed"


@dataclass(frozen=True)
class Summary:
    total_time: float
    throughput: float
    gpus: int
    processes: int
    epochs_run: int
    stopped_early: bool
    final_val_acc: float
    productive_time: float = 0.0  # training time of every epoch of the run, each step once
    samples_are: str = "images"

    @classmethod
    def of(
        cls,
        history: list[dict[str, Any]],
        wall: float,
        processes: int,
        is_cuda: bool,
        stopped_early: bool,
        samples_are: str,
    ) -> Summary:
        """From the run's epoch records (``EpochRecord.to_json``), in either mode: throughput is
        the samples of every epoch over their training time, each step counted once."""
        train_time = sum(float(r["epoch_time"]) for r in history)
        samples = sum(int(r["samples_seen"]) for r in history)
        return cls(
            total_time=wall,
            throughput=samples / train_time if train_time > 0 else 0.0,
            gpus=processes if is_cuda else 0,
            processes=processes,
            epochs_run=len(history),
            stopped_early=stopped_early,
            final_val_acc=float(history[-1]["val_acc"]) if history else math.nan,
            productive_time=train_time,
            samples_are=samples_are,
        )

    def console_lines(self) -> list[str]:
        return [
            "Training Summary:",
            f"Total training time: {self.total_time:.3f} seconds",
            f"Throughput: {self.throughput:.3f} {self.samples_are}/second",
            f"Total GPUs used: {self.gpus}",
            f"Total processes used: {self.processes}",
        ]


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        placement: Placement,
        task: Task,
        data: TaskData,
        faults: FaultInjector | None = None,
        boundary: StepBoundary | None = None,
        watchdog: StepWatchdog | None = None,
        tracker: ProgressTracker | None = None,
        init: Callable[[nn.Module], None] | None = None,
    ) -> None:
        """``init``: applied to the freshly built model, before DDP and extra state (``--init-from``)."""
        self.cfg, self.env, self.placement, self.task, self.data = cfg, env, placement, task, data
        self.boundary = boundary
        self.checkpointer = boundary.checkpointer if boundary is not None else None
        self.watchdog = watchdog
        self.tracker = tracker
        self.device = placement.device
        self.console = Console(env)
        self.metrics_file = MetricsFile(cfg.log_dir, env)
        self.step_log = StepLog(cfg.log_dir, cfg.log_every, env.is_main, cfg.batch_size)
        self.faults = faults if faults is not None else FaultInjector([], env.rank, cfg.checkpoint_dir / ".faults")
        self.progress = ProgressBar.for_terminal(env.is_main)
        self.train_loader, self.sampler, self.val_loader = make_loaders(data, cfg, env, placement.is_cuda)

        # Same initial weights on every rank and for every world size; DDP also broadcasts
        # rank 0's. Then the seed's `seed + rank` for everything random during training.
        seed_everything(cfg.seed)
        module = task.model(data).to(self.device)
        if init is not None:
            init(module)  # every rank the same weights, before DDP's broadcast and the extra state
        self.module = module
        self.precision: Precision = choose_precision(cfg.amp, self.device, cfg.amp_dtype)
        self.model: nn.Module
        if cfg.parallel == "fsdp":
            from elastic_train.distributed.fsdp import mesh_for, shard_model  # DTensor: only when used

            blocks = task.fsdp_blocks(module) if task.fsdp_blocks is not None else None
            # In place: ``module`` is the sharded root, called directly (no wrapper).
            self.model = shard_model(module, mesh_for(self.device, env.world_size), blocks, self.precision.dtype)
            self.precision = dataclasses.replace(self.precision, by_policy=True)
        else:
            self.model = DistributedDataParallel(
                module,
                device_ids=[self.device.index] if placement.is_cuda else None,
                gradient_as_bucket_view=True,
                find_unused_parameters=task.find_unused_parameters,
            )
        # After DDP's broadcast of rank 0's weights: extra state derived from them (an EMA copy)
        # starts equal on every rank.
        self.extra: ExtraState | None = task.extra_state(module) if task.extra_state is not None else None
        seed_everything(cfg.seed + env.rank)
        self.optimizer = task.optimizer(module) if task.optimizer is not None else build_optimizer(cfg, module)
        if self.checkpointer is not None:  # the optimizer step and any load wait for a save's copies
            self.checkpointer.guard(module, self.optimizer)
        self.total_steps = cfg.epochs * self.sampler.batches_per_epoch
        self.scheduler = (
            task.make_scheduler(self.optimizer, self.total_steps)
            if task.scheduler is not None
            else build_schedule(cfg, self.optimizer, self.total_steps)
        )
        self.stopper = EarlyStopper(
            task.early_stop_target(cfg.target_accuracy), cfg.patience, monitor=task.monitor, mode=task.mode
        )
        self.state = TrainState()
        # A partly trained epoch restored from a checkpoint: its metric sums and time so far.
        self._resumed_sums: MetricSums | None = None
        self._stepped = False
        self._resumed_elapsed = 0.0

    # ------------------------------------------------------------------ one step
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's share of a global batch; DDP averages the gradients.

        Shares may differ by one sample (64 over 3 ranks: 22, 21, 21), so the mean loss is
        weighted by the share's size before DDP's average: the update is the global batch's mean
        at any world size. The returned loss is the unweighted mean, for the metric sums.
        """
        scaler = self.precision.scaler
        weight = self.sampler.loss_weight(y.shape[0])
        micro = self.cfg.micro_batch_size
        if micro and y.shape[0] > micro:
            outputs, loss = self._accumulate(x, y, micro, weight)
        else:
            outputs, loss = self._forward(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss * weight).backward()  # type: ignore[no-untyped-call]
        if self.checkpointer is not None:
            self.checkpointer.wait_staged()  # an async save may still be copying the weights
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        if self.extra is not None:
            self.extra.after_step(self.state.step + 1)
        return outputs.detach(), loss.detach()

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> tuple[Totals, float]:
        """Train one epoch (from ``state.batch_in_epoch`` on); returns global sums and MAX time."""
        self.model.train()  # type: ignore[no-untyped-call]
        self.sampler.set_epoch(epoch, self.state.batch_in_epoch)
        sums, prior = self._resumed_sums or MetricSums(self.device), self._resumed_elapsed
        self._resumed_sums, self._resumed_elapsed = None, 0.0
        self.progress.start(
            f"Epoch {epoch + 1}/{self.cfg.epochs}", self.sampler.batches_per_epoch, done=self.state.batch_in_epoch
        )
        start = time.perf_counter()
        for *batch, indices in self.train_loader:
            self.faults.at_step(self.state.step + 1)
            x, y = self.task.to_device(batch, self.device)
            outputs, loss = self.train_step(x, y)
            sums.add_batch(self.task.correct(outputs, y), y.shape[0], loss)
            sums.add_indices(indices)
            self.state.step += 1
            self.state.batch_in_epoch += 1
            if not self._stepped:
                self._stepped = True  # recovery timing: the first step of this process and group size
                log.info("first_step", step=self.state.step, world_size=self.env.world_size)
            self.progress.update(self.state.batch_in_epoch)
            if self.step_log.due(self.state.step):  # only then: float(loss) waits for the device
                lr = float(self.optimizer.param_groups[0]["lr"])
                self.step_log.step(self.state.step, epoch + 1, float(loss), lr, self.env.world_size)
            if self.watchdog is not None:
                self.watchdog.beat(self.state.step)
            if self.tracker is not None:
                self.tracker.on_step(self.state.step)
            self._after_step(sums, prior + time.perf_counter() - start)
        if self.placement.is_cuda:
            torch.cuda.synchronize(self.device)
        elapsed = prior + time.perf_counter() - start
        self.progress.close()
        return sums.reduce(), all_reduce_max(elapsed, self.device)

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.precision.autocast():
            try:
                outputs = self.model(x)
            except RuntimeError as exc:  # DDP finds an unused parameter at the next forward
                usage = self.task.usage_error(exc)
                if usage is not None:
                    raise usage from None
                raise
            return outputs, self.task.loss(outputs, y)

    def _accumulate(
        self, x: torch.Tensor, y: torch.Tensor, micro: int, weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The share in micro-batches of at most ``micro`` samples: each one's mean loss weighted
        by its size, so the accumulated gradient is the whole share's (up to float summation
        order); DDP averages across ranks only on the last (``no_sync`` before). Returns the
        share's outputs and mean loss, as one pass would."""
        self.optimizer.zero_grad(set_to_none=True)
        n = y.shape[0]
        parts = list(zip(torch.split(x, micro), torch.split(y, micro), strict=True))
        outputs, loss_sum = [], torch.zeros((), device=self.device)
        for i, (xs, ys) in enumerate(parts):
            sync = contextlib.nullcontext() if i == len(parts) - 1 else self._no_sync()
            with sync:
                out, loss = self._forward(xs, ys)
                scale = weight * ys.shape[0] / n
                self.precision.scaler.scale(loss * scale).backward()  # type: ignore[no-untyped-call]
            outputs.append(out.detach())
            loss_sum += loss.detach().float() * ys.shape[0]
        return torch.cat(outputs), loss_sum / n

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """Accumulate this micro-batch's gradients locally: DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)`` (the last micro-batch reduces the sum)."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
            return
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def _after_step(self, sums: MetricSums, elapsed: float) -> None:
        """The step boundary (``boundary.StepBoundary``): stop, commit and save decisions."""
        if self.boundary is None:
            return
        epoch_end = self.state.batch_in_epoch >= self.sampler.batches_per_epoch
        decision = self.boundary.after_step(self.state.step, lambda: self.snapshot(sums, elapsed), epoch_end=epoch_end)
        self._obey(decision)

    def _obey(self, decision: Decision) -> None:
        if decision.stop:
            raise Preempted(self.state.step, decision.stop_committed, decision.stop)

    # ------------------------------------------------------------------ checkpoint state
    def snapshot(self, sums: MetricSums | None = None, elapsed: float = 0.0, finished: bool = False) -> Snapshot:
        """Everything needed to continue exactly from this step boundary."""
        sums = sums or MetricSums(self.device)
        app = TrainerCheckpoint(self.stopper.state(), [r.to_json() for r in self.state.history])
        return capture(
            Position(self.state.step, self.state.epoch, self.state.batch_in_epoch, finished),
            self.module,
            self.optimizer,
            device=self.device,
            scheduler=self.scheduler,
            scaler=self.precision.scaler,
            extra=self.extra.state_dict() if self.extra is not None else None,
            per_rank={
                TRAIN_SUMS: sums.sums,
                TRAIN_DIGEST: sums.digest,
                ELAPSED: torch.tensor([elapsed], dtype=torch.float64),
            },
            app=app.to_json(),
            accounting=self.tracker.accounting.to_json() if self.tracker is not None else None,
            config=self.cfg.to_json(),
        )

    def finished_because(self) -> str:
        """Why training from the restored state is already over under this run's flags, or ""
        when it trains on (a finished run given more --epochs, a higher target or patience)."""
        if self.state.epoch >= self.cfg.epochs:
            return f"all {self.state.epoch} epoch(s) of --epochs {self.cfg.epochs} are done"
        if self.state.history:
            return self.stopper.stops_at(self.task.monitored(self.state.history[-1]))
        return ""

    def restore(self, loaded: Loaded) -> None:
        """Continue from ``loaded``: same world size exactly; another size from the same global batch."""
        done = restore(
            loaded,
            self.module,
            self.optimizer,
            rank=self.env.rank,
            world_size=self.env.world_size,
            device=self.device,
            scheduler=self.scheduler,
            scaler=self.precision.scaler,
            extra_like=self.extra.state_dict() if self.extra is not None else None,
        )
        restore_extra(self.extra, done.extra, self.task, loaded.folder)
        if self.task.scheduler is None:
            resume_on_schedule(self.scheduler, self.optimizer)
        app = TrainerCheckpoint.from_json(done.payload.app)
        self.stopper.resume(app.early_stop)
        pos = done.position
        self.state = TrainState(pos.epoch, pos.step, pos.batch_in_epoch, [EpochRecord(**r) for r in app.history])
        sums = MetricSums(self.device)
        if done.same_world_size:
            mine = done.old_ranks[self.env.rank]
            sums.sums.copy_(mine[TRAIN_SUMS])
            sums.digest.copy_(mine[TRAIN_DIGEST])
            self._resumed_elapsed = float(mine[ELAPSED])
        else:
            # Per-rank streams cannot be split or merged: reseed, and let rank 0 carry the
            # partial epoch's sums (they are all-reduced at the epoch end anyway).
            seed_everything(self.cfg.seed + self.env.rank + 7919 * pos.step)
            if self.env.is_main:
                for part in done.old_ranks:
                    sums.sums += part[TRAIN_SUMS].to(self.device)
                    sums.add_digest(part[TRAIN_DIGEST])
            self._resumed_elapsed = max(float(part[ELAPSED]) for part in done.old_ranks)
        self._resumed_sums = sums

    @torch.no_grad()
    def evaluate(self) -> tuple[Totals, dict[str, float]]:
        """Exact validation: each sample once (disjoint shards, no padding), SUM-reduced. Also
        the task's extra metrics, each a SUM over validation samples divided by their count."""
        # Eval runs the bare module (shards may differ in length: no DDP collectives here);
        # rank 0's buffers (e.g. BatchNorm statistics) are made everyone's first.
        if self.checkpointer is not None:
            self.checkpointer.wait_staged()
        for buffer in self.module.buffers():
            torch.distributed.broadcast(buffer, src=0)
        self.module.eval()
        sums = MetricSums(self.device)
        names = sorted(self.task.metrics)
        extra = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        # Under FSDP every forward gathers parameters (a collective): each rank runs as many
        # forwards as the longest shard, the missing ones on a batch whose results are dropped.
        fills = self._fill_forwards() if self.cfg.parallel == "fsdp" else 0
        x = None
        for *batch, indices in self.val_loader:
            if self.watchdog is not None:
                self.watchdog.beat(self.state.step, "evaluate")
            x, y = self.task.to_device(batch, self.device)
            with self.precision.autocast():
                outputs = self.module(x)
                loss = self.task.loss(outputs, y)
            outputs = outputs.float()
            sums.add_batch(self.task.correct(outputs, y), y.shape[0], loss.float())
            sums.add_indices(indices)
            for i, name in enumerate(names):
                extra[i] += self.task.metrics[name](outputs, y).detach().to(torch.float64)
        for _ in range(fills):
            if x is None:  # this rank's shard is empty: any input of the right form
                x, _y = self.task.to_device(default_collate([self.data.val[0]]), self.device)
            with self.precision.autocast():
                self.module(x)
        if self.cfg.parallel == "fsdp":
            from elastic_train.distributed.fsdp import reshard_all

            reshard_all(self.module)
        totals = sums.reduce()
        if not names:
            return totals, {}
        reduced = all_reduce_sum(extra).cpu().tolist()
        per_sample = [value / totals.samples if totals.samples else float("nan") for value in reduced]
        return totals, dict(zip(names, per_sample, strict=True))

    def _fill_forwards(self) -> int:
        """How many forwards this rank runs beyond its validation shard (see ``evaluate``)."""
        mine = len(self.val_loader)
        return int(all_reduce_max(float(mine), self.device)) - mine

    def _record(self, epoch: int, train: Totals, val: Totals, elapsed: float, extra: dict[str, float]) -> EpochRecord:
        return EpochRecord.of(epoch, self.env.world_size, train, val, elapsed, self.state.step, extra)

    def announce(self) -> None:
        cfg, env = self.cfg, self.env
        params = sum(p.numel() for p in self.module.parameters())
        self.console.line(f"Training started with {env.world_size} processes")
        model = self.task.name if cfg.task is None else f"{self.task.name} ({cfg.task})"
        self.console.line(
            f"Backend: {self.placement.backend}, device: {self.device.type}, model: {model} "
            f"({params / 1e6:.2f}M params), dataset: {self.data.describe()}, "
            f"global batch: {cfg.batch_size}, per-process batch: {self.sampler.per_process_batch}, "
            f"precision: {self.precision.name}"
            + (f", parallel: FSDP2 over {env.world_size} processes" if cfg.parallel == "fsdp" else "")
        )
        log.info("run_config", **file_only(config=cfg.to_json(), params=params))

    def fit(self) -> Summary:
        self.announce()
        wall_start = time.perf_counter()
        stopped_early = False
        while self.state.epoch < self.cfg.epochs and not stopped_early:
            epoch = self.state.epoch
            train, elapsed = self.train_epoch(epoch)
            val, extra = self.evaluate()
            record = self._record(epoch, train, val, elapsed, extra)
            self.state.history.append(record)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0
            self.console.line(record.console_line(self.cfg.epochs, self.task.rate_unit, self.task.accuracy))
            self.metrics_file.append(record.to_json())
            log.info("epoch_end", **file_only(**record.to_json()))
            stopped_early = decide_stop(self.stopper, self.task.monitored(record), self.env.is_main, self.device)
            if stopped_early:
                self.console.line(f"Early stopping at epoch {record.epoch}: {self.stopper.reason}")
            if self.boundary is not None:
                finished = stopped_early or self.state.epoch >= self.cfg.epochs
                decision = self.boundary.epoch_end(partial(self.snapshot, finished=finished), finished=finished)
                self._obey(decision)
                if finished and not decision.committed:
                    raise FinalCheckpointFailed(self.state.step)
        return self._summary(time.perf_counter() - wall_start, stopped_early)

    def _summary(self, wall: float, stopped_early: bool) -> Summary:
        history = [r.to_json() for r in self.state.history]
        return Summary.of(
            history, wall, self.env.world_size, self.placement.is_cuda, stopped_early, self.task.samples_are
        )

    def close(self) -> None:
        """Release loader workers and the curve's writer. The process group is the caller's."""
        self.step_log.close()
        for loader in (self.train_loader, self.val_loader):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
