"""Datasets, the world-size-independent sampler and the loaders built on them.

``open_task_data`` is collective: rank 0 prepares the task's data on disk (extraction) while the
others wait, as in the seed; then every rank opens it, and a failure on ANY rank makes every rank
raise the same error instead of leaving its peers hanging in the first collective. The same
exchange hands rank 0's identity of the data (``TaskData.identify``) to every rank.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Any

import structlog
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from elastic_train.checkpoint.format import check_json
from elastic_train.config import TrainConfig
from elastic_train.data.datasets import DataBundle
from elastic_train.data.folders import load_imagefolder, load_tiny_imagenet, prepare_tiny_imagenet
from elastic_train.data.sampler import EvalBatchSampler, GlobalBatchSampler
from elastic_train.data.synthetic import digits, synthetic
from elastic_train.distributed.env import DistEnv, should_prepare_dataset
from elastic_train.distributed.process_group import all_gather_json, broadcast_error
from elastic_train.errors import DataError, UsageError
from elastic_train.task import Task, TaskData

__all__ = [
    "DataBundle",
    "GlobalBatchSampler",
    "Indexed",
    "load_bundle",
    "make_loaders",
    "open_task_data",
    "spread_indices",
]

log = structlog.get_logger(__name__)


def prepare_on_disk(cfg: TrainConfig) -> None:
    """One process's share: unpack archives so that every rank can then open the data."""
    if cfg.dataset == "tiny-imagenet":
        assert cfg.data_dir is not None  # enforced by TrainConfig
        prepare_tiny_imagenet(cfg.data_dir)


def load_bundle(cfg: TrainConfig) -> DataBundle:
    """Open the dataset (no writes). Every rank calls this after ``prepare_on_disk``."""
    if cfg.dataset == "synthetic":
        return synthetic(cfg.image_size)
    if cfg.dataset == "digits":
        return digits(cfg.image_size, augment_seed=cfg.seed)
    assert cfg.data_dir is not None  # enforced by TrainConfig
    if cfg.dataset == "tiny-imagenet":
        return load_tiny_imagenet(prepare_tiny_imagenet(cfg.data_dir), cfg.image_size, cfg.seed)
    return load_imagefolder(cfg.data_dir, cfg.image_size, cfg.seed)


def _check_fits(cfg: TrainConfig, train_samples: int, name: str) -> None:
    if train_samples < cfg.batch_size:
        raise DataError(
            f"{name} has {train_samples} training samples, fewer than one global batch of {cfg.batch_size}",
            "lower --batch-size",
        )


def _check_map_style(data: TaskData, task: str) -> None:
    for split in ("train", "val"):
        dataset = getattr(data, split)
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(
                f"{task}: the {split} dataset ({type(dataset).__name__}) is not map-style",
                "return datasets with __len__ and __getitem__ (an IterableDataset cannot be split exactly-once)",
            )


def open_task_data(task: Task, cfg: TrainConfig, env: DistEnv) -> TaskData:
    """Collective: rank 0 runs ``task.prepare`` while the others wait (the seed's barrier), then
    every rank opens ``task.data()``; rank 0's identity of the data is everyone's.

    A ``UsageError`` on any rank (bad data, bad flags) becomes the same ``DataError`` on every
    rank; any other exception is reported to every rank as a crash (``RuntimeError``), so no rank
    is left waiting in the next collective for a peer that died here.
    """
    error: str | None = None
    crashed = False
    if should_prepare_dataset(env) and task.prepare is not None:
        try:
            task.prepare()
        except UsageError as exc:
            error = str(exc)
        except Exception as exc:
            error, crashed = f"{task.name}: prepare() raised {type(exc).__name__}: {exc}", True
    # Doubles as the seed's barrier: the others wait here until rank 0 has extracted.
    shared = broadcast_error(f"{int(crashed)}{error}" if error is not None else None)
    if shared is not None:
        raise (RuntimeError if shared[0] == "1" else DataError)(shared[1:])
    data: TaskData | None = None
    identity: dict[str, Any] | None = None
    try:
        data = task.data()
        _check_map_style(data, task.name)
        _check_fits(cfg, len(data.train), data.name or task.name)  # type: ignore[arg-type]
        if should_prepare_dataset(env):
            # The identity may read every file's size: one rank does it, the others adopt it.
            found = data.identify()
            try:
                check_json(found, f"{task.name}: the data's identity", finite=True)
            except ValueError as exc:
                raise DataError(str(exc), "return plain JSON values from TaskData.identity") from None
            identity = found  # only a JSON value travels to the other ranks
    except UsageError as exc:
        error = f"rank {env.rank}: {exc}" if env.is_distributed else str(exc)
    except Exception as exc:
        error, crashed = f"rank {env.rank}: {task.name}: data() raised {type(exc).__name__}: {exc}", True
    reports: list[list[Any]] = all_gather_json([error, crashed, identity])  # [error, crashed, identity] a rank
    first = next((r for r in reports if r[0] is not None), None)
    if first is not None:
        raise (RuntimeError if first[1] else DataError)(first[0])
    assert data is not None
    identity = next(r[2] for r in reports if r[2] is not None)
    adopted = dict(identity)
    data = replace(data, identity=lambda: adopted)
    if cfg.max_val_samples is not None and cfg.max_val_samples < len(data.val):  # type: ignore[arg-type]
        # After the identity (the dataset's, not the cap's) and before any loader: every
        # strategy shards and counts this smaller set exactly as it would the whole one.
        described = data.describe()
        picked = spread_indices(len(data.val), cfg.max_val_samples)  # type: ignore[arg-type]
        data = replace(
            data, val=Subset(data.val, picked), description=f"{described}, validating on {cfg.max_val_samples}"
        )
    log.info("dataset_ready", task=task.name, train=len(data.train), val=len(data.val))  # type: ignore[arg-type]
    return data


