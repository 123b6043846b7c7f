"""Run one training job in this process: placement, process group, data, trainer, summary.

``train`` is wrapped in torch's ``@record``: an uncaught exception is written to torchrun's
per-worker error file, so torchrun's failure summary names the rank and the root cause.
"""

from __future__ import annotations

import os
import time
from functools import partial

import structlog
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train import __version__
from elastic_train.boundary import DirectoryLost, FinalCheckpointFailed, SavePolicy, StepBoundary
from elastic_train.checkpoint.init_from import apply_init_weights, read_init_weights
from elastic_train.checkpoint.manager import Checkpointer, Loaded, should_manage_checkpoints
from elastic_train.config import TrainConfig
from elastic_train.data import open_task_data
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.identity import resolve_job
from elastic_train.distributed.process_group import ControlPlane, Placement, choose_placement, process_group
from elastic_train.errors import UsageError, report_usage_error
from elastic_train.faults import CheckpointFaults, FaultInjector
from elastic_train.logs import Console, attach_rank_log, configure_logging
from elastic_train.outcome import (
    ENDS_LAUNCH,
    ExitCode,
    Marker,
    RestartCause,
    clear_markers,
    continue_hint,
    lock_lost_marker,
    previous_exit,
    stop_marker,
    write_marker,
)
from elastic_train.quorum.names import LAUNCHER_THREADS_VAR
from elastic_train.resilience.goodput import Accounting, ProgressTracker, read_progress
from elastic_train.resilience.orphan import ParentWatch
from elastic_train.resilience.peer_progress import job_store
from elastic_train.resilience.preemption import Preempted, PreemptionFlag, StopGrace, StopKind
from elastic_train.resilience.watchdog import StepWatchdog
from elastic_train.run_parts import checkpoint_config as checkpoint_config
from elastic_train.run_parts import choose_task as choose_task
from elastic_train.run_parts import ignored_by as ignored_by
from elastic_train.run_parts import run_fingerprint as run_fingerprint
from elastic_train.startup import StartupClock
from elastic_train.task import Task
from elastic_train.trainer import Trainer

log = structlog.get_logger(__name__)


# A GPU process's own CPU work, in the built-in task, is the kernel-launch loop and each batch's
# collate and pinned copy: small ops, for which a pool of every core costs more in wake-ups than
# it gains. Measured on an H200 host of 16 cores with the synthetic ViT (make gpu-check's
# throughput run, one process, 16 steps an epoch): 16 threads 0.33-0.36 s an epoch, 2 threads
# 0.23-0.29 s, 1 thread 0.26-0.30 s. A task with heavy CPU work in the main process (torch ops on
# the CPU with --num-workers 0) passes --threads.
GPU_PROCESS_THREADS = 2


