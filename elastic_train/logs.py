"""Logging: structlog configured once per process, the seed's console lines, the metrics file.

* ``<log-dir>/rank-<r>.jsonl``: every event of rank ``r`` as a JSON line, bound with rank, world
  size, restart count and run id (appended across restarts: one file tells a rank's whole story).
* stderr: human-readable events, all levels on rank 0, warnings and errors on the other ranks.
* stdout, rank 0 only: exactly the seed's lines (``Training started with N processes``, the epoch
  lines, the ``Training Summary`` block), printed by ``Console``.
* ``<log-dir>/metrics.jsonl``: one JSON object per epoch, written by rank 0.

The file sink is attached only after the inputs were validated, so a run rejected for bad
flags or data leaves the log directory untouched.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import structlog
from structlog.typing import EventDict, WrappedLogger

from elastic_train.distributed.env import DistEnv, should_print_console, should_write_metrics

# Context keys every JSON line carries but the console leaves out (they are the same all run).
_CONTEXT_KEYS = ("rank", "world_size", "restart", "run_id")
_CONSOLE_FLAG = "_console"


class _JsonFileSink:
    """A processor that appends the full event to the rank's JSONL file, once attached."""

    def __init__(self) -> None:
        self.stream: IO[str] | None = None

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        if self.stream is not None:
            record = {k: v for k, v in event.items() if k != _CONSOLE_FLAG}
            self.stream.write(json.dumps(record, default=str) + "\n")
            self.stream.flush()
        return event


class _ConsoleFilter:
    """Drop what the console should not show; strip the bound context for readability."""

    def __init__(self, main: bool) -> None:
        self.main = main

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        level = logging.getLevelNamesMapping().get(str(event.get("level", "info")).upper(), logging.INFO)
        if not event.pop(_CONSOLE_FLAG, True) or (not self.main and level < logging.WARNING):
            raise structlog.DropEvent
        for key in _CONTEXT_KEYS:
            if key != "rank" or self.main:
                event.pop(key, None)
        return event


_sink = _JsonFileSink()


def configure_logging(env: DistEnv) -> None:
    """Configure structlog for this process and bind the rank context."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        rank=env.rank, world_size=env.world_size, restart=env.restart_count, run_id=env.run_id
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _sink,
            _ConsoleFilter(should_print_console(env)),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def parse_timestamp(stamp: Any) -> float | None:
    """Seconds since the epoch of an event's ``timestamp`` (ISO 8601, UTC, as logged); None if unreadable."""
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def attach_rank_log(log_dir: Path, env: DistEnv, name: str | None = None) -> Path:
    """Mirror this process's structured log into ``<log_dir>/rank-<rank>.jsonl`` (or ``name``:
    quorum mode names it by replica group, every replica being rank 0 of its own world)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / (name or f"rank-{env.rank}.jsonl")
    if _sink.stream is not None:
        _sink.stream.close()
    _sink.stream = path.open("a", encoding="utf-8")
    return path


def rank_log_path() -> Path | None:
    """The rank log this process writes now, if one is attached."""
    return Path(_sink.stream.name) if _sink.stream is not None else None


def detach_rank_log() -> None:
    if _sink.stream is not None:
        _sink.stream.close()
        _sink.stream = None


def file_only(**fields: Any) -> dict[str, Any]:
    """Extra fields for an event that goes to the JSON log but not to the console."""
    return {_CONSOLE_FLAG: False, **fields}


class Console:
    """The seed's stdout lines, printed by rank 0 only."""

    def __init__(self, env: DistEnv) -> None:
        self.enabled = should_print_console(env)

    def line(self, text: str, always: bool = False) -> None:
        """``always``: print even where this process is not the speaker (quorum mode: the line
        of an epoch goes out from whichever replica wrote it to ``metrics.jsonl``)."""
        if self.enabled or always:
            print(text, flush=True)


class MetricsFile:
    """``metrics.jsonl``: appended by rank 0, one object per epoch, flushed and fsynced."""

    def __init__(self, log_dir: Path, env: DistEnv) -> None:
        self.path = log_dir / "metrics.jsonl"
        self.enabled = should_write_metrics(env)

    def append_once(self, record: dict[str, Any], key: tuple[str, ...], since: float) -> bool:
        """Append ``record`` unless a line written at or after ``since`` already has its values
        under ``key``: several writers (quorum mode: every replica that committed an epoch's
        evaluation round) leave exactly one line, whichever of them committed. An exclusive
        ``flock`` orders the writers on one host; True when this call wrote the line."""
        if not self.enabled:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        wanted = tuple(record.get(k) for k in key)
        with self.path.open("a+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.seek(0)
            for line in fh:
                try:
                    old = json.loads(line)
                except ValueError:
                    continue  # a torn line of a killed writer
                if isinstance(old, dict) and old.get("time", 0) >= since and tuple(old.get(k) for k in key) == wanted:
                    return False
            self._write(fh, record)
            return True

    def append(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            self._write(fh, record)

    @staticmethod
    def _write(fh: IO[str], record: dict[str, Any]) -> None:
        fh.write(json.dumps({"time": time.time(), **record}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
