"""One run per checkpoint directory: a lock file with a heartbeat.

``<checkpoint-dir>/.lock`` holds the owner (run id, host, pid) and a heartbeat refreshed every
``HEARTBEAT_S`` by a daemon thread of the rank that manages checkpoints. Another run refuses to
start while the lock is fresh. A crashed run cannot leave it stuck forever: a lock whose
heartbeat is older than ``ELASTIC_TRAIN_LOCK_TTL`` seconds (default 60), or whose owner process
on this host is gone, is taken over. The same run (same Slurm job id, or same torchrun run id)
takes its own lock back after a restart or requeue.

Filesystem locks (flock) are not used: on many cluster filesystems they are off or local to a node.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from elastic_train.errors import UsageError

log = structlog.get_logger(__name__)

LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0
DEFAULT_TTL_S = 60.0


def lock_ttl() -> float:
    return float(os.environ.get("ELASTIC_TRAIN_LOCK_TTL", DEFAULT_TTL_S))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointLock:
    def __init__(self, root: Path, owner: str) -> None:
        self.path = root / LOCK_NAME
        self.owner = owner
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict[str, Any]:
        return {"owner": self.owner, "host": self.host, "pid": os.getpid(), "heartbeat": time.time()}

    def _write(self) -> None:
        tmp = self.path.with_name(f"{LOCK_NAME}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self._record()))
        os.replace(tmp, self.path)

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treat as stale
        return data if isinstance(data, dict) else {}

    def holder_blocks_us(self, held: dict[str, Any]) -> str | None:
        """Why ``held`` (the current lock content) forbids us to start, or None."""
        if not held or held.get("owner") == self.owner:
            return None
        age = time.time() - float(held.get("heartbeat", 0))
        if age > lock_ttl():
            return None
        if held.get("host") == self.host and not _pid_alive(int(held.get("pid", -1))):
            return None
        return (
            f"checkpoint directory {self.path.parent} is in use by run {held.get('owner')!r} "
            f"(host {held.get('host')}, pid {held.get('pid')}, heartbeat {age:.0f}s ago)"
        )

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        held = self._read()
        if held is not None:
            reason = self.holder_blocks_us(held)
            if reason:
                raise UsageError(
                    reason,
                    f"use another --checkpoint-dir, stop that run, or, if it crashed, wait {lock_ttl():.0f}s "
                    "for its lock to expire (ELASTIC_TRAIN_LOCK_TTL)",
                )
            if held.get("owner") not in (None, self.owner):
                log.warning("checkpoint_lock_taken_over", previous=held)
        self._write()
        # Two starters racing: the later rename wins; the loser sees someone else's record.
        time.sleep(0.05)
        now = self._read() or {}
        if now.get("owner") != self.owner or now.get("pid") != os.getpid():
            raise UsageError(
                f"checkpoint directory {self.path.parent} was just claimed by run {now.get('owner')!r}",
                "use another --checkpoint-dir",
            )
        self._thread = threading.Thread(target=self._beat, name="ckpt-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except OSError as exc:
                log.error("checkpoint_lock_heartbeat_failed", error=repr(exc))

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            held = self._read() or {}
            if held.get("owner") == self.owner and held.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
