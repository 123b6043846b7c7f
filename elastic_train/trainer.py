"""The training loop, one for both fault-tolerance modes: steps, an exact evaluation, early
stop, the epoch records, checkpoint state and the summary.

Readable top to bottom: ``fit`` runs one step (or the epoch's evaluation round) at a time:
the strategy (``strategy.StepStrategy``) says who takes part and which share of the global
batch this member trains; ``train_share`` runs forward and backward; the strategy combines the
step and commits it; ``apply_step`` applies it; ``end_epoch`` closes an epoch. Restart mode's
strategy (``RestartStrategy``: DDP or FSDP2, every step commits) is the default; quorum mode's
wraps torchft's Manager (``quorum.strategy``). Every collective is issued by all members in the
same order; nothing a single member decides alone can gate one.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn
from torch.utils.data import default_collate

from elastic_train.boundary import FinalCheckpointFailed, StepBoundary
from elastic_train.checkpoint.manager import Checkpointer, Loaded
from elastic_train.checkpoint.snapshot import Position, Restored, Snapshot, capture, restore
from elastic_train.config import TrainConfig
from elastic_train.data.sampler import num_global_batches, per_process_batch
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import Placement
from elastic_train.early_stop import EarlyStopper
from elastic_train.errors import UsageError
from elastic_train.faults import FaultInjector
from elastic_train.logs import Console, MetricsFile, file_only
from elastic_train.metrics import EpochRecord, MetricSums, Totals
from elastic_train.precision import Precision, choose_precision
from elastic_train.resilience.goodput import ProgressTracker
from elastic_train.resilience.preemption import Preempted
from elastic_train.resilience.watchdog import StepWatchdog
from elastic_train.step_log import StepLog
from elastic_train.strategy import Attempt, RestartStrategy, Share, StepStrategy, no_gradient_sync
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
    finished: bool = False  # the last epoch or an early stop is behind


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
    """The one training loop, for both fault-tolerance modes: ``strategy`` says who trains which
    share of each step, how the step is combined and whether it commits (``strategy``); the
    loop owns the model, the optimizer, the step, evaluation, early stop, the epoch records,
    checkpoint state and the summary."""

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
        strategy: StepStrategy | None = None,
        console: Console | None = None,
        metrics_file: MetricsFile | None = None,
        step_log: StepLog | None = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        """``init``: applied to the freshly built model, before DDP and extra state (``--init-from``).
        ``strategy``: restart mode's (``RestartStrategy`` over ``boundary`` and ``tracker``) when
        not given."""
        self.cfg, self.env, self.placement, self.task, self.data = cfg, env, placement, task, data
        self.strategy: StepStrategy = (
            strategy if strategy is not None else RestartStrategy(env, placement, boundary, tracker)
        )
        if checkpointer is None and boundary is not None:
            checkpointer = boundary.checkpointer
        self.checkpointer = checkpointer
        self.watchdog = watchdog
        self.device = placement.device
        self.console = console if console is not None else Console(env)
        self.metrics_file = metrics_file if metrics_file is not None else MetricsFile(cfg.log_dir, env)
        # The per-step curve, written by each step's first member (rank 0, participant 0).
        self.step_log = (
            step_log if step_log is not None else StepLog(cfg.log_dir, cfg.log_every, env.is_main, cfg.batch_size)
        )
        self.faults = faults if faults is not None else FaultInjector([], env.rank, cfg.checkpoint_dir / ".faults")
        self.batches_per_epoch = num_global_batches(len(data.train), cfg.batch_size, cfg.max_steps_per_epoch)  # type: ignore[arg-type]
        self.total_steps = cfg.epochs * self.batches_per_epoch

        # Same initial weights on every rank and for every world size; DDP also broadcasts
        # rank 0's. Then the seed's `seed + rank` for everything random during training.
        seed_everything(cfg.seed)
        module = task.model(data).to(self.device)
        if init is not None:
            init(module)  # every rank the same weights, before DDP's broadcast and the extra state
        self.module = module
        self.precision: Precision = choose_precision(cfg.amp, self.device, cfg.amp_dtype)
        self.model: nn.Module = self.strategy.wrap(module, self)
        if cfg.parallel == "fsdp":  # the mixed-precision policy casts, not autocast
            self.precision = dataclasses.replace(self.precision, by_policy=True)
        # After DDP's broadcast of rank 0's weights: extra state derived from them (an EMA copy)
        # starts equal on every rank.
        self.extra: ExtraState | None = task.extra_state(module) if task.extra_state is not None else None
        seed_everything(cfg.seed + env.rank)
        self.optimizer = task.optimizer(module) if task.optimizer is not None else build_optimizer(cfg, module)
        if self.checkpointer is not None:  # the optimizer step and any load wait for a save's copies
            self.checkpointer.guard(module, self.optimizer)
        self.scheduler = (
            task.make_scheduler(self.optimizer, self.total_steps)
            if task.scheduler is not None
            else build_schedule(cfg, self.optimizer, self.total_steps)
        )
        self.stopper = EarlyStopper(
            task.early_stop_target(cfg.target_accuracy), cfg.patience, monitor=task.monitor, mode=task.mode
        )
        self.state = TrainState()
        # The epoch so far: its exact sums as this member counts them (restart mode: its rank's;
        # quorum mode: the committed steps' global sums) and its training seconds.
        self.sums = MetricSums(self.device)
        self.elapsed = 0.0
        self.stopped_early = False
        self._clock = time.perf_counter()  # the current step's training time starts here
        self.strategy.bind(self)

    # ------------------------------------------------------------------ where the run is
    @property
    def evaluating(self) -> bool:
        """Every batch of the epoch is committed; its evaluation round is next."""
        return self.state.batch_in_epoch >= self.batches_per_epoch

    @property
    def over(self) -> bool:
        return self.state.finished or (self.state.step >= self.total_steps and not self.evaluating)

    def restart_clock(self) -> None:
        """The next committed step's training time starts now (after a heal, a load)."""
        self._clock = time.perf_counter()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Summary:
        """Train until the last epoch or an early stop, one step or evaluation round at a time."""
        wall_start = time.perf_counter()
        self.strategy.start()
        self.restart_clock()
        while self.advance():
            pass
        return self._summary(time.perf_counter() - wall_start)

    def advance(self) -> bool:
        """One training step or evaluation round, committed or discarded by the strategy (or a
        round of the strategy's own: a quorum start or load). False: the run is over. ``fit``
        calls it after ``strategy.start()``; a benchmark may drive it a step at a time."""
        attempt = self.strategy.begin_step()
        if attempt is None:
            return True
        if self.over:
            return False
        evaluating, began = self.evaluating, time.perf_counter()
        if self.watchdog is not None:
            self.watchdog.beat(self.state.step, "evaluate" if evaluating else "train")
        apply: Callable[[], None] | None = None
        step_sums: MetricSums | None = None
        if evaluating:
            reduced = self.evaluate(attempt)
            if reduced is not None:
                apply = partial(self.end_epoch, *reduced, attempt.world)
        else:
            step_sums = self.train_share(attempt)
            if step_sums is not None:
                apply = partial(self.apply_step, step_sums)
        if apply is None or not self.strategy.commit(apply):
            self.strategy.discarded(attempt, evaluating, began)
            return True
        self.strategy.committed(attempt)
        self._after_commit(attempt, step_sums)
        if self.state.finished:
            return False
        if evaluating:
            self.restart_clock()  # the next epoch's time starts after the epoch-end save
        return True

    def train_share(self, attempt: Attempt) -> MetricSums | None:
        """Forward and backward on this member's share, in micro-batches of at most
        ``--micro-batch-size`` samples; then the strategy combines the step. Returns the sums to
        add to the epoch's, or None when the step cannot commit."""
        assert attempt.share is not None
        self.faults.at_step(self.state.step + 1)
        share = attempt.share
        if not attempt.keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        sums = MetricSums(self.device)
        if share.size:
            self._backward(share, sums)
        return self.strategy.reduce_step(attempt, sums)

    def _backward(self, share: Share, sums: MetricSums) -> None:
        """Each micro-batch's mean loss weighted by its size, so the accumulated gradient is the
        whole share's (up to float summation order); the wrapper averages across ranks only on
        the last (``no_gradient_sync`` before). One micro-batch: the share's weight as is."""
        x, y = self.task.to_device(share.batch, self.device)
        n, micro = share.size, self.cfg.micro_batch_size
        if micro and n > micro:
            parts = list(
                zip(torch.split(x, micro), torch.split(y, micro), torch.split(share.indices, micro), strict=True)
            )
        else:
            parts = [(x, y, share.indices)]
        scaler = self.precision.scaler
        for i, (xs, ys, indices) in enumerate(parts):
            sync = contextlib.nullcontext() if i == len(parts) - 1 else no_gradient_sync(self.model)
            with sync:
                outputs, loss = self._forward(xs, ys)
                weight = share.weight if len(parts) == 1 else share.weight * ys.shape[0] / n
                scaler.scale(loss * weight).backward()  # type: ignore[no-untyped-call]
            sums.add_batch(self.task.correct(outputs.detach(), ys), ys.shape[0], loss.detach())
            sums.add_indices(indices)

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

    def apply_step(self, step_sums: MetricSums) -> None:
        """Everything a committed step changes (quorum mode: after the vote)."""
        if self.checkpointer is not None:
            self.checkpointer.wait_staged()  # an async save may still be copying the weights
        scaler = self.precision.scaler
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        self.strategy.on_apply()  # quorum mode: participant 0's module buffers
        if self.extra is not None:
            self.extra.after_step(self.state.step + 1)
        self.sums.sums += step_sums.sums.to(self.device)
        self.sums.add_digest(step_sums.digest)
        self.state.step += 1
        self.state.batch_in_epoch += 1
        if self.evaluating and self.placement.is_cuda:
            torch.cuda.synchronize(self.device)  # the epoch's time includes its last kernels
        now = time.perf_counter()
        self.elapsed += now - self._clock
        self._clock = now

    def _after_commit(self, attempt: Attempt, step_sums: MetricSums | None) -> None:
        """The step boundary: the curve, the watchdog, then the strategy's saves and stops."""
        step = self.state.step
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if step_sums is not None and attempt.is_first and self.step_log.due(step):
            # Only then: the sums' values wait for the device.
            _correct, loss_sum, samples = (float(v) for v in step_sums.sums.cpu())
            if samples > 0:
                lr = float(self.optimizer.param_groups[0]["lr"])
                self.step_log.step(step, self.state.epoch + 1, loss_sum / samples, lr, attempt.world)
        decision = self.strategy.boundary(attempt, evaluated=step_sums is None)
        if decision.stop:
            raise Preempted(step, decision.stop_committed, decision.stop)
        if step_sums is None and self.state.finished and not decision.committed:
            raise FinalCheckpointFailed(step)

    # ------------------------------------------------------------------ the epoch's end
    @torch.no_grad()
    def evaluate(self, attempt: Attempt) -> tuple[Totals, dict[str, float]] | None:
        """Exact validation: each sample once over the members (the strategy's parts, no
        padding), SUM-combined. Also the task's extra metrics, each a SUM over validation
        samples divided by their count. None: the round cannot commit."""
        if self.checkpointer is not None:
            self.checkpointer.wait_staged()
        batches = self.strategy.val_batches(attempt)
        self.module.eval()
        sums = MetricSums(self.device)
        names = sorted(self.task.metrics)
        extra = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for *batch, indices in batches:
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
        reduced = self.strategy.reduce_eval(attempt, sums, extra)
        if reduced is None:
            return None
        totals, summed = reduced
        values = summed.cpu().tolist()
        return totals, {
            name: value / totals.samples if totals.samples else math.nan
            for name, value in zip(names, values, strict=True)
        }

    def forward_filler(self) -> None:
        """One forward whose result is dropped (FSDP2: every rank must join each gather)."""
        x, _y = self.task.to_device(default_collate([self.data.val[0]]), self.device)
        with self.precision.autocast():
            self.module(x)

    def end_epoch(self, val: Totals, extra: dict[str, float], world: int) -> None:
        """The committed evaluation round: the epoch's record, line, early stop."""
        state = self.state
        train = self.strategy.epoch_totals(self.sums)
        elapsed = self.strategy.epoch_time(self.elapsed)
        record = EpochRecord.of(state.epoch, world, train, val, elapsed, state.step, extra)
        state.history.append(record)
        state.epoch += 1
        state.batch_in_epoch = 0
        self.sums, self.elapsed = MetricSums(self.device), 0.0
        speaker = self.strategy.publish(record)
        log.info("epoch_end", **file_only(**record.to_json()))
        stop = self.strategy.decide_stop(self.task.monitored(record))
        if stop:
            self.stopped_early = True
            if speaker:
                self.console.line(f"Early stopping at epoch {record.epoch}: {self.stopper.reason}", always=True)
        state.finished = stop or state.epoch >= self.cfg.epochs

    # ------------------------------------------------------------------ checkpoint state
    def snapshot(self, finished: bool = False) -> Snapshot:
        """Everything needed to continue exactly from this step boundary."""
        app = TrainerCheckpoint(self.stopper.state(), [r.to_json() for r in self.state.history])
        accounting = self.strategy.accounting()
        return capture(
            Position(self.state.step, self.state.epoch, self.state.batch_in_epoch, finished),
            self.module,
            self.optimizer,
            device=self.device,
            scheduler=self.scheduler,
            scaler=self.precision.scaler,
            extra=self.extra.state_dict() if self.extra is not None else None,
            per_rank={
                TRAIN_SUMS: self.sums.sums,
                TRAIN_DIGEST: self.sums.digest,
                ELAPSED: torch.tensor([self.elapsed], dtype=torch.float64),
            },
            app=app.to_json(),
            accounting=accounting.to_json() if accounting is not None else None,
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

    def restore(
        self, loaded: Loaded, rank: int | None = None, world_size: int | None = None, reseed: bool = True
    ) -> Restored:
        """Continue from ``loaded``: same world size exactly; another size from the same global
        batch, the partial epoch's sums carried by rank 0 (they are summed at the epoch end)."""
        rank = self.env.rank if rank is None else rank
        world_size = self.env.world_size if world_size is None else world_size
        done = restore(
            loaded,
            self.module,
            self.optimizer,
            rank=rank,
            world_size=world_size,
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
        # A finished run trains on when this run's flags ask for more (--epochs, target, patience).
        self.state.finished = pos.finished and bool(self.finished_because())
        sums = MetricSums(self.device)
        if done.same_world_size:
            mine = done.old_ranks[rank]
            sums.sums.copy_(mine[TRAIN_SUMS])
            sums.digest.copy_(mine[TRAIN_DIGEST])
            self.elapsed = float(mine[ELAPSED])
        else:
            if reseed:  # per-rank streams cannot be split or merged
                seed_everything(self.cfg.seed + rank + 7919 * pos.step)
            if rank == 0:
                for part in done.old_ranks:
                    sums.sums += part[TRAIN_SUMS].to(self.device)
                    sums.add_digest(part[TRAIN_DIGEST])
            self.elapsed = max(float(part[ELAPSED]) for part in done.old_ranks)
        self.sums = sums
        self.restart_clock()
        return done

    def announce(self) -> None:
        cfg, env = self.cfg, self.env
        params = sum(p.numel() for p in self.module.parameters())
        self.console.line(f"Training started with {env.world_size} processes")
        model = self.task.name if cfg.task is None else f"{self.task.name} ({cfg.task})"
        self.console.line(
            f"Backend: {self.placement.backend}, device: {self.device.type}, model: {model} "
            f"({params / 1e6:.2f}M params), dataset: {self.data.describe()}, "
            f"global batch: {cfg.batch_size}, per-process batch: {per_process_batch(cfg.batch_size, env.world_size)}, "
            f"precision: {self.precision.name}"
            + (f", parallel: FSDP2 over {env.world_size} processes" if cfg.parallel == "fsdp" else "")
        )
        log.info("run_config", **file_only(config=cfg.to_json(), params=params))

    def _summary(self, wall: float) -> Summary:
        history = [r.to_json() for r in self.state.history]
        stopped = self.stopped_early or bool(self.stopper.reason)
        return Summary.of(
            history, wall, self.strategy.processes, self.placement.is_cuda, stopped, self.task.samples_are
        )

    def close(self) -> None:
        """Release loader workers and the curve's writer. The process group is the caller's."""
        self.step_log.close()
        self.strategy.close()
