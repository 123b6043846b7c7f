"""Launching and reaping real processes in tests.

Every child runs in its own session (process group), so a test can kill it and everything it
spawned (torchrun's workers, DataLoader workers) in one ``killpg``, on success, failure or timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Small, fast settings shared by the process-level tests.
QUICK = ["--batch-size", "32", "--max-steps-per-epoch", "3", "--epochs", "2", "--target-accuracy", "1.0"]


def flags(**values: object) -> list[str]:
    """Trainer flags from keywords: flags(batch_size=32) == ["--batch-size", "32"]."""
    return [item for name, value in values.items() for item in (f"--{name.replace('_', '-')}", str(value))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TOKEN_VAR = "ELASTIC_TRAIN_TEST_TOKEN"


def tagged(token: str) -> list[int]:
    """Live processes whose environment carries ``token`` (torchrun's workers inherit it, even
    though torchrun starts each of them in a session of its own)."""
    found = []
    needle = f"{TOKEN_VAR}={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def kill_tagged(token: str) -> None:
    for pid in tagged(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# A test's processes get no distributed, Slurm-job or job-script settings from the environment
# pytest runs in (inside an allocation SLURM_RESTART_COUNT and friends would leak into the jobs).
_NOT_INHERITED = ("RANK", "LOCAL_", "WORLD_", "MASTER_", "TORCHELASTIC", "ELASTIC_TRAIN", "SLURM_", "ET_")


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(_NOT_INHERITED)}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), TOKEN_VAR: uuid.uuid4().hex})
    env.update(extra or {})
    return env


@dataclass
class Finished:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    leftovers: bool = False  # processes of its group still alive after it exited

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Finished:
    """Run to completion in a new session; on timeout kill the whole group and fail."""
    start = time.monotonic()
    child_env = base_env(env)
    token = child_env[TOKEN_VAR]
    proc = subprocess.Popen(
        list(args),
        env=child_env,
        cwd=cwd or ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(args)}\n--- stdout\n{out}\n--- stderr\n{err}"
        ) from None
    finally:
        leftovers = group_alive(proc.pid) or bool(tagged(token))
        kill_group(proc)  # reap anything the child left behind
        kill_tagged(token)  # including workers that torchrun put in sessions of their own
    return Finished(list(args), proc.returncode, out, err, time.monotonic() - start, leftovers)


def cli(args: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None) -> Finished:
    return run([sys.executable, "-m", "elastic_train", *args], timeout, env)


def torchrun(
    torchrun_args: Sequence[str], args: Sequence[str], timeout: float = 180, env: Mapping[str, str] | None = None
) -> Finished:
    return run([str(BIN / "torchrun"), *torchrun_args, "-m", "elastic_train", *args], timeout, env)


@contextmanager
def ranks(
    world_size: int, args: Sequence[str], env: Mapping[str, str] | None = None
) -> Iterator[list[subprocess.Popen[str]]]:
    """Start ``world_size`` plain processes with the env torchrun would set (no agent)."""
    port = free_port()
    procs = []
    try:
        for rank in range(world_size):
            rank_env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(env or {}),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "elastic_train", *args],
                    env=base_env(rank_env),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        for proc in procs:
            kill_group(proc)
            proc.wait()


def wait_all(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[Finished]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_group(p)
            raise AssertionError(f"rank process {proc.args} still running after {timeout}s") from None
        results.append(Finished(list(map(str, proc.args)), proc.returncode, out, err, 0.0))
    return results


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(log_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(log_dir / f"rank-{rank}.jsonl") if e.get("event") == name]


def spawn_ranks(target: Any, world_size: int, args: tuple[Any, ...], timeout: float) -> None:
    """Run ``target(rank, world_size, init_file, *args)`` in ``world_size`` spawned processes.

    Fails if any exits non-zero or the group is still running after ``timeout`` (then all are
    killed). ``target`` must be importable (a module-level function).
    """
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "store")
        procs = [ctx.Process(target=target, args=(r, world_size, init_file, *args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
            alive = [p for p in procs if p.is_alive()]
            assert not alive, f"{len(alive)} rank(s) still running after {timeout}s"
            codes = [p.exitcode for p in procs]
            assert codes == [0] * world_size, f"rank exit codes {codes}"
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
