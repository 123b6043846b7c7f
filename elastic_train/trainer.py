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

from elastic_train.config import TrainConfig
from elastic_train.data import DataBundle, make_loaders
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import Placement, all_reduce_max
from elastic_train.early_stop import EarlyStopper, decide_stop
from elastic_train.faults import FaultInjector
from elastic_train.logs import Console, MetricsFile, file_only
from elastic_train.metrics import EpochRecord, MetricSums, Totals
from elastic_train.models import build_model
from elastic_train.precision import Precision, choose_precision
from elastic_train.progress import ProgressBar

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
    ) -> None:
        self.cfg, self.env, self.placement, self.bundle = cfg, env, placement, bundle
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
        self.precision: Precision = choose_precision(cfg.amp, self.device)
        self.stopper = EarlyStopper(cfg.target_accuracy, cfg.patience)
        self.state = TrainState()
        shape = (1, 3, 1, 1)
        self._mean = torch.tensor(bundle.mean, device=self.device).view(shape)
        self._std = torch.tensor(bundle.std, device=self.device).view(shape)

    # ------------------------------------------------------------------ one step
    def _inputs(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = images.to(self.device, non_blocking=True).float().div_(255.0).sub_(self._mean).div_(self._std)
        return x, labels.to(self.device, non_blocking=True)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's share of a global batch; DDP averages the gradients."""
        with self.precision.autocast():
            logits = self.model(x)
            loss = self.criterion(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        scaler = self.precision.scaler
        scaler.scale(loss).backward()
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        return logits.detach(), loss.detach()

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> tuple[Totals, float]:
        """Train one epoch (from ``state.batch_in_epoch`` on); returns global sums and MAX time."""
        self.model.train()  # type: ignore[no-untyped-call]
        self.sampler.set_epoch(epoch, self.state.batch_in_epoch)
        sums = MetricSums(self.device)
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
            self.progress.update(self.state.batch_in_epoch)
        if self.placement.is_cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.progress.close()
        return sums.reduce(), all_reduce_max(elapsed, self.device)

    @torch.no_grad()
    def evaluate(self) -> Totals:
        """Exact validation: each sample once (disjoint shards, no padding), SUM-reduced."""
        # Eval runs the bare module (shards may differ in length: no DDP collectives here);
        # rank 0's buffers (e.g. BatchNorm statistics) are made everyone's first.
        for buffer in self.module.buffers():
            torch.distributed.broadcast(buffer, src=0)
        self.module.eval()
        sums = MetricSums(self.device)
        for images, labels, indices in self.val_loader:
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
            f"global batch: {cfg.batch_size}, per-process batch: {cfg.batch_size // env.world_size}, "
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
        return self._summary(time.perf_counter() - wall_start, stopped_early)

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
        )

    def close(self) -> None:
        """Release loader workers. The process group is the caller's."""
        for loader in (self.train_loader, self.val_loader):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