def configure_threads(cfg: TrainConfig, env: DistEnv, placement: Placement) -> int:
    """Avoid oversubscription: two processes with two threads each on two cores run at half speed.
    A default (no ``--threads``, no OMP_NUM_THREADS of the user's) is the process's share of the
    cores, at most ``GPU_PROCESS_THREADS`` on a GPU."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if cfg.threads:
        return _set_threads(cfg.threads)
    if omp and omp != os.environ.get(LAUNCHER_THREADS_VAR):  # the user's, not the quorum launcher's share
        return _set_threads(int(omp))
    threads = int(omp) if omp else max(1, len(os.sched_getaffinity(0)) // env.local_world_size)
    return _set_threads(min(threads, GPU_PROCESS_THREADS) if placement.is_cuda else threads)


def _set_threads(threads: int) -> int:
    torch.set_num_threads(threads)
    return threads


def _tune_cuda(placement: Placement, deterministic: bool) -> None:
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic results; it reads the variable when
        # it initialises, i.e. before the first matmul on the device.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # warns on an op without a deterministic kernel
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    elif placement.is_cuda:
        torch.backends.cudnn.benchmark = True
    if placement.is_cuda:
        torch.set_float32_matmul_precision("high")


def _warn_ignored_flags(console: Console, cfg: TrainConfig, task: Task) -> None:
    """A plug-in task's run names the flags it was given but does not use (set to other than
    their defaults), instead of accepting them silently."""
    defaults = TrainConfig()
    given = [k for k in ignored_by(task) if getattr(cfg, k) != getattr(defaults, k)]
    if given:
        flags = ", ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in given)
        console.line(f"Ignored with task {task.name}: {flags} (the task builds its own model and data)")
        log.warning("flags_ignored_by_task", task=task.name, flags=given)


def _announce_finished(console: Console, loaded: Loaded, because: str) -> None:
    m = loaded.manifest
    console.line(f"Training already finished: {loaded.folder} (epoch {m.epoch}, step {m.step}): {because}.")
    console.line(
        "Nothing to do. To train on, raise what ended it: --epochs above the epochs done, --target-accuracy "
        "above the accuracy reached, or --patience; to start over, use a new --checkpoint-dir."
    )
    console.line("Training completed successfully.")


def _announce_resume(console: Console, loaded: Loaded, cfg: TrainConfig) -> None:
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
    # Allowed but consequential (a new --base-lr or --epochs reshapes the schedule): say so.
    changes = cfg.changes_since(m.config)
    if changes:
        log.warning(
            "resume_config_changed", changes={key: {"old": old, "new": new} for key, (old, new) in changes.items()}
        )
        listed = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())
        console.line(f"Settings changed since the checkpoint: {listed}")


@record
def train(
    cfg: TrainConfig, env: DistEnv | None = None, launcher_pid: int | None = None, task: Task | None = None
) -> int:
    """The whole run in this process; returns its exit code (``outcome.ExitCode``).

    ``env`` defaults to the launcher's environment (torchrun's, or a world of one); ``task``
    overrides ``cfg.task`` and the built-in image task. Bad input (flags, data, checkpoints)
    returns ``USAGE`` on every rank with one message and no traceback: it is agreed collectively
    where it is found (data, checkpoints), so no rank raises past ``@record`` and gets its peers
    SIGTERMed."""
    library = env is None  # called as a library function, not from the command line
    if env is None:
        env = DistEnv.from_environ()
        configure_logging(env)
    clock = StartupClock(launcher_pid if env.launched else None)
    clock.mark("interpreter_and_imports")
    if env.launched:
        ParentWatch(env.rank, launcher_pid).start()  # a worker whose launcher died must not train on
    # From here on SIGTERM/SIGUSR1/SIGUSR2/SIGINT mean "checkpoint at the next agreed step and exit
    # 76/75/130", or exit 77 after --stop-grace seconds. From the command line they stay installed
    # until the process exits (a signal during the teardown must not turn a clean exit code into
    # -15); a library call gives the caller its handlers back.
    preemption = PreemptionFlag(StopGrace(cfg.stop_grace, env.rank))
    preemption.install()
    try:
        placement = choose_placement(cfg.device, env)
        threads = configure_threads(cfg, env, placement)
        # Fault markers sit beside the checkpoints: a fault fires once per run, across restarts.
        faults = FaultInjector.from_environ(env.rank, cfg.checkpoint_dir / ".faults")
        _tune_cuda(placement, cfg.deterministic)
        if should_manage_checkpoints(env):  # the lock's owner: this job, the same after a restart
            env = resolve_job(env, launcher_pid)
        if cfg.ft == "quorum":
            from elastic_train.quorum.run import train_quorum  # torchft: the optional [ft] extra

            return train_quorum(cfg, env, placement, task, preemption, clock)
        with process_group(env, placement, cfg.collective_timeout):
            clock.mark("process_group")
            return _train_in_group(cfg, env, placement, faults, preemption, threads, clock, task)
    except UsageError as exc:
        report_usage_error(exc, env)
        log.error("exit", code=ExitCode.USAGE, reason="bad input", error=str(exc))
        return ExitCode.USAGE
    finally:
        if library:  # the caller's process goes on: its own Ctrl-C and signals back
            preemption.uninstall()


def _train_in_group(
    cfg: TrainConfig,
    env: DistEnv,
    placement: Placement,
    faults: FaultInjector,
    preemption: PreemptionFlag,
    threads: int,
    clock: StartupClock,
    task: Task | None,
) -> int:
    console = Console(env)
    control = ControlPlane()
    builtin = task is None and cfg.task is None
    task = task if task is not None else choose_task(cfg)
    data = open_task_data(task, cfg, env)
    clock.mark("data")
    fingerprint = run_fingerprint(cfg, task, data.identify(), builtin)
    if not builtin:
        _warn_ignored_flags(console, cfg, task)
    checkpointer = Checkpointer(checkpoint_config(cfg), env, fingerprint, control.group, CheckpointFaults(faults))
    checkpointer.start()
    try:
        loaded = checkpointer.resume()
        clock.mark("checkpoint_load")
        attach_rank_log(cfg.log_dir, env)
        log.info(
            "start",
            threads=threads,
            device=str(placement.device),
            version=__version__,
            job=env.job_id,
            process_started=clock.started,
            startup_s=clock.phases(),
        )
        tracker = _progress_tracker(cfg, env, loaded, clock.launch_started)
        if should_manage_checkpoints(env):
            clear_markers(cfg.checkpoint_dir)  # read by _progress_tracker: they described the previous attempt
        watchdog = StepWatchdog(cfg.hang_timeout, env.rank, marker_dir=cfg.checkpoint_dir)
        checkpointer.heartbeat = watchdog.alive
        if preemption.grace is not None:
            preemption.grace.progress = lambda: watchdog.last_progress
        boundary = StepBoundary(
            checkpointer,
            control,
            SavePolicy(cfg.checkpoint_every, cfg.checkpoint_every_seconds),
            preemption,
            async_save=cfg.async_checkpoint,
            is_main=env.is_main,
        )
        init = None
        if loaded is None and cfg.init_from is not None:  # a resume takes its weights from the checkpoint
            weights, source = read_init_weights(cfg.init_from), cfg.init_from
            init = partial(apply_init_weights, weights=weights, source=source)
            console.line(f"Initial weights from {source} ({len(weights)} tensors; fresh optimizer)")
        trainer = Trainer(cfg, env, placement, task, data, faults, boundary, watchdog, tracker, init=init)
        del init
        if loaded is not None:
            trainer.restore(loaded)
            if loaded.manifest.finished:
                done_because = trainer.finished_because()
                if done_because:
                    _announce_finished(console, loaded, done_because)
                    trainer.close()
                    return ExitCode.OK
                console.line(
                    f"Extending the finished run {loaded.folder} (epoch {loaded.manifest.epoch}) to --epochs "
                    f"{cfg.epochs}: learning rate {trainer.optimizer.param_groups[0]['lr']:.3g} at step "
                    f"{loaded.manifest.step} on the schedule over the new total (docs/checkpoint-format.md)"
                )
            else:
                _announce_resume(console, loaded, cfg)
            del loaded
        watchdog.start()
        if preemption.grace is not None:
            preemption.grace.share_progress(job_store())  # a rank waiting for a progressing peer is not ended
        try:
            summary = trainer.fit()
            preemption.acknowledge()  # the final checkpoint is committed: a late signal changes nothing
        except Preempted as exc:
            return _exit_preempted(cfg, env, console, preemption, exc)
        except DirectoryLost as exc:
            return _exit_lock_lost(cfg, env, console, exc)
        except FinalCheckpointFailed as exc:
            return _exit_final_checkpoint_failed(cfg, console, exc)
        finally:
            watchdog.stop()
            if preemption.grace is not None:
                preemption.grace.stop_sharing()  # before the store goes away with the process group
            trainer.close()
            del trainer  # the DDP wrapper holds the process group: drop it before the teardown
    finally:
        checkpointer.close()
    for line in summary.console_lines():
        console.line(line)
    for line in tracker.accounting.summary_lines(summary.productive_time, time.time()):
        console.line(line)
    console.line("Training completed successfully.")
    acct = tracker.accounting
    log.info(
        "done",
        epochs=summary.epochs_run,
        stopped_early=summary.stopped_early,
        final_val_acc=summary.final_val_acc,
        goodput=acct.goodput(summary.productive_time, time.time()),
        restarts=acct.restarts,
        lost_s=acct.lost_s,
        recomputed_steps=acct.recomputed_steps,
    )
    return ExitCode.OK


def _progress_tracker(cfg: TrainConfig, env: DistEnv, loaded: Loaded | None, launch_started: float) -> ProgressTracker:
    """The job's goodput bookkeeping: inherited from the checkpoint, plus this recovery if any.

    A deliberate ``--resume PATH`` from another directory starts a new job from that state (a
    fine-tune, a branch): no recovery is booked, and its clock starts now, not at the old job's."""
    if loaded is not None and _started_elsewhere(cfg, loaded):
        loaded = None
    previous = read_progress(cfg.checkpoint_dir) if loaded is not None else None
    saved = loaded.payload.accounting if loaded is not None else None
    if saved:
        accounting = Accounting.from_json(saved)
    else:
        accounting = Accounting(job_start=float(previous["job_start"]) if previous else time.time())
    tracker = ProgressTracker(cfg.checkpoint_dir, accounting, enabled=should_manage_checkpoints(env))
    if loaded is not None and loaded.manifest.finished:
        # A finished run extended (more --epochs): a new launch, not a recovery; the time since
        # it finished lay between launches.
        accounting.away_s += max(0.0, launch_started - loaded.manifest.created)
    elif loaded is not None:
        since = float(previous["time"]) if previous else 0.0
        # Before clear_markers (the caller's next step): the markers say how that attempt ended.
        marker = previous_exit(cfg.checkpoint_dir, since) if should_manage_checkpoints(env) else None
        cause = marker.cause if marker is not None else RestartCause.FAILURE
        # A launch that ended (Ctrl-C, a preemption) and this one: the time between is nobody's.
        away = launch_started - marker.time if marker is not None and cause in ENDS_LAUNCH else 0.0
        tracker.begin_recovery(cause, loaded.manifest.step, previous, away_s=max(0.0, away))
        log.info(
            "recovery",
            cause=cause,
            resumed_step=loaded.manifest.step,
            reached_step=previous["step"] if previous else None,
            between_launches_s=round(max(0.0, away), 3),
        )
    return tracker


