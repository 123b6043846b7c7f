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
import contextlib
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import structlog

from elastic_train import __version__
from elastic_train.config import (
    AMP_DTYPES,
    BEST_METRICS,
    DATASETS,
    DATASETS_NEEDING_DIR,
    DEVICES,
    FT_MODES,
    MODEL_CHOICES,
    OPTIMIZERS,
    PARALLEL_MODES,
    TORCHVISION_PREFIX,
    TrainConfig,
    is_model_name,
)
from elastic_train.distributed import usage_memo
from elastic_train.distributed.env import DistEnv
from elastic_train.errors import UsageError, last_usage_error, report_usage_error
from elastic_train.logs import configure_logging, detach_rank_log, file_only, rank_log_path
from elastic_train.outcome import ExitCode

log = structlog.get_logger(__name__)


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
        help="CPU threads per process (0: cores / local processes, or OMP_NUM_THREADS)",
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
        help="quorum mode: seconds a step's collective waits for a silent peer (a frozen node or a cut network "
        "costs the survivors this; a dead peer fails it at once). Raise it if step times vary by more",
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


def check_inputs(cfg: TrainConfig) -> None:
    """What can be checked on disk before any process group or import of torch: every rank
    checks the same paths (shared storage), so every rank fails alike, within a second.
    A ``torchvision:NAME`` model is looked up in torchvision's registry here too: that run
    imports torch a little earlier, nothing more."""
    # From the command line only: a library caller's task (train(cfg, task=...)) may read it.
    if cfg.data_dir is not None and cfg.dataset not in DATASETS_NEEDING_DIR and cfg.task is None:
        raise UsageError(
            f"--data-dir {cfg.data_dir} is given, but --dataset {cfg.dataset} does not read files",
            f"pass --dataset {' or '.join(DATASETS_NEEDING_DIR)} to train on that folder, or drop --data-dir",
        )
    if cfg.data_dir is not None and not cfg.data_dir.is_dir():
        what = "does not exist" if not cfg.data_dir.exists() else "is not a folder"
        raise UsageError(
            f"--data-dir {cfg.data_dir} {what}",
            "pass the folder holding the dataset (for tiny-imagenet: the extracted tree or the .zip's folder)",
        )
    for flag, folder in (("--log-dir", cfg.log_dir), ("--checkpoint-dir", cfg.checkpoint_dir)):
        _check_writable(flag, folder)
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise UsageError(
            f"--resume {cfg.resume} does not exist",
            "pass a checkpoint folder (e.g. checkpoints/step-00000100 or checkpoints/latest), auto or never",
        )
    if cfg.task is not None:
        from elastic_train.task import load_task_factory

        load_task_factory(cfg.task)  # imports the module: a typo fails here, on every rank alike
    if cfg.model.startswith(TORCHVISION_PREFIX):
        from elastic_train.models import registry_name

        registry_name(cfg.model)


def _check_writable(flag: str, folder: Path) -> None:
    """``folder`` exists as a writable folder or can be made one, judged without creating
    anything (bad input writes nothing): its nearest existing ancestor must be a writable folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            f"{flag} {folder} cannot be created: {existing} is a file, not a folder", f"pass a folder path to {flag}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is not writable" if existing == folder else f"cannot be created: {existing} is not writable"
        raise UsageError(f"{flag} {folder} {where}", f"pass a folder you can write to {flag}")


def main(argv: Sequence[str] | None = None) -> int:
    # The launcher's pid, read before anything slow: an agent SIGKILLed while this worker imports
    # torch has re-parented it by the time the parent watch starts (resilience/orphan.py).
    launcher_pid = os.getppid()
    # Until the trainer installs its stop handlers, a Ctrl-C has nothing to save: exit 130 at
    # once, without a KeyboardInterrupt traceback from the middle of an import.
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    # A worker that dies in native code (a segfault, an abort: a bad extension, a SIGABRT from
    # an operator) prints every thread's Python stack first: where it was, not just "Signal 6".
    with contextlib.suppress(ValueError, OSError):  # io.UnsupportedOperation: stderr is no file (embedded)
        faulthandler.enable(all_threads=True)
    env: DistEnv | None = None
    code = 1
    launch = usage_memo.launch_of(launcher_pid)
    earlier: str | None = None
    input_checked = False
    try:
        env = DistEnv.from_environ()
        configure_logging(env)
        if launch is not None and env.launched and env.restart_count:
            earlier = usage_memo.recall(launch)
        if earlier is not None:
            raise UsageError(
                f"{earlier} [met by this launch's first attempt; restart {env.restart_count} was not tried: "
                "retrying cannot fix input]"
            )
        cfg = parse_config(argv)
        check_inputs(cfg)
        # What came before depends on nothing but the flags and the files: no retry can fix it.
        # What follows may (a world size after a node left, storage that answers again).
        input_checked = True
        cfg.check_world_size(env.world_size)
        from elastic_train.run import train  # the torch-heavy part

        code = train(cfg, env, launcher_pid) or ExitCode.OK
        return code
    except UsageError as exc:
        code = ExitCode.USAGE
        report_usage_error(exc, env)
        return ExitCode.USAGE
    except Exception as exc:
        code = 1
        # One line on the console; the traceback goes to the rank log when there is one (and to
        # torchrun's error file through @record on train, for its failure summary). Most crashes
        # under a launcher are a peer's failure seen from here (a collective on a closed socket):
        # a screen of tracebacks from every rank tells a person nothing the first line does not.
        where = rank_log_path()
        if where is None:
            log.exception("crashed")
            raise
        log.exception("crashed", **file_only())
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        rank = env.rank if env is not None else 0
        print(f"elastic-train: rank {rank} failed: {type(exc).__name__}: {first} (traceback: {where})", file=sys.stderr)
        return code
    finally:
        detach_rank_log()
        if code == ExitCode.USAGE and env is not None and env.launched:
            message = last_usage_error()
            if launch is not None and message is not None and earlier is None and not input_checked:
                usage_memo.remember(launch, message)
            _settle_before_usage_exit()


def _interrupted_while_starting(signum: int, frame: object) -> None:
    with contextlib.suppress(OSError):
        os.write(2, b"\nInterrupted while starting: nothing was trained or written by this process; exiting\n")
    os._exit(ExitCode.INTERRUPTED)


# Seconds a rank that found bad input waits before exiting under a launcher. Every rank finds
# the same problem at about the same time; the first to exit makes torchrun SIGTERM the others,
# which would then end with -15 and a "Signal 15" entry instead of the usage code 2.
USAGE_EXIT_SETTLE_S = 1.0


def _settle_before_usage_exit() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent's SIGKILL still ends a rank stuck here
    time.sleep(USAGE_EXIT_SETTLE_S)
