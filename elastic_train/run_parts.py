"""What a run is made of, from its flags: the task, the checkpoint settings, the fingerprint.

Shared by both fault-tolerance modes (``run`` and ``quorum.run``) and the warm worker, below all
of them: none imports another to build the same parts.
"""

from __future__ import annotations

from elastic_train.checkpoint.manager import CheckpointConfig
from elastic_train.config import TASK_IGNORES, TrainConfig
from elastic_train.image_classification import image_task
from elastic_train.task import Task, build_task


def checkpoint_config(cfg: TrainConfig) -> CheckpointConfig:
    return CheckpointConfig(
        root=cfg.checkpoint_dir,
        keep_last=cfg.keep_last,
        resume=cfg.resume,
        hang_timeout=cfg.hang_timeout,
        keep_best=cfg.keep_best,
        best_metric=cfg.best_metric,
    )


def choose_task(cfg: TrainConfig) -> Task:
    """``--task`` (a plug-in) or the built-in image classification of ``--model``/``--dataset``."""
    return build_task(cfg.task, cfg) if cfg.task is not None else image_task(cfg)


def run_fingerprint(cfg: TrainConfig, task: Task, identity: dict[str, object], builtin: bool) -> dict[str, object]:
    """What a resumed run must share with its checkpoint: the settings, the data, the task's own
    (and its name, unless it is the built-in image task, whose fingerprint predates tasks): the
    same task resumes whether it came from --task or from ``train(cfg, task=...)``."""
    own = {f"task.{key}": value for key, value in task.fingerprint.items()}
    settings = cfg.fingerprint(identity)
    if not builtin:
        own["task.name"] = task.name
        for key in ignored_by(task):  # flags the task does not use cannot refuse its resume
            settings.pop(key, None)
    return {**settings, **own}


def ignored_by(task: Task) -> tuple[str, ...]:
    """The flags a plug-in task does not use (``config.TASK_IGNORES``, and ``optimizer`` when it
    brings its own)."""
    return (*TASK_IGNORES, "optimizer") if task.optimizer is not None else TASK_IGNORES
