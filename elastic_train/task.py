"""Plug-in tasks: what to train, on which data, with which loss. Everything else is the runtime's.

``--task package.module:function`` names a function ``(TrainConfig) -> Task``. The trainer then
applies to the task exactly what it applies to its built-in image classification (which is
itself a ``Task``, ``elastic_train.image_classification``): the world-size-independent global-batch
sampler, exact SUM-reduced metrics, MAX timing, early stop, checkpoints with bitwise resume,
elasticity, preemption, the Slurm jobs, the report.

The contract, in the order the runtime uses it:

1. ``prepare()`` (optional) runs on rank 0 alone while the other ranks wait: unpack, index or
   convert data on shared storage. It must be idempotent (every attempt runs it again).
2. ``data()`` runs on every rank: map-style datasets whose items are tuples ``(inputs, target)``
   of tensors or numbers (default collation). The training set is indexed by sample index, or
   by ``(epoch, index)`` when ``TaskData.train_by_epoch`` (per-epoch augmentation that stays a
   pure function of the key: exact at any world size and after any restart). ``identity()``
   says what the data is (rank 0 computes it; a checkpoint is only resumed on the same).
3. ``model(data)`` runs on every rank right after seeding with ``--seed``: same initial
   weights everywhere. Every parameter must take part in the loss (DDP), unless the task sets
   ``find_unused_parameters`` (DDP's slower search for the ones a step did not use).
4. Per step: ``to_device(batch, device) -> (inputs, targets)``, ``outputs = model(inputs)``,
   ``loss(outputs, targets)`` (the batch MEAN; the runtime weights each rank's share so the
   update is the global batch's mean at any world size), ``correct(outputs, targets)`` (how
   many of the batch's samples count as correct: accuracy = correct / samples).
5. ``metrics`` (optional): ``{name: fn(outputs, targets)}``, each returning a SUM over the
   batch's samples; evaluated on the validation set, reduced exactly and reported per
   validation sample (e.g. the per-sample loss sum, for a perplexity).
6. ``optimizer(model)`` / ``scheduler(optimizer, total_steps)`` (optional): default AdamW or SGD
   from the flags and linear warm-up + cosine decay; any ``torch.optim`` optimizer (its state
   is saved by parameter name) and any scheduler with ``state_dict``.
7. ``extra_state(model)`` (optional): state of the task's own, e.g. an EMA of the weights;
   ``after_step`` runs after every optimizer step, its tensors are checkpointed and restored.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_train.errors import UsageError


class ExtraState(Protocol):
    """A task's own state beside model and optimizer (replicated: the same on every rank)."""

    def after_step(self, step: int) -> None:
        """After optimizer step ``step`` (counted from 1 across epochs)."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...


def _sizes(train: Dataset[Any], val: Dataset[Any]) -> dict[str, Any]:
    return {"train_samples": len(train), "val_samples": len(val)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class TaskData:
    """The opened datasets (see the module docstring, step 2)."""

    train: Dataset[Any]
    val: Dataset[Any]
    # JSON values that change whenever the samples behind the indices do; computed by rank 0.
    # The default, the sizes alone, cannot see an edited sample: return a content hash if you can.
    identity: Callable[[], Mapping[str, Any]] | None = None
    description: str = ""  # for the start-up line, e.g. "chars (4096 train / 512 val)"
    name: str = ""  # the dataset's name in messages (default: the task's)
    train_by_epoch: bool = False  # the training set is indexed by (epoch, index)

    def __post_init__(self) -> None:
        # Checked when the task builds it, on every rank alike: exit 2 with the fix, not a
        # TypeError at the fingerprint (exit 1, retried by torchrun on every attempt).
        if self.identity is not None and not callable(self.identity):
            raise UsageError(
                f"TaskData(identity=...) got a {type(self.identity).__name__}, not a function",
                "pass a function returning the JSON values, e.g. identity=lambda: {'sha256': digest}",
            )

    def __len__(self) -> int:
        return len(self.train)  # type: ignore[arg-type]

    def identify(self) -> dict[str, Any]:
        return dict(self.identity()) if self.identity is not None else _sizes(self.train, self.val)

    def describe(self) -> str:
        sizes = f"{len(self.train)} train / {len(self.val)} val"  # type: ignore[arg-type]
        return self.description or sizes


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; class scores on dim 1 ([N, C] or [N, C, ...])."""
    return nn.functional.cross_entropy(outputs, targets)


