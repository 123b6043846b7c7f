"""Command line: ``python -m elastic_train``, ``torchrun ... -m elastic_train`` or ``elastic-train``.

Launch commands::

    # one process (world size 1), CPU or one GPU
    python -m elastic_train
    # one node, all its GPUs (or N CPU processes)
    torchrun --standalone --nproc_per_node=4 -m elastic_train --model vit --dataset tiny-imagenet \\
        --data-dir /data --batch-size 1024 --epochs 100 --amp
    # elastic, several nodes (see jobs/ and docs/)
    torchrun --nnodes=1:2 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        --rdzv-id=JOB -m elastic_train ...

Exit codes: 0 done, 2 bad input (nothing trained, nothing on disk changed), other: crash.

This module stays free of torch: flags and environment are checked in a fraction of a second,
and only a valid run imports the runtime (``elastic_train.run``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import structlog

from elastic_train import __version__
from elastic_train.config import DATASETS, DEVICES, MODELS, OPTIMIZERS, TrainConfig
from elastic_train.distributed.env import DistEnv
from elastic_train.errors import EXIT_OK, EXIT_USAGE, UsageError
from elastic_train.logs import configure_logging, detach_rank_log

log = structlog.get_logger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Raised, not printed: only rank 0 prints it, every rank exits 2.
        raise UsageError(message, f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(prog="elastic-train", description="Fault-tolerant, elastic DDP training.")
    p.add_argument("--version", action="version", version=f"elastic-train {__version__}")
    seed = p.add_argument_group("training (the seed's flags)")
    seed.add_argument("--model", choices=MODELS, default=d.model)
    seed.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    seed.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="GLOBAL batch size; each of W processes trains on batch-size // W",
    )
    seed.add_argument("--epochs", type=int, default=d.epochs)
    seed.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    seed.add_argument("--base-lr", type=float, default=d.base_lr)
    seed.add_argument(
        "--target-accuracy",
        type=float,
        default=d.target_accuracy,
        help="stop once validation accuracy reaches this fraction",
    )
    seed.add_argument(
        "--patience", type=int, default=d.patience, help="stop after this many epochs without improvement (0: never)"
    )
    seed.add_argument("--seed", type=int, default=d.seed)
    seed.add_argument("--num-workers", type=int, default=d.num_workers, help="DataLoader workers per process")
    seed.add_argument("--amp", action="store_true", help="mixed precision (bf16, or fp16 + loss scaling)")
    ours = p.add_argument_group("runtime")
    ours.add_argument("--data-dir", type=Path, default=None)
    ours.add_argument("--device", choices=DEVICES, default=d.device)
    ours.add_argument("--log-dir", type=Path, default=d.log_dir)
    ours.add_argument("--max-steps-per-epoch", type=int, default=None, help="cap steps per epoch (quick runs)")
    ours.add_argument("--image-size", type=int, default=None, help="resize images to this square size")
    ours.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout,
        help="seconds a collective may wait for a peer before failing",
    )
    ours.add_argument(
        "--hang-timeout",
        type=float,
        default=d.hang_timeout,
        help="seconds without progress before a rank exits (code 124) so torchrun restarts it; 0: off",
    )
    ours.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="CPU threads per process (0: cores / local processes, or OMP_NUM_THREADS)",
    )
    ours.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ours.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint-dir", type=Path, default=d.checkpoint_dir)
    ck.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="also save every N optimizer steps (0: only at epoch ends, the end and on preemption)",
    )
    ck.add_argument(
        "--checkpoint-every-seconds",
        type=float,
        default=d.checkpoint_every_seconds,
        help="also save when this many seconds passed since the last save (0: off)",
    )
    ck.add_argument("--keep-last", type=int, default=d.keep_last, help="committed checkpoints to keep (>= 2)")
    ck.add_argument(
        "--resume",
        default=d.resume,
        help="auto: continue from <checkpoint-dir>/latest if any; never: start fresh; or a folder",
    )
    ck.add_argument(
        "--async-checkpoint",
        action=argparse.BooleanOptionalAction,
        default=d.async_checkpoint,
        help="write checkpoints in a background thread (default) or synchronously",
    )
    return p


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    return TrainConfig(**args)


def main(argv: Sequence[str] | None = None) -> int:
    env: DistEnv | None = None
    try:
        env = DistEnv.from_environ()
        configure_logging(env)
        cfg = parse_config(argv)
        cfg.check_world_size(env.world_size)
        from elastic_train.run import train  # the torch-heavy part

        return train(cfg, env) or EXIT_OK
    except UsageError as exc:
        if env is None or env.is_main:
            print(f"elastic-train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception:
        log.exception("crashed")
        raise
    finally:
        detach_rank_log()
