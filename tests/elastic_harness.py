"""Two (or more) torchrun agents on loopback, each standing for a node, for elastic tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic_train.logs import parse_timestamp
from tests.helpers import (
    ROOT,
    TOKEN_VAR,
    base_env,
    free_port,
    group_alive,
    kill_group,
    kill_tagged,
    read_jsonl,
    tagged,
)

VENV = Path(sys.prefix)


@contextmanager
def rendezvous_store(tmp: Path) -> Iterator[str]:
    """A standalone store (python -m elastic_train.rendezvous); yields host:port."""
    port = free_port()
    ready = tmp / "store.ready"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_train.rendezvous",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ready-file",
            str(ready),
        ],
        env=base_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "rendezvous store did not start"
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        kill_group(proc)
        proc.wait()


class Agent:
    """``jobs/elastic-agent.sh`` with one worker, output to files, in its own session."""

    def __init__(
        self, name: str, base: Path, endpoint: str, job: str, args: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.out = base / f"agent-{name}.out"
        self.err = base / f"agent-{name}.err"
        agent_env = {
            "ET_RDZV_ENDPOINT": endpoint,
            "ET_RDZV_ID": job,
            "ET_NNODES": "1:2",
            "ET_NPROC": "1",
            "ET_VENV": str(VENV),
            "ET_LOG_DIR": str(base / "logs"),
            "ET_CHECKPOINT_DIR": str(base / "ckpt"),
            "ET_SHUTDOWN_TIMEOUT": "10",
            "ET_JOIN_TIMEOUT": "60",
            "SLURM_SUBMIT_DIR": str(ROOT),
            **(env or {}),
        }
        self.started = time.time()
        child_env = base_env(agent_env)
        self.token = child_env[TOKEN_VAR]  # marks the agent and its workers: "the node"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                ["bash", str(ROOT / "jobs" / "elastic-agent.sh"), *args],
                env=child_env,
                cwd=ROOT,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill_node(self) -> float:
        """SIGKILL the agent and its workers at once, like a node that lost power."""
        kill_tagged(self.token)
        return time.time()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)  # the script forwards it to torchrun, torchrun to the worker

    def worker_pids(self) -> list[int]:
        workers = []
        for pid in tagged(self.token):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"-u" in cmdline and b"elastic_train" in cmdline and not any(b"torchrun" in c for c in cmdline):
                workers.append(pid)
        return workers

    @property
    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def cleanup(self) -> None:
        if group_alive(self.proc.pid):
            kill_group(self.proc)
        kill_tagged(self.token)
        self.proc.wait()


def all_events(base: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted((base / "logs").glob("rank-*.jsonl")):
        found += [e for e in read_jsonl(path) if e.get("event") == name]
    return sorted(found, key=lambda e: e["timestamp"])


def event_time(event: dict[str, Any]) -> float:
    at = parse_timestamp(event["timestamp"])
    assert at is not None, f"unreadable timestamp in {event}"
    return at


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