def spread_indices(size: int, n: int) -> list[int]:
    """``n`` of ``size`` indices spread evenly over the set (``--max-val-samples``), the same on
    every rank and at every world size. Not the first ``n``: a folder dataset lists its samples
    class by class, so its first 64 would be one or two classes."""
    if not 0 < n <= size:
        raise ValueError(f"cannot pick {n} of {size} samples")
    return [i * size // n for i in range(n)]


class Indexed(Dataset[tuple[Any, ...]]):
    """A task's dataset with each item's dataset index appended (the sample digest's input).

    Training keys are ``(epoch, index)`` (``GlobalBatchSampler``); a dataset that is not
    ``train_by_epoch`` receives the index alone. Evaluation keys are plain indices.
    """

    def __init__(self, dataset: Dataset[Any], by_epoch: bool = False) -> None:
        self.dataset = dataset
        self.by_epoch = by_epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, ...]:
        index = key[1] if isinstance(key, tuple) else key
        item = self.dataset[key if self.by_epoch else index]
        if not isinstance(item, (tuple, list)):
            raise TypeError(
                f"item {index} of {type(self.dataset).__name__} is a {type(item).__name__}: "
                "a task's dataset items must be (inputs, target) tuples"
            )
        return (*item, index)


def make_loaders(
    data: TaskData,
    cfg: TrainConfig,
    env: DistEnv,
    pin_memory: bool,
) -> tuple[DataLoader[object], GlobalBatchSampler, DataLoader[object]]:
    sampler = GlobalBatchSampler(
        num_samples=len(data.train),  # type: ignore[arg-type]
        global_batch=cfg.batch_size,
        world_size=env.world_size,
        rank=env.rank,
        seed=cfg.seed,
        max_steps_per_epoch=cfg.max_steps_per_epoch,
    )
    workers = cfg.num_workers
    train = DataLoader(
        Indexed(data.train, by_epoch=data.train_by_epoch),
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        worker_init_fn=ignore_interrupts,
        # Every iterator draws its workers' base seed from this generator. The default, torch's
        # global RNG, would make a run resumed mid-epoch (a new iterator where the uninterrupted
        # run had none) draw once more than it, shifting every later random op (dropout).
        generator=torch.Generator().manual_seed(cfg.seed + env.rank),
    )
    # Evaluation batches are as large as the largest training share: memory known to fit.
    eval_batch = sampler.per_process_batch.largest
    val = DataLoader(
        Indexed(data.val),
        batch_sampler=EvalBatchSampler(len(data.val), eval_batch, env.world_size, env.rank),  # type: ignore[arg-type]
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        worker_init_fn=ignore_interrupts,
        generator=torch.Generator().manual_seed(cfg.seed + env.rank),
    )
    return train, sampler, val


def ignore_interrupts(_worker_id: int) -> None:
    """A DataLoader worker ignores SIGINT. A Ctrl-C in a terminal reaches the whole foreground
    process group, loader workers included; torch's worker loop exits quietly on it, and the
    trainer, which is finishing its step to checkpoint, would then fail on a dead worker. The
    workers end with their trainer process (torch's own shutdown) instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
