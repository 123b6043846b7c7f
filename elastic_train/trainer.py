"""The training loop: one epoch of DDP training, an exact evaluation, early stop, the summary.

Readable top to bottom: ``fit`` runs epochs; ``train_epoch`` runs steps; ``evaluate`` runs the
validation shard. Every collective (metric reductions, the early-stop broadcast) is issued by
all ranks in the same order; nothing a single rank decides alone can gate one.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_train.checkpoint.manager import Checkpointer, Loaded, Snapshot
from elastic_train.checkpoint.state import (
    MODEL,
    capture_rng,
    flatten,
    load_state_dicts,
    rank_items,
    restore_rng,
    state_dicts,
    unflatten,
)
from elastic_train.config import TrainConfig
from elastic_train.data import DataBundle, make_loaders
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import ControlPlane, Placement, all_reduce_max
from elastic_train.early_stop import EarlyStopper, decide_stop
from elastic_train.faults import FaultInjector
from elastic_train.logs import Console, MetricsFile, file_only
from elastic_train.metrics import EpochRecord, MetricSums, Totals
from elastic_train.models import build_model
from elastic_train.precision import Precision, choose_precision
from elastic_train.progress import ProgressBar
from elastic_train.resilience.goodput import ProgressTracker
from elastic_train.resilience.preemption import Preempted, PreemptionFlag, StopKind
from elastic_train.resilience.watchdog import StepWatchdog

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


@dataclass
class TrainState:
    """Where the run is. Plain values, so a checkpoint can store it as JSON."""

    epoch: int = 0  # epochs completed
    step: int = 0  # global optimizer steps completed, counted across epochs
    batch_in_epoch: int = 0  # global batches of the current epoch already trained on
    history: list[EpochRecord] = field(default_factory=list)


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

    def console_lines(self) -> list[str]:
        return [
            "Training Summary:",
            f"Total training time: {self.total_time:.3f} seconds",
            f"Throughput: {self.throughput:.3f} images/second",
            f"Total GPUs used: {self.gpus}",
            f"Total processes used: {self.processes}",
        ]


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        placement: Placement,
        bundle: DataBundle,
        faults: FaultInjector,
        checkpointer: Checkpointer | None = None,
        control: ControlPlane | None = None,
        preemption: PreemptionFlag | None = None,
        watchdog: StepWatchdog | None = None,
        tracker: ProgressTracker | None = None,
    ) -> None:
        self.cfg, self.env, self.placement, self.bundle = cfg, env, placement, bundle
        self.checkpointer = checkpointer
        self.control = control
        self.preemption = preemption
        self.watchdog = watchdog
        self.tracker = tracker
        self.device = placement.device
        self.console = Console(env)
        self.metrics_file = MetricsFile(cfg.log_dir, env)
        self.faults = faults
        self.progress = ProgressBar.for_terminal(env.is_main)
        self.train_loader, self.sampler, self.val_loader = make_loaders(bundle, cfg, env, placement.is_cuda)

        # Same initial weights on every rank and for every world size; DDP also broadcasts
        # rank 0's. Then the seed's `seed + rank` for everything random during training.
        seed_everything(cfg.seed)
        module = build_model(cfg.model, bundle.num_classes, bundle.image_size).to(self.device)
        self.module = module
        self.model = DistributedDataParallel(
            module, device_ids=[self.device.index] if placement.is_cuda else None, gradient_as_bucket_view=True
        )
        seed_everything(cfg.seed + env.rank)
        self.criterion = nn.CrossEntropyLoss()
        self.optimizer = build_optimizer(cfg, module)
        self.total_steps = cfg.epochs * self.sampler.batches_per_epoch
        self.scheduler = build_schedule(cfg, self.optimizer, self.total_steps)
        self.precision: Precision = choose_precision(cfg.amp, self.device, cfg.amp_dtype)
        self.stopper = EarlyStopper(cfg.target_accuracy, cfg.patience)
        self.state = TrainState()
        # A partly trained epoch restored from a checkpoint: its metric sums and time so far.
        self._resumed_sums: MetricSums | None = None
        self._stepped = False
        self._resumed_elapsed = 0.0
        shape = (1, 3, 1, 1)
        self._mean = torch.tensor(bundle.mean, device=self.device).view(shape)
        self._std = torch.tensor(bundle.std, device=self.device).view(shape)

    # ------------------------------------------------------------------ one step
    def _inputs(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = images.to(self.device, non_blocking=True).float().div_(255.0).sub_(self._mean).div_(self._std)
        return x, labels.to(self.device, non_blocking=True)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's share of a global batch; DDP averages the gradients.

        Shares may differ by one sample (64 over 3 ranks: 22, 21, 21), so the mean loss is
        weighted by the share's size before DDP's average: the update is the global batch's mean
        at any world size. The returned loss is the unweighted mean, for the metric sums.
        """
        with self.precision.autocast():
            logits = self.model(x)
            loss = self.criterion(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        scaler = self.precision.scaler
        scaler.scale(loss * self.sampler.loss_weight(y.shape[0])).backward()
        if self.checkpointer is not None:
            self.checkpointer.wait_staged()  # an async save may still be copying the weights
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        return logits.detach(), loss.detach()

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> tuple[Totals, float]:
        """Train one epoch (from ``state.batch_in_epoch`` on); returns global sums and MAX time."""
        self.model.train()  # type: ignore[no-untyped-call]
        self.sampler.set_epoch(epoch, self.state.batch_in_epoch)
        sums, prior = self._resumed_sums or MetricSums(self.device), self._resumed_elapsed
        self._resumed_sums, self._resumed_elapsed = None, 0.0
        self.progress.start(f"Epoch {epoch + 1}/{self.cfg.epochs}", self.sampler.batches_per_epoch)
        start = time.perf_counter()
        for images, labels, indices in self.train_loader:
            self.faults.at_step(self.state.step + 1)
            x, y = self._inputs(images, labels)
            logits, loss = self.train_step(x, y)
            sums.add_batch(logits, y, loss)
            sums.add_indices(indices)
            self.state.step += 1
            self.state.batch_in_epoch += 1
            if not self._stepped:
                self._stepped = True  # recovery timing: the first step of this process and group size
                log.info("first_step", step=self.state.step, world_size=self.env.world_size)
            self.progress.update(self.state.batch_in_epoch)
            if self.watchdog is not None:
                self.watchdog.beat(self.state.step)
            if self.tracker is not None:
                self.tracker.on_step(self.state.step)
            last = self.state.batch_in_epoch >= self.sampler.batches_per_epoch
            self._step_boundary(sums, prior + time.perf_counter() - start, last)
        if self.placement.is_cuda:
            torch.cuda.synchronize(self.device)
        elapsed = prior + time.perf_counter() - start
        self.progress.close()
        return sums.reduce(), all_reduce_max(elapsed, self.device)

    def _step_boundary(self, sums: MetricSums, elapsed: float, last: bool = False) -> None:
        """Between two steps: stop requests, committing a finished async save, starting a due one.

        Collective. The ranks agree on [stop kind requested anywhere, rank 0 says a timed save
        is due, some rank's shard is not durable yet] with a MAX all-reduce that is posted here
        and collected at the next boundary (``ControlPlane``): it overlaps the next step, and
        every rank acts on the same answer at the same step. ``last`` (the epoch's final step)
        collects without posting: the epoch end agrees synchronously.
        """
        ck = self.checkpointer
        if ck is None or self.control is None:
            return
        # Nothing posted yet (the first step of this process or epoch): no stop, no commit.
        stop, time_due, not_done = self.control.collect() or (StopKind.NONE, 0, 1)
        if stop:
            self._stop_for_preemption(sums, elapsed, StopKind(stop))
        if ck.pending and not_done:
            # Only while a save is in flight: ask again now rather than a step later, so a shard
            # that became durable during this step commits at this boundary (what a crash in
            # the next step would otherwise cost). Every rank has the same pending save.
            (not_done,) = self.control.agree(not ck.local_done())
        if ck.pending and not not_done:
            ck.commit_pending()
        # On an epoch's last batch the epoch-end checkpoint (after evaluation) comes next instead.
        epoch_done = self.state.batch_in_epoch >= self.sampler.batches_per_epoch
        if (ck.due_by_step(self.state.step) or time_due) and not epoch_done:
            ck.save(self.snapshot(sums, elapsed), sync=not self.cfg.async_checkpoint)
        if not last:
            self.control.post(self._stop_requested(), self.env.is_main and ck.due_by_time(), not ck.local_done())

    def _stop_requested(self) -> StopKind:
        return self.preemption.kind if self.preemption is not None else StopKind.NONE

    def _stop_for_preemption(self, sums: MetricSums | None, elapsed: float, kind: StopKind) -> None:
        """Every rank: commit a checkpoint of this exact step synchronously, then stop."""
        ck = self.checkpointer
        assert ck is not None
        if self.preemption is not None:
            self.preemption.acknowledge()  # the boundary is reached: no grace-period exit now
        if ck.pending:
            ck.commit_pending()
        # save() skips a state this run's timeline already committed (rank 0 decides for all).
        committed = bool(ck.save(self.snapshot(sums, elapsed), sync=True))
        signal_name = self.preemption.signal_name if self.preemption else None
        log.warning(
            "preempted", step=self.state.step, signal=signal_name, kind=kind.name, checkpoint_committed=committed
        )
        raise Preempted(self.state.step, committed, kind)

    # ------------------------------------------------------------------ checkpoint state
    def snapshot(self, sums: MetricSums | None = None, elapsed: float = 0.0, finished: bool = False) -> Snapshot:
        """Everything needed to continue exactly from this step boundary."""
        model_sd, optim_sd = state_dicts(self.module, self.optimizer)
        replicated, optim_meta = flatten(model_sd, optim_sd)
        # Buffers (BatchNorm statistics) change in the next forward pass, before the async
        # save's copy is guaranteed done: clone them now (they are small). Each rank's differ
        # (its own batch updated them); DDP re-broadcasts rank 0's at the next forward, so
        # rank 0's are saved.
        buffers = frozenset(MODEL + name for name, _ in self.module.named_buffers()) & replicated.keys()
        for key in buffers:
            replicated[key] = replicated[key].clone()
        sums = sums or MetricSums(self.device)
        per_rank = capture_rng(self.device)
        per_rank.update(
            {
                "metrics.train_sums": sums.sums,
                "metrics.train_digest": sums.digest,
                "metrics.elapsed": torch.tensor([elapsed], dtype=torch.float64),
            }
        )
        trainer = {
            **optim_meta,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict(),
            "early_stop": self.stopper.state(),
            "history": [r.to_json() for r in self.state.history],
            "accounting": self.tracker.accounting.to_json() if self.tracker is not None else None,
        }
        return Snapshot(
            step=self.state.step,
            epoch=self.state.epoch,
            batch_in_epoch=self.state.batch_in_epoch,
            replicated=replicated,
            per_rank=per_rank,
            trainer=trainer,
            fingerprint=self.cfg.fingerprint(self.bundle.identity()),
            config=self.cfg.to_json(),
            finished=finished,
            from_rank0=buffers,
        )

    def restore(self, loaded: Loaded) -> None:
        """Continue from ``loaded``: same world size exactly; another size from the same global batch."""
        m = loaded.manifest
        model_sd, optim_sd = unflatten(loaded.tensors, m.trainer)
        load_state_dicts(self.module, self.optimizer, model_sd, optim_sd)
        self.scheduler.load_state_dict(m.trainer["scheduler"])
        if m.trainer.get("scaler"):
            self.precision.scaler.load_state_dict(m.trainer["scaler"])
        for key, value in m.trainer["early_stop"].items():
            setattr(self.stopper, key, value)
        self.stopper.target_accuracy, self.stopper.patience = self.cfg.target_accuracy, self.cfg.patience
        self.state = TrainState(m.epoch, m.step, m.batch_in_epoch, [EpochRecord(**r) for r in m.trainer["history"]])
        self._restore_rank_state(loaded)

    def _restore_rank_state(self, loaded: Loaded) -> None:
        sums = MetricSums(self.device)
        old_world = loaded.manifest.world_size
        if old_world == self.env.world_size:
            mine = rank_items(loaded.tensors, self.env.rank)
            restore_rng(mine, self.device)
            sums.sums.copy_(mine["metrics.train_sums"])
            sums.digest.copy_(mine["metrics.train_digest"])
            self._resumed_elapsed = float(mine["metrics.elapsed"])
        else:
            # Per-rank streams cannot be split or merged: reseed, and let rank 0 carry the
            # partial epoch's sums (they are all-reduced at the epoch end anyway).
            seed_everything(self.cfg.seed + self.env.rank + 7919 * loaded.manifest.step)
            old = [rank_items(loaded.tensors, r) for r in range(old_world)]
            if self.env.is_main:
                for part in old:
                    sums.sums += part["metrics.train_sums"].to(self.device)
                    sums.add_digest(part["metrics.train_digest"])
            self._resumed_elapsed = max(float(part["metrics.elapsed"]) for part in old)
        self._resumed_sums = sums

    @torch.no_grad()
    def evaluate(self) -> Totals:
        """Exact validation: each sample once (disjoint shards, no padding), SUM-reduced."""
        # Eval runs the bare module (shards may differ in length: no DDP collectives here);
        # rank 0's buffers (e.g. BatchNorm statistics) are made everyone's first.
        if self.checkpointer is not None:
            self.checkpointer.wait_staged()
        for buffer in self.module.buffers():
            torch.distributed.broadcast(buffer, src=0)
        self.module.eval()
        sums = MetricSums(self.device)
        for images, labels, indices in self.val_loader:
            if self.watchdog is not None:
                self.watchdog.beat(self.state.step, "evaluate")
            x, y = self._inputs(images, labels)
            with self.precision.autocast():
                logits = self.module(x)
                loss = self.criterion(logits, y)
            sums.add_batch(logits.float(), y, loss.float())
            sums.add_indices(indices)
        return sums.reduce()

    def _record(self, epoch: int, train: Totals, val: Totals, elapsed: float) -> EpochRecord:
        return EpochRecord(
            epoch=epoch + 1,
            world_size=self.env.world_size,
            train_loss=train.loss,
            train_acc=train.accuracy,
            val_loss=val.loss,
            val_acc=val.accuracy,
            epoch_time=elapsed,
            throughput=train.samples / elapsed if elapsed > 0 else 0.0,
            samples_seen=train.samples,
            sample_digest=train.digest,
            val_samples=val.samples,
            step=self.state.step,
        )

    def announce(self) -> None:
        cfg, env, bundle = self.cfg, self.env, self.bundle
        params = sum(p.numel() for p in self.module.parameters())
        self.console.line(f"Training started with {env.world_size} processes")
        self.console.line(
            f"Backend: {self.placement.backend}, device: {self.device.type}, model: {cfg.model} "
            f"({params / 1e6:.2f}M params), dataset: {bundle.name} ({len(bundle.train)} train / "
            f"{len(bundle.val)} val, {bundle.num_classes} classes, {bundle.image_size}px), "
            f"global batch: {cfg.batch_size}, per-process batch: {self.sampler.per_process_batch}, "
            f"precision: {self.precision.name}"
        )
        log.info("run_config", **file_only(config=cfg.to_json(), params=params))

    def fit(self) -> Summary:
        self.announce()
        wall_start = time.perf_counter()
        stopped_early = False
        while self.state.epoch < self.cfg.epochs and not stopped_early:
            epoch = self.state.epoch
            train, elapsed = self.train_epoch(epoch)
            val = self.evaluate()
            record = self._record(epoch, train, val, elapsed)
            self.state.history.append(record)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0
            self.console.line(record.console_line(self.cfg.epochs))
            self.metrics_file.append(record.to_json())
            log.info("epoch_end", **file_only(**record.to_json()))
            stopped_early = decide_stop(self.stopper, record.val_acc, self.env.is_main, self.device)
            if stopped_early:
                self.console.line(f"Early stopping at epoch {record.epoch}: {self.stopper.reason}")
            self._save_epoch_end(finished=stopped_early or self.state.epoch >= self.cfg.epochs)
            if self.control is not None and self.preemption is not None and not stopped_early:
                (stop,) = self.control.agree(self._stop_requested())
                if stop and self.state.epoch < self.cfg.epochs:
                    self._stop_for_preemption(None, 0.0, StopKind(stop))
        return self._summary(time.perf_counter() - wall_start, stopped_early)

    def _save_epoch_end(self, finished: bool) -> None:
        """Every epoch end is a checkpoint; the last one is written synchronously."""
        ck = self.checkpointer
        if ck is None:
            return
        committed = ck.save(self.snapshot(finished=finished), sync=finished or not self.cfg.async_checkpoint)
        if finished and not committed:
            log.error("final_checkpoint_failed", step=self.state.step, detail="the newest committed one is older")

    def _summary(self, wall: float, stopped_early: bool) -> Summary:
        history = self.state.history
        train_time = sum(r.epoch_time for r in history)
        images = sum(r.samples_seen for r in history)
        return Summary(
            total_time=wall,
            throughput=images / train_time if train_time > 0 else 0.0,
            gpus=self.env.world_size if self.placement.is_cuda else 0,
            processes=self.env.world_size,
            epochs_run=len(history),
            stopped_early=stopped_early,
            final_val_acc=history[-1].val_acc if history else float("nan"),
            productive_time=train_time,
        )

    def close(self) -> None:
        """Release loader workers. The process group is the caller's."""
        for loader in (self.train_loader, self.val_loader):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
