"""Datasets, the world-size-independent sampler and the loaders built on them.

``build_data`` is collective: rank 0 prepares the dataset on disk (extraction) while the others
wait, as in the seed; then every rank opens it, and a failure on ANY rank makes every rank raise
the same ``DataError`` instead of leaving its peers hanging in the first collective. The same
exchange hands rank 0's dataset identity (``DataBundle.identity``) to every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import structlog
import torch.distributed as dist
from torch.utils.data import DataLoader

from elastic_train.config import TrainConfig
from elastic_train.data.datasets import DataBundle, EvalView, TrainView
from elastic_train.data.folders import load_imagefolder, load_tiny_imagenet, prepare_tiny_imagenet
from elastic_train.data.sampler import EvalBatchSampler, GlobalBatchSampler
from elastic_train.data.synthetic import digits, synthetic
from elastic_train.distributed.env import DistEnv, should_prepare_dataset
from elastic_train.distributed.process_group import broadcast_error
from elastic_train.errors import DataError

__all__ = ["DataBundle", "GlobalBatchSampler", "build_data", "load_bundle", "make_loaders"]

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


def _check_fits(cfg: TrainConfig, bundle: DataBundle) -> None:
    if len(bundle.train) < cfg.batch_size:
        raise DataError(
            f"{bundle.name} has {len(bundle.train)} training samples, fewer than one global batch of {cfg.batch_size}",
            "lower --batch-size",
        )


def build_data(cfg: TrainConfig, env: DistEnv) -> DataBundle:
    error: str | None = None
    if should_prepare_dataset(env):
        try:
            prepare_on_disk(cfg)
        except DataError as exc:
            error = str(exc)
    # Doubles as the seed's barrier: the others wait here until rank 0 has extracted.
    error = broadcast_error(error)
    if error is not None:
        raise DataError(error)
    bundle: DataBundle | None = None
    identity: dict[str, Any] | None = None
    try:
        bundle = load_bundle(cfg)
        _check_fits(cfg, bundle)
        if should_prepare_dataset(env):
            # The identity reads every file's size: one rank does it, the others adopt it.
            identity = bundle.identity()
    except DataError as exc:
        error = f"rank {env.rank}: {exc}" if env.is_distributed else str(exc)
    reports: list[tuple[str | None, dict[str, Any] | None] | None] = [None] * env.world_size
    dist.all_gather_object(reports, (error, identity))
    first = next((r[0] for r in reports if r is not None and r[0] is not None), None)
    if first is not None:
        raise DataError(first)
    assert bundle is not None
    identity = next(r[1] for r in reports if r is not None and r[1] is not None)
    bundle = replace(bundle, known_identity=identity)
    log.info(
        "dataset_ready",
        dataset=bundle.name,
        train=len(bundle.train),
        val=len(bundle.val),
        classes=bundle.num_classes,
        image_size=bundle.image_size,
    )
    return bundle


def make_loaders(
    bundle: DataBundle,
    cfg: TrainConfig,
    env: DistEnv,
    pin_memory: bool,
) -> tuple[DataLoader[object], GlobalBatchSampler, DataLoader[object]]:
    sampler = GlobalBatchSampler(
        num_samples=len(bundle.train),
        global_batch=cfg.batch_size,
        world_size=env.world_size,
        rank=env.rank,
        seed=cfg.seed,
        max_steps_per_epoch=cfg.max_steps_per_epoch,
    )
    workers = cfg.num_workers
    train = DataLoader(
        TrainView(bundle.train, bundle.augment),
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
    )
    # Evaluation batches are as large as the largest training share: memory known to fit.
    eval_batch = sampler.per_process_batch.largest
    val = DataLoader(
        EvalView(bundle.val),
        batch_sampler=EvalBatchSampler(len(bundle.val), eval_batch, env.world_size, env.rank),
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
    )
    return train, sampler, val
