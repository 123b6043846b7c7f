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

import contextlib
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from elastic_train.config import (
    DATASETS_NEEDING_DIR,
    TORCHVISION_PREFIX,
    TrainConfig,
)
from elastic_train.distributed import usage_memo
from elastic_train.distributed.env import DistEnv
from elastic_train.errors import UsageError, last_usage_error, report_usage_error
from elastic_train.flags import build_parser as build_parser
from elastic_train.flags import parse_config as parse_config
from elastic_train.logs import configure_logging, detach_rank_log, file_only, rank_log_path
from elastic_train.outcome import ExitCode

log = structlog.get_logger(__name__)


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
