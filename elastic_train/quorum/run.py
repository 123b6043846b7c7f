"""One replica group's worker in quorum mode (``--ft quorum``): ``run.train`` hands over here.

The replica group is the worker's world for torch.distributed: a world of one by default (its
checkpoint collectives are trivial; a HashStore, no port), or K workers with DDP or FSDP2
inside (``--procs-per-replica K``: they meet in their agent's store). For torchft it is one
replica group: ``Replica`` joins the quorum through the Lighthouse. Its agent
(``elastic_train.quorum.launch``) sets ``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE`` and the job
id shared by every replica (the checkpoint lock's owner).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import timedelta
from functools import partial

import structlog
import torch
import torch.distributed as dist

from elastic_train import __version__
from elastic_train.boundary import FinalCheckpointFailed
from elastic_train.checkpoint.format import latest_target
from elastic_train.checkpoint.init_from import apply_init_weights, read_init_weights
from elastic_train.checkpoint.manager import Checkpointer
from elastic_train.config import TrainConfig
from elastic_train.data import open_task_data
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import Placement
from elastic_train.errors import UsageError
from elastic_train.faults import CheckpointFaults, FaultInjector
from elastic_train.logs import Console, MetricsFile, attach_rank_log
from elastic_train.outcome import ExitCode, continue_hint, stop_marker, write_stop_marker
from elastic_train.quorum import warm
from elastic_train.quorum.group_comm import GroupComm
from elastic_train.quorum.line import ledger_from_env
from elastic_train.quorum.names import GROUPS_VAR
from elastic_train.quorum.replica import Replica, ReplicaConfig
from elastic_train.quorum.strategy import QuorumStrategy, Rejoin
from elastic_train.quorum.timeouts import phase_bounds
from elastic_train.resilience.preemption import Preempted, PreemptionFlag, StopKind
from elastic_train.resilience.watchdog import StepWatchdog
from elastic_train.run_parts import checkpoint_config, choose_task, run_fingerprint
from elastic_train.startup import StartupClock
from elastic_train.step_log import StepLog
from elastic_train.task import Task
from elastic_train.trainer import Trainer

log = structlog.get_logger(__name__)


def replica_config(cfg: TrainConfig) -> ReplicaConfig:
    if not cfg.lighthouse:
        raise UsageError(
            "--ft quorum needs a Lighthouse and none is set",
            "launch with python -m elastic_train.quorum.launch (it starts one), or pass --lighthouse "
            "http://host:port / set TORCHFT_LIGHTHOUSE",
        )
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    if not group.isdigit():
        raise UsageError(f"REPLICA_GROUP_ID={group!r} is not a group index", "number the replica groups 0, 1, 2, ...")
    bounds = phase_bounds(cfg.hang_timeout)  # UsageError: a watchdog too short for a quorum and a heal
    try:
        return ReplicaConfig(
            cfg.lighthouse,
            int(group),
            # A dead peer's closed socket fails a collective at once; a frozen one (SIGSTOP, a cut
            # network) holds it until this timeout: the survivors' cost of a node loss.
            collective_timeout_s=cfg.peer_timeout,
            # The same bound inside a replica group of several workers: a worker whose liveness
            # counter stood still this long is taken for frozen and its group leaves the quorum.
            peer_silence_s=cfg.peer_timeout,
            # A quorum wait and the heal after it are one phase for the step watchdog (it beats
            # before each quorum): both end inside its limit (``phase_bounds``).
            quorum_timeout_s=bounds.quorum_s,
            # The state transfer to a healing peer (and the sender's wait for it): grows with the
            # state; torchft's default 10 s would fail a multi-GB heal.
            timeout_s=bounds.heal_s,
        )
    except ValueError as exc:
        raise UsageError(str(exc), "pass --lighthouse http://host:port") from None


def train_quorum(
    cfg: TrainConfig,
    env: DistEnv,
    placement: Placement,
    task: Task | None,
    preemption: PreemptionFlag,
    clock: StartupClock | None = None,
) -> int:
    """The whole run of this replica group's worker; returns its exit code. ``task`` None: the
    one ``cfg`` names (built in, or ``--task``), taken from the forkserver when it opened it."""
    if cfg.parallel == "fsdp" and env.world_size == 1:
        raise UsageError(
            "--parallel fsdp in quorum mode shards the model inside a replica group, and this group has one worker",
            "launch with python -m elastic_train.quorum.launch --procs-per-replica 2 (or more), or use --parallel ddp",
        )
    config = replica_config(cfg)
    if placement.is_cuda:  # torchft's streams and syncs use the current device: this replica's GPU
        torch.cuda.set_device(placement.device)
    timeout = timedelta(seconds=cfg.collective_timeout)
    if env.world_size == 1:  # a group of one worker: a world of one, no port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)  # type: ignore[attr-defined]
    else:
        # The replica group's K workers (DDP or FSDP2 inside it) meet in their agent's store
        # (MASTER_ADDR/PORT: torchrun's, or the quorum agent's for --procs-per-replica).
        dist.init_process_group(placement.backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    try:
        return _run(cfg, env, placement, task, preemption, config, clock or StartupClock())
    finally:
        dist.destroy_process_group()


def _run(
    cfg: TrainConfig,
    env: DistEnv,
    placement: Placement,
    task: Task | None,
    preemption: PreemptionFlag,
    config: ReplicaConfig,
    clock: StartupClock,
) -> int:
    cached = warm.take(cfg) if task is None else None
    if cached is not None:
        # Opened by the agent's forkserver before this worker was forked: the checks, the
        # identity and the (world-of-one) agreement still run, on the data in memory.
        task, ready = cached
        data = open_task_data(dataclasses.replace(task, prepare=None, data=lambda: ready), cfg, env)
    else:
        task = task if task is not None else choose_task(cfg)
        data = open_task_data(task, cfg, env)
    clock.mark("data")
    fingerprint = run_fingerprint(cfg, task, data.identify(), cfg.task is None)
    # The fault hooks reach the writer too (a slow or failing save of participant 0's).
    faults = FaultInjector.from_environ(config.replica_group, cfg.checkpoint_dir / ".faults")
    checkpointer = Checkpointer(checkpoint_config(cfg), env, fingerprint, hooks=CheckpointFaults(faults))
    try:  # refuse a directory another job holds now; read-only: this job's current saver keeps it
        checkpointer.lock.check_available()
    except OSError as exc:
        raise UsageError(
            f"--checkpoint-dir {cfg.checkpoint_dir} cannot be used: {exc}", "pass a writable folder"
        ) from None
    # One log per worker: "replica_<group>.jsonl", and ".rank<r>" in a group of several workers.
    name = config.replica_id if env.world_size == 1 else f"{config.replica_id}.rank{env.rank}"
    attach_rank_log(cfg.log_dir, env, f"{name}.jsonl")
    log.info(
        "start",
        mode="quorum",
        replica=config.replica_id,
        group_rank=env.rank,
        restart=env.restart_count,
        version=__version__,
        device=str(placement.device),
        warm_data=cached is not None,  # the data came from the agent's forkserver (``warm``)
        process_started=clock.started,
        startup_s=clock.phases(),
    )
    console, metrics = Console(env), MetricsFile(cfg.log_dir, env)
    # Each worker's hang marker is named by its place in the job (group x K + group rank), else
    # one replica's marker would overwrite another's.
    worker = config.replica_group * env.world_size + env.rank
    watchdog = StepWatchdog(cfg.hang_timeout, worker, marker_dir=cfg.checkpoint_dir)
    checkpointer.heartbeat = watchdog.alive
    if preemption.grace is not None:
        preemption.grace.progress = lambda: watchdog.last_progress
    groups = int(os.environ.get(GROUPS_VAR, "1"))
    workers = groups * env.world_size
    if workers > cfg.batch_size:  # a full quorum would leave a worker without a sample
        if env.world_size == 1:
            raise UsageError(
                f"{groups} replica groups cannot share a global batch of {cfg.batch_size}: each needs a sample",
                f"pass --batch-size {groups} or more, or launch {cfg.batch_size} replica groups or fewer",
            )
        raise UsageError(
            f"{groups} replica groups of {env.world_size} workers cannot share a global batch of "
            f"{cfg.batch_size}: each worker needs a sample",
            f"pass --batch-size {workers} or more, or launch fewer replica groups or workers per group",
        )
    comm = GroupComm.of_default_group()
    ledger = ledger_from_env(config.job)  # the line record, when the agent moves the Lighthouse by a lease
    strategy = QuorumStrategy(cfg, checkpointer, preemption, watchdog, groups, faults, clock.started, comm, ledger)
    init = None
    if cfg.init_from is not None and latest_target(cfg.checkpoint_dir) is None:
        # --init-from on a fresh job: every replica the same weights (no checkpoint yet; once
        # there is one, the line starts from it, and a late replica heals from a peer).
        init = partial(apply_init_weights, weights=read_init_weights(cfg.init_from), source=cfg.init_from)
    trainer = Trainer(
        cfg,
        env,
        placement,
        task,
        data,
        faults,
        watchdog=watchdog,
        init=init,
        strategy=strategy,
        console=console,
        metrics_file=metrics,
        step_log=StepLog(cfg.log_dir, cfg.log_every, True, cfg.batch_size),  # each step's participant 0 writes
        checkpointer=checkpointer,
    )
    # The Manager (and its heartbeat to the Lighthouse) starts only now, with the model built: a
    # replica that heartbeats but has not asked to join would hold every quorum up (join timeout).
    replica = Replica(config)
    strategy.attach(replica)
    watchdog.start()
    try:
        summary = trainer.fit()
        preemption.acknowledge()
    except Rejoin as exc:
        # Exit so that the agent restarts this worker: it heals from the quorum's live replicas.
        print(f"[{config.replica_id}] leaving the quorum to heal from a live peer: {exc}", file=sys.stderr, flush=True)
        log.error("rejoin", code=int(ExitCode.QUORUM_STATE_UNSAFE), reason=str(exc))
        return ExitCode.QUORUM_STATE_UNSAFE
    except FinalCheckpointFailed as exc:
        for line in exc.console_lines(cfg.checkpoint_dir):
            console.line(line)
        log.error("exit", code=int(ExitCode.FINAL_CHECKPOINT_FAILED), reason="final_checkpoint_failed", step=exc.step)
        return ExitCode.FINAL_CHECKPOINT_FAILED
    except Preempted as exc:
        code = exc.kind.exit_code
        try:  # a failed stop save too; it never hides a peer replica's committed one
            marker = stop_marker(exc.kind.cause, exc.step, preemption.signal_name or "", exc.committed)
            write_stop_marker(cfg.checkpoint_dir, marker)
        except OSError as err:
            log.error("marker_write_failed", error=repr(err))
        state = (
            "checkpoint committed"
            if exc.committed
            else "CHECKPOINT FAILED or taken by a peer (the previous one is kept)"
        )
        console.line(f"{exc.kind.verb} at step {exc.step}: {state}; exiting with code {code}")
        if exc.kind is StopKind.INTERRUPT:
            console.line(continue_hint(cfg.checkpoint_dir))
        log.warning("exit", code=code, step=exc.step, committed=exc.committed)
        return code
    finally:
        watchdog.stop()
        trainer.close()  # the worker ends with os._exit: TensorBoard's buffer first
        replica.close()
        checkpointer.close()
    for line in summary.console_lines():
        console.line(line)
    accounting = strategy.accounting()
    for line in accounting.summary_lines(summary.productive_time, time.time()):
        console.line(line)
    console.line("Training completed successfully.")
    log.info(
        "done",
        epochs=summary.epochs_run,
        stopped_early=summary.stopped_early,
        final_val_acc=summary.final_val_acc,
        goodput=accounting.goodput(summary.productive_time, time.time()),
        restarts=accounting.restarts,
        lost_s=accounting.lost_s,
        recomputed_steps=accounting.recomputed_steps,
        step=trainer.state.step,
        weights_sha256=strategy.weights_sha256(),
    )
    return ExitCode.OK