def _started_elsewhere(cfg: TrainConfig, loaded: Loaded) -> bool:
    """``--resume PATH`` named a checkpoint outside this run's ``--checkpoint-dir``."""
    if cfg.resume in ("auto", "never"):
        return False
    try:
        return loaded.folder.resolve().parent != cfg.checkpoint_dir.resolve()
    except OSError:
        return False


def _exit_preempted(cfg: TrainConfig, env: DistEnv, console: Console, flag: PreemptionFlag, exc: Preempted) -> int:
    signal_name = flag.signal_name or "a peer's signal"
    code = exc.kind.exit_code
    if should_manage_checkpoints(env):  # committed or not: the job script requeues on it either way
        _write_marker(cfg, stop_marker(exc.kind.cause, exc.step, signal_name, exc.committed))
    state = "checkpoint committed" if exc.committed else "CHECKPOINT FAILED (the previous one is kept)"
    console.line(f"{exc.kind.verb} by {signal_name} at step {exc.step}: {state}; exiting with code {code}")
    if exc.kind is StopKind.INTERRUPT:
        console.line(continue_hint(cfg.checkpoint_dir))
    log.warning("exit", code=code, reason=exc.kind.verb.lower(), step=exc.step, committed=exc.committed)
    return code


def _exit_final_checkpoint_failed(cfg: TrainConfig, console: Console, exc: FinalCheckpointFailed) -> int:
    code = ExitCode.FINAL_CHECKPOINT_FAILED
    for line in exc.console_lines(cfg.checkpoint_dir):
        console.line(line)
    log.error("exit", code=code, reason="final_checkpoint_failed", step=exc.step)
    return code


def _exit_lock_lost(cfg: TrainConfig, env: DistEnv, console: Console, exc: DirectoryLost) -> int:
    code = ExitCode.LOCK_LOST
    if should_manage_checkpoints(env):
        _write_marker(cfg, lock_lost_marker(exc.step))
    console.line(f"Stopped at step {exc.step}: {exc}; exiting with code {int(code)}")
    log.error("exit", code=code, reason="lock_lost", step=exc.step, error=str(exc))
    return code


def _write_marker(cfg: TrainConfig, marker: Marker) -> None:
    """Write ``marker``, logging a failure: the storage that failed a stop checkpoint may fail
    this write too, and the exit code must still be the one that says what happened."""
    try:
        write_marker(cfg.checkpoint_dir, marker)
    except OSError as exc:
        log.error("marker_write_failed", marker=marker.file_name, error=repr(exc))
