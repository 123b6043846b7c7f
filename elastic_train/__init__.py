"""elastic-train: fault-tolerant, elastic DDP training for PyTorch (torchrun and Slurm).

Three ways in (docs/api.md documents every name below):

* the command line, ``torchrun ... -m elastic_train`` with the built-in image task or
  ``--task package.module:function`` returning a ``Task``;
* a ``Task`` of your own, run by the built-in trainer (``train``);
* your own loop, built from the same pieces the trainer is built from: ``GlobalBatchSampler``,
  ``Checkpointer`` with ``capture``/``restore``, ``StepBoundary``, ``PreemptionFlag``,
  ``StepWatchdog``, ``FaultInjector``, ``ProgressTracker``; in either fault-tolerance mode
  through ``LoopSteps`` (``RestartSteps``, ``QuorumSteps``).

Names are imported on first use (PEP 562), so ``python -m elastic_train --help`` and the checks
of bad flags stay free of torch's import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# Public name -> the module that defines it. The API is this table: a test holds it, __all__
# and docs/api.md equal, and checks every entry imports.
_EXPORTS: dict[str, str] = {
    # configuration and the runtime
    "TrainConfig": "elastic_train.config",
    "train": "elastic_train.run",
    "Trainer": "elastic_train.trainer",
    "StepStrategy": "elastic_train.strategy",
    "RestartStrategy": "elastic_train.strategy",
    "Attempt": "elastic_train.strategy",
    "Share": "elastic_train.strategy",
    "no_gradient_sync": "elastic_train.strategy",
    # a loop of your own, in either mode
    "LoopSteps": "elastic_train.steps",
    "RestartSteps": "elastic_train.steps",
    "QuorumSteps": "elastic_train.steps",
    "QuorumSchedule": "elastic_train.quorum.schedule",
    "StepShare": "elastic_train.quorum.schedule",
    "StepAttempt": "elastic_train.quorum.replica",
    "Heal": "elastic_train.quorum.replica",
    "Replica": "elastic_train.quorum.replica",
    "ReplicaConfig": "elastic_train.quorum.replica",
    # plug-in tasks
    "Task": "elastic_train.task",
    "TaskData": "elastic_train.task",
    "ExtraState": "elastic_train.task",
    "cross_entropy": "elastic_train.task",
    "argmax_correct": "elastic_train.task",
    "image_task": "elastic_train.image_classification",
    "build_model": "elastic_train.models",
    # processes and groups
    "DistEnv": "elastic_train.distributed.env",
    "Placement": "elastic_train.distributed.process_group",
    "choose_placement": "elastic_train.distributed.process_group",
    "process_group": "elastic_train.distributed.process_group",
    "ControlPlane": "elastic_train.distributed.process_group",
    "shard_model": "elastic_train.distributed.fsdp",
    "replicate": "elastic_train.distributed.ddp",
    "mesh_for": "elastic_train.distributed.fsdp",
    "default_blocks": "elastic_train.distributed.fsdp",
    "reshard_all": "elastic_train.distributed.fsdp",
    # data
    "GlobalBatchSampler": "elastic_train.data.sampler",
    "EvalBatchSampler": "elastic_train.data.sampler",
    "Indexed": "elastic_train.data",
    "MetricSums": "elastic_train.metrics",
    "Totals": "elastic_train.metrics",
    # checkpoints
    "Checkpointer": "elastic_train.checkpoint.manager",
    "CheckpointConfig": "elastic_train.checkpoint.manager",
    "SaveHooks": "elastic_train.checkpoint.manager",
    "Loaded": "elastic_train.checkpoint.manager",
    "Snapshot": "elastic_train.checkpoint.snapshot",
    "Position": "elastic_train.checkpoint.snapshot",
    "Restored": "elastic_train.checkpoint.snapshot",
    "capture": "elastic_train.checkpoint.snapshot",
    "restore": "elastic_train.checkpoint.snapshot",
    "Payload": "elastic_train.checkpoint.format",
    "CheckpointInvalid": "elastic_train.checkpoint.format",
    # the step boundary and stop signals
    "StepBoundary": "elastic_train.boundary",
    "SavePolicy": "elastic_train.boundary",
    "Decision": "elastic_train.boundary",
    "Votes": "elastic_train.boundary",
    "FinalCheckpointFailed": "elastic_train.boundary",
    "PreemptionFlag": "elastic_train.resilience.preemption",
    "StopGrace": "elastic_train.resilience.preemption",
    "StopKind": "elastic_train.resilience.preemption",
    "Preempted": "elastic_train.resilience.preemption",
    # hangs, faults, goodput, outcomes
    "StepWatchdog": "elastic_train.resilience.watchdog",
    "FaultInjector": "elastic_train.faults",
    "CheckpointFaults": "elastic_train.faults",
    "InjectedFault": "elastic_train.faults",
    "Accounting": "elastic_train.resilience.goodput",
    "ProgressTracker": "elastic_train.resilience.goodput",
    "ExitCode": "elastic_train.outcome",
    "RestartCause": "elastic_train.outcome",
    "configure_logging": "elastic_train.logs",
    "UsageError": "elastic_train.errors",
    "DataError": "elastic_train.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # what type checkers see: the same names, eagerly (`as` marks a re-export)
    from elastic_train.boundary import Decision as Decision
    from elastic_train.boundary import FinalCheckpointFailed as FinalCheckpointFailed
    from elastic_train.boundary import SavePolicy as SavePolicy
    from elastic_train.boundary import StepBoundary as StepBoundary
    from elastic_train.boundary import Votes as Votes
    from elastic_train.checkpoint.format import CheckpointInvalid as CheckpointInvalid
    from elastic_train.checkpoint.format import Payload as Payload
    from elastic_train.checkpoint.manager import CheckpointConfig as CheckpointConfig
    from elastic_train.checkpoint.manager import Checkpointer as Checkpointer
    from elastic_train.checkpoint.manager import Loaded as Loaded
    from elastic_train.checkpoint.manager import SaveHooks as SaveHooks
    from elastic_train.checkpoint.snapshot import Position as Position
    from elastic_train.checkpoint.snapshot import Restored as Restored
    from elastic_train.checkpoint.snapshot import Snapshot as Snapshot
    from elastic_train.checkpoint.snapshot import capture as capture
    from elastic_train.checkpoint.snapshot import restore as restore
    from elastic_train.config import TrainConfig as TrainConfig
    from elastic_train.data import Indexed as Indexed
    from elastic_train.data.sampler import EvalBatchSampler as EvalBatchSampler
    from elastic_train.data.sampler import GlobalBatchSampler as GlobalBatchSampler
    from elastic_train.distributed.ddp import replicate as replicate
    from elastic_train.distributed.env import DistEnv as DistEnv
    from elastic_train.distributed.fsdp import default_blocks as default_blocks
    from elastic_train.distributed.fsdp import mesh_for as mesh_for
    from elastic_train.distributed.fsdp import reshard_all as reshard_all
    from elastic_train.distributed.fsdp import shard_model as shard_model
    from elastic_train.distributed.process_group import ControlPlane as ControlPlane
    from elastic_train.distributed.process_group import Placement as Placement
    from elastic_train.distributed.process_group import choose_placement as choose_placement
    from elastic_train.distributed.process_group import process_group as process_group
    from elastic_train.errors import DataError as DataError
    from elastic_train.errors import UsageError as UsageError
    from elastic_train.faults import CheckpointFaults as CheckpointFaults
    from elastic_train.faults import FaultInjector as FaultInjector
    from elastic_train.faults import InjectedFault as InjectedFault
    from elastic_train.image_classification import image_task as image_task
    from elastic_train.logs import configure_logging as configure_logging
    from elastic_train.metrics import MetricSums as MetricSums
    from elastic_train.metrics import Totals as Totals
    from elastic_train.models import build_model as build_model
    from elastic_train.outcome import ExitCode as ExitCode
    from elastic_train.outcome import RestartCause as RestartCause
    from elastic_train.quorum.replica import Heal as Heal
    from elastic_train.quorum.replica import Replica as Replica
    from elastic_train.quorum.replica import ReplicaConfig as ReplicaConfig
    from elastic_train.quorum.replica import StepAttempt as StepAttempt
    from elastic_train.quorum.schedule import QuorumSchedule as QuorumSchedule
    from elastic_train.quorum.schedule import StepShare as StepShare
    from elastic_train.resilience.goodput import Accounting as Accounting
    from elastic_train.resilience.goodput import ProgressTracker as ProgressTracker
    from elastic_train.resilience.preemption import Preempted as Preempted
    from elastic_train.resilience.preemption import PreemptionFlag as PreemptionFlag
    from elastic_train.resilience.preemption import StopGrace as StopGrace
    from elastic_train.resilience.preemption import StopKind as StopKind
    from elastic_train.resilience.watchdog import StepWatchdog as StepWatchdog
    from elastic_train.run import train as train
    from elastic_train.steps import LoopSteps as LoopSteps
    from elastic_train.steps import QuorumSteps as QuorumSteps
    from elastic_train.steps import RestartSteps as RestartSteps
    from elastic_train.strategy import Attempt as Attempt
    from elastic_train.strategy import RestartStrategy as RestartStrategy
    from elastic_train.strategy import Share as Share
    from elastic_train.strategy import StepStrategy as StepStrategy
    from elastic_train.strategy import no_gradient_sync as no_gradient_sync
    from elastic_train.task import ExtraState as ExtraState
    from elastic_train.task import Task as Task
    from elastic_train.task import TaskData as TaskData
    from elastic_train.task import argmax_correct as argmax_correct
    from elastic_train.task import cross_entropy as cross_entropy
    from elastic_train.trainer import Trainer as Trainer