def argmax_correct(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Samples whose top-scoring class (dim 1) is the target; for [N, C, T...] outputs each
    sample counts the fraction of its positions predicted right."""
    hits = (outputs.argmax(dim=1) == targets).to(torch.float64)
    return hits.sum() if hits.dim() == 1 else hits.flatten(1).mean(dim=1).sum()


def move_to(batch: Sequence[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The default ``to_device``: ``(inputs, target)`` items, each moved as is."""
    if len(batch) != 2:
        raise ValueError(f"a task's items must be (inputs, target) pairs, got {len(batch)} fields: pass to_device")
    inputs, targets = batch
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


@dataclass(frozen=True)
class Task:
    """What to train (see the module docstring for the contract of each field)."""

    name: str  # shown at start-up and recorded in checkpoints
    data: Callable[[], TaskData]
    model: Callable[[TaskData], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    prepare: Callable[[], None] | None = None
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = argmax_correct
    metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None  # needs state_dict/load_state_dict
    extra_state: Callable[[nn.Module], ExtraState] | None = None
    to_device: Callable[[Sequence[Any], torch.device], tuple[torch.Tensor, torch.Tensor]] = move_to
    # Settings of the task's own that a resumed run must share (e.g. a vocabulary size).
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    # What one sample is, for the throughput lines: "samples/s", or the seed's "img/s" and
    # "images/second" for "images".
    samples_are: str = "samples"
    # DDP's setting for a model whose loss does not use every parameter at every step (a
    # branch taken by some batches only): slower, so off unless the task says so.
    find_unused_parameters: bool = False
    # Under --parallel fsdp: the modules that become FSDP2 units of their own (each gathered just
    # before its forward and freed after), given the built model; the root is always one. None:
    # the model's repeated layers (``distributed.fsdp.default_blocks``).
    fsdp_blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    # What early stop watches, and which way is better: "val_acc" (the seed's, with
    # --target-accuracy), "val_loss", "train_loss", "train_acc" or "val_<name>" of ``metrics``;
    # ``target``: stop once reached (None: --target-accuracy for val_acc, else patience only).
    monitor: str = "val_acc"
    mode: str = "max"  # "max" or "min"
    target: float | None = None
    # False for a task whose ``correct`` means nothing (a regression): the console's epoch line
    # leaves train_acc / val_acc out (metrics.jsonl keeps its fields, as 0).
    accuracy: bool = True

    def __post_init__(self) -> None:
        known = ("val_acc", "val_loss", "train_acc", "train_loss", *(f"val_{name}" for name in self.metrics))
        if self.monitor not in known:
            raise UsageError(
                f"task {self.name}: monitor={self.monitor!r} is not one of its metrics", f"pick one of {known}"
            )
        if self.mode not in ("max", "min"):
            raise UsageError(f"task {self.name}: mode={self.mode!r}", "pass 'max' (higher is better) or 'min'")

    def monitored(self, record: Any) -> float:
        """The value early stop watches in an epoch's record (``metrics.EpochRecord``)."""
        if self.monitor.startswith("val_") and self.monitor[4:] in record.val_metrics:
            return float(record.val_metrics[self.monitor[4:]])
        return float(getattr(record, self.monitor))

    def early_stop_target(self, target_accuracy: float) -> float | None:
        """The monitored metric's target: the task's own, else --target-accuracy for val_acc."""
        if self.target is not None:
            return self.target
        return target_accuracy if self.monitor == "val_acc" else None

    @property
    def rate_unit(self) -> str:
        return "img" if self.samples_are == "images" else self.samples_are

    def make_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        """This task's scheduler, refused at start (not at the first save, on every attempt)
        when a checkpoint could not save and restore it."""
        assert self.scheduler is not None
        scheduler = self.scheduler(optimizer, total_steps)
        missing = [n for n in ("step", "state_dict", "load_state_dict") if not callable(getattr(scheduler, n, None))]
        if missing:
            raise UsageError(
                f"task {self.name}: its scheduler ({type(scheduler).__name__}) has no {', '.join(missing)}",
                "return a torch.optim.lr_scheduler scheduler, or an object with step, state_dict and load_state_dict",
            )
        return scheduler

    def usage_error(self, exc: RuntimeError) -> UsageError | None:
        """DDP's error about parameters the loss did not use, as the fix a task can apply; None
        for any other error."""
        if "find_unused_parameters" not in str(exc) or self.find_unused_parameters:
            return None
        return UsageError(
            f"task {self.name}: some model parameters took no part in the loss of a step (DDP cannot average "
            "their gradients)",
            "use every parameter in the loss, or set Task(find_unused_parameters=True) for a model whose branches "
            "are taken by some batches only",
        )


TaskFactory = Callable[[Any], Task]


def load_task_factory(spec: str) -> TaskFactory:
    """``package.module:function`` -> the function (imported, not called). ``UsageError`` names
    what is wrong: the syntax, a module that does not import, a missing attribute."""
    module_name, sep, attr = spec.partition(":")
    # `python -m elastic_train` and torchrun put the working directory on sys.path, the
    # `elastic-train` console script does not: the same --task must import under both.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    hint = "pass --task package.module:function, importable from the working directory or PYTHONPATH"
    if not sep or not module_name or not attr.isidentifier():
        raise UsageError(f"--task {spec!r} is not of the form package.module:function", hint)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--task {spec!r}: cannot import {module_name!r} ({exc})", hint) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--task {spec!r}: {module_name} has no function {attr!r}", hint)
    return factory  # type: ignore[no-any-return]


def build_task(spec: str, cfg: Any) -> Task:
    """Call the ``--task`` factory with the run's ``TrainConfig``; it must return a ``Task``."""
    task = load_task_factory(spec)(cfg)
    if not isinstance(task, Task):
        raise UsageError(
            f"--task {spec!r} returned {type(task).__name__}, not an elastic_train.Task",
            "return elastic_train.Task(name=..., data=..., model=...) from the function",
        )
    return task
