"""The command line's flags: the parser and the ``TrainConfig`` it builds. No torch here.

Below everything that starts a run (``cli``, the launchers, the warm and quorum workers parse
the same argv with it), so none of them needs to import another to read the flags.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from elastic_train import __version__
from elastic_train.config import (
    AMP_DTYPES,
    BEST_METRICS,
    DATASETS,
    DEVICES,
    FT_MODES,
    MODEL_CHOICES,
    OPTIMIZERS,
    PARALLEL_MODES,
    TrainConfig,
    is_model_name,
)
from elastic_train.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Raised, not printed: only rank 0 prints it, every rank exits 2.
        raise UsageError(message, f"see `{self.prog} --help`")


def _model_flag(value: str) -> str:
    # argparse's `choices` cannot say "or torchvision:NAME"; same wording as a choices error.
    if not is_model_name(value):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {MODEL_CHOICES})")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(prog="elastic-train", description="Fault-tolerant, elastic DDP training.")
    p.add_argument("--version", action="version", version=f"elastic-train {__version__}")
    seed = p.add_argument_group("training (the seed's flags)")
    seed.add_argument(
        "--model",
        type=_model_flag,
        default=d.model,
        metavar="MODEL",
        help="vit or resnet18 (sized for small images), or torchvision:NAME for any torchvision classification "
        "model (random initial weights, never downloaded), e.g. torchvision:mobilenet_v3_small",
    )
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
    seed.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        help="steps between per-step lines (loss, learning rate, throughput, world size) in <log-dir>/steps.jsonl, "
        "and in TensorBoard when installed (0: off)",
    )
    seed.add_argument(
        "--micro-batch-size",
        type=int,
        default=d.micro_batch_size,
        help="samples per forward/backward pass: each process's share of a step is split into micro-batches "
        "(gradient accumulation; DDP syncs on the last), bounding memory when the world shrinks (0: whole share)",
    )
    ours_amp = p.add_argument_group("precision and reproducibility")
    ours_amp.add_argument(
        "--amp-dtype",
        choices=AMP_DTYPES,
        default=d.amp_dtype,
        help="with --amp: auto (bf16 where the GPU supports it, else fp16 with loss scaling), bf16 or fp16",
    )
    ours_amp.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels only (cuBLAS workspace, no cuDNN autotuning): bitwise-reproducible GPU runs",
    )
    ours = p.add_argument_group("runtime")
    ours.add_argument(
        "--task",
        default=None,
        metavar="MODULE:FUNCTION",
        help="train a plug-in task instead of the built-in image classification: a function "
        "(TrainConfig) -> elastic_train.Task, importable from the working directory or PYTHONPATH "
        "(--model and --dataset are then the task's business); see docs/api.md",
    )
    ours.add_argument("--data-dir", type=Path, default=None)
    ours.add_argument("--device", choices=DEVICES, default=d.device)
    ours.add_argument("--log-dir", type=Path, default=d.log_dir)
    ours.add_argument("--max-steps-per-epoch", type=int, default=None, help="cap steps per epoch (quick runs)")
    ours.add_argument(
        "--max-val-samples",
        type=int,
        default=None,
        metavar="N",
        help="validate on N of the validation samples, spread evenly over the set (quick runs); the "
        "epoch's val metrics, early stop and --keep-best then judge only these (not fingerprinted)",
    )
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
        help="seconds without a finished step or evaluation batch before a rank exits (code 124) so torchrun "
        "restarts it; bounds what a frozen or cut-off peer costs. Raise it if a first step (CUDA/NCCL start, "
        "compilation) can take longer; 0: off",
    )
    ours.add_argument(
        "--stop-grace",
        type=float,
        default=d.stop_grace,
        help="seconds a rank that got SIGTERM/SIGUSR1/SIGUSR2 waits for an agreed step boundary (to checkpoint) "
        "before it exits with code 77 anyway, e.g. when blocked in a collective on a dead peer; 0: no limit",
    )
    ours.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="CPU threads per process (0: cores / local processes, at most 2 on a GPU; or OMP_NUM_THREADS)",
    )
    ours.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ours.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ours.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default=d.parallel,
        help="ddp: every process holds the whole model (the default); fsdp: FSDP2 shards parameters, gradients "
        "and optimizer state over the processes (a model too big for one device), per block plus the root, "
        "and checkpoints are saved in pieces that any world size can load (--ft restart only)",
    )
    ft = p.add_argument_group("fault tolerance")
    ft.add_argument(
        "--ft",
        choices=FT_MODES,
        default=os.environ.get("ELASTIC_TRAIN_FT") or d.ft,
        help="restart: a failure restarts every worker from the last checkpoint (torchrun's semantics); "
        "quorum: the survivors keep training and a restarted worker heals from a live peer (launch with "
        "python -m elastic_train.quorum.launch). Default: $ELASTIC_TRAIN_FT or restart",
    )
    ft.add_argument(
        "--lighthouse",
        default=os.environ.get("TORCHFT_LIGHTHOUSE") or None,
        metavar="URL",
        help="quorum mode: the torchft Lighthouse, http://host:port (default: $TORCHFT_LIGHTHOUSE, which "
        "python -m elastic_train.quorum.launch sets)",
    )
    ft.add_argument(
        "--peer-timeout",
        type=float,
        default=d.peer_timeout,
        help="quorum mode: seconds a step's collective waits for a silent peer, on top of twice the slowest recent "
        "wait (a frozen node or a cut network costs the survivors this; a dead peer fails it at once), and how "
        "long a worker of a replica group may go silent before its group leaves the quorum. Raise it where a "
        "host can stall a worker for longer with no slow collective before it",
    )
    ck = p.add_argument_group("checkpoints")
    ck.add_argument(
        "--run-dir",
        type=Path,
        default=d.run_dir,
        metavar="DIR",
        help="one folder for the run: DIR/logs and DIR/checkpoints (unless --log-dir/--checkpoint-dir are given); "
        "`python -m elastic_train.report DIR` and `python -m elastic_train.ckpt list DIR` take it too",
    )
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
        "--keep-best",
        type=int,
        default=d.keep_best,
        metavar="K",
        help="also keep the K best epoch-end checkpoints by --best-metric, named in <checkpoint-dir>/best.json "
        "(0: off)",
    )
    ck.add_argument(
        "--best-metric",
        choices=tuple(BEST_METRICS),
        default=d.best_metric,
        help="the epoch metric --keep-best ranks by (*_acc: higher is better, *_loss: lower)",
    )
    ck.add_argument(
        "--resume",
        default=d.resume,
        help="auto: continue from <checkpoint-dir>/latest if any; never: start fresh; or a folder",
    )
    ck.add_argument(
        "--init-from",
        type=Path,
        default=d.init_from,
        metavar="PATH",
        help="start from these weights, model only (fresh optimizer): a .safetensors file with the model's names "
        "(e.g. from `python -m elastic_train.ckpt export`) or another run's checkpoint folder/directory; "
        "a run that resumes its own checkpoint ignores it",
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
