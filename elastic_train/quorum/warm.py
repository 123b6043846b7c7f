"""The task's data opened once, in the quorum agent's forkserver, for every worker it forks.

A restarted worker's start-up is what its replica group is missing while the survivors train
without it; opening the data is most of it (the synthetic set: ~1.3 s of one core here; a
plug-in task may tokenise a corpus). The agent puts the trainer's flags in ``WARM_ARGV_VAR`` before
its forkserver starts; the forkserver imports this module (a preload), which builds the task and
opens its data then, on one thread. Every worker forked afterwards finds them in memory
(copy-on-write) and ``take`` hands them over when its configuration is the same. Anything that
goes wrong here is left to the worker, which then opens the data itself and reports the problem
the usual way.
"""

from __future__ import annotations

import dataclasses
import json
import os

import structlog

from elastic_train.config import TrainConfig
from elastic_train.quorum.names import WARM_ARGV_VAR
from elastic_train.task import Task, TaskData

log = structlog.get_logger(__name__)


_cache: tuple[TrainConfig, Task, TaskData] | None = None


def _open() -> None:
    global _cache
    raw = os.environ.get(WARM_ARGV_VAR)
    if not raw:
        return
    try:
        import torch

        from elastic_train.flags import parse_config
        from elastic_train.run_parts import choose_task

        cfg = parse_config(json.loads(raw))
        task = choose_task(cfg)
        torch.set_num_threads(1)  # the forkserver's own pool: its children set theirs
        if task.prepare is not None:
            task.prepare()  # idempotent (the task contract): a worker may run it again
        data = task.data()
        identity = data.identify()  # may hash every sample: once, here
        _cache = (cfg, task, dataclasses.replace(data, identity=lambda: identity))
    except BaseException:
        _cache = None


def _same_run(built: TrainConfig, cfg: TrainConfig) -> bool:
    """Whether data built for ``built`` is the data ``cfg`` asks for. The Lighthouse's address
    is left out: the agent hands it to each worker in its environment (``TORCHFT_LIGHTHOUSE``),
    which the forkserver, started before the first worker, never had, and no task reads it. Without
    this every worker missed the cache and opened the data again (0.4-0.7 s of a restart, measured)."""
    return dataclasses.replace(built, lighthouse=None) == dataclasses.replace(cfg, lighthouse=None)


def take(cfg: TrainConfig) -> tuple[Task, TaskData] | None:
    """The forkserver's task and data when they were built for ``cfg``, else None."""
    if _cache is None or not _same_run(_cache[0], cfg):
        return None
    return _cache[1], _cache[2]


_open()
