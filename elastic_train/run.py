"""Run one training job in this process: placement, process group, data, trainer, summary.

``train`` is wrapped in torch's ``@record``: an uncaught exception is written to torchrun's
per-worker error file, so torchrun's failure summary names the rank and the root cause.
"""

from __future__ import annotations

import os

import structlog
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train import __version__
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer, Loaded
from elastic_train.config import TrainConfig
from elastic_train.data import build_data
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import ControlPlane, Placement, choose_placement, process_group
from elastic_train.errors import EXIT_OK
from elastic_train.faults import FaultInjector
from elastic_train.logs import Console, attach_rank_log
from elastic_train.trainer import Trainer

log = structlog.get_logger(__name__)


def configure_threads(cfg: TrainConfig, env: DistEnv) -> int:
    """Avoid oversubscription: two processes with two threads each on two cores run at half speed."""
    if cfg.threads:
        threads = cfg.threads
    elif os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // env.local_world_size)
    torch.set_num_threads(threads)
    return threads


def _tune_cuda(placement: Placement) -> None:
    if placement.is_cuda:
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")


def checkpoint_config(cfg: TrainConfig) -> CheckpointConfig:
    return CheckpointConfig(
        root=cfg.checkpoint_dir,
        every_steps=cfg.checkpoint_every,
        every_seconds=cfg.checkpoint_every_seconds,
        keep_last=cfg.keep_last,
        resume=cfg.resume,
        async_save=cfg.async_checkpoint,
    )


def _announce_resume(console: Console, loaded: Loaded) -> None:
    m = loaded.manifest
    console.line(f"Resumed from {loaded.folder} at epoch {m.epoch + 1}, step {m.step}")
    log.info(
        "resumed",
        path=str(loaded.folder),
        epoch=m.epoch,
        step=m.step,
        batch_in_epoch=m.batch_in_epoch,
        saved_world_size=m.world_size,
    )


@record
def train(cfg: TrainConfig, env: DistEnv) -> int:
    placement = choose_placement(cfg.device, env)
    threads = configure_threads(cfg, env)
    # Fault markers sit beside the checkpoints: a fault fires once per run, across restarts.
    faults = FaultInjector.from_environ(env.rank, cfg.checkpoint_dir / ".faults")
    _tune_cuda(placement)
    console = Console(env)
    with process_group(env, placement, cfg.collective_timeout):
        control = ControlPlane(placement)
        bundle = build_data(cfg, env)
        checkpointer = Checkpointer(checkpoint_config(cfg), env, faults, cfg.fingerprint(), control.group)
        checkpointer.start()
        try:
            loaded = checkpointer.resume()
            attach_rank_log(cfg.log_dir, env)
            log.info("start", threads=threads, device=str(placement.device), version=__version__)
            if loaded is not None and loaded.manifest.finished:
                console.line(
                    f"Training already finished: {loaded.folder} (epoch {loaded.manifest.epoch}); nothing to do."
                )
                console.line("Training completed successfully.")
                return EXIT_OK
            trainer = Trainer(cfg, env, placement, bundle, faults, checkpointer, control)
            if loaded is not None:
                trainer.restore(loaded)
                checkpointer.last_committed_step = loaded.manifest.step
                _announce_resume(console, loaded)
                del loaded
            try:
                summary = trainer.fit()
            finally:
                trainer.close()
                del trainer  # the DDP wrapper holds the process group: drop it before the teardown
        finally:
            checkpointer.close()
        for line in summary.console_lines():
            console.line(line)
        console.line("Training completed successfully.")
        log.info(
            "done", epochs=summary.epochs_run, stopped_early=summary.stopped_early, final_val_acc=summary.final_val_acc
        )
    return EXIT_OK
