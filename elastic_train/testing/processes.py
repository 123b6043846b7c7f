"""Launching and reaping real processes.

Every child runs in its own session (process group), so its caller can kill it and everything it
spawned (torchrun's workers, DataLoader workers) in one ``killpg``, on success, failure or
timeout. torchrun starts each worker in a session of its own, which a ``killpg`` misses: those are
found by a token in their environment (``TOKEN_VAR``), which every descendant inherits.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The source checkout this package runs from: children start there, with it on PYTHONPATH, and the
# agents run its jobs/ scripts (an installed wheel has no jobs/: these helpers need the checkout).
ROOT = Path(__file__).resolve().parents[2]
TOKEN_VAR = "ELASTIC_TRAIN_TEST_TOKEN"

# A child gets no distributed, Slurm-job or job-script settings from the environment its caller
# runs in (inside an allocation SLURM_RESTART_COUNT and friends would leak into the jobs).
_NOT_INHERITED = ("RANK", "LOCAL_", "WORLD_", "MASTER_", "TORCHELASTIC", "ELASTIC_TRAIN", "SLURM_", "ET_")


# Ports the jobs use by default: a test never picks them.
_DEFAULT_PORTS = frozenset({2379, 2380, 6817, 6818, 29400, 29500, 29510})
_LOWEST_PORT = 20000
# Every port free_port() returned in this process (a test session hands out a few thousand of
# the ~12,000 below the ephemeral range): never handed out twice.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (and for bind to port 0)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port() -> int:
    """A TCP port free on loopback now, below the kernel's ephemeral range.

    A port from bind(0) lies in the ephemeral range, where every outgoing connection of every
    process on the host (gloo pairs, TCPStore clients, gRPC, etcd requests) takes its local port:
    in the seconds before a test's child binds the port, one of them may hold it (measured in CI:
    an etcd member's "bind: address already in use" with the other test lane busy). Below that
    range only an explicit bind takes a port. Drawn with the OS's randomness, not from
    ``random``'s global state, which a test may seed (hypothesis does, inside its examples): two
    test lanes would then draw the same ports. Nothing holds a port between this call and the
    child's bind, so a port this process handed out before is never drawn again: several drawn
    in a row for one launch (an etcd cluster's six) were once the same (measured in CI: two
    members of one cluster given 21668)."""
    low, _ = _ephemeral_range()
    draw = secrets.SystemRandom()
    if low - _LOWEST_PORT < 1000:  # an unusual kernel setting: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(100):
        port = draw.randrange(_LOWEST_PORT, low)
        if port in _DEFAULT_PORTS or port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        with _handed_out_lock:
            if port in _handed_out:  # another thread of this process drew it meanwhile
                continue
            if len(_handed_out) > (low - _LOWEST_PORT) // 2:  # a long-lived caller: forget the old ones
                _handed_out.clear()
            _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port found between {_LOWEST_PORT} and {low} in 100 draws")


def carrying(name: str, value: str) -> list[int]:
    """Live processes (other than this one) whose environment holds ``name=value``."""
    found = []
    needle = f"{name}={value}".encode()
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


def tagged(token: str) -> list[int]:
    """Live processes whose environment carries ``token`` (torchrun's workers inherit it, even
    though torchrun starts each of them in a session of its own)."""
    return carrying(TOKEN_VAR, token)


def kill_tagged(token: str) -> None:
    """SIGKILL every live process that carries ``token``."""
    for pid in tagged(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def no_core_dumps() -> None:
    """In a child before it runs (inherited by everything it starts): no core files, so the
    SIGABRT of ``dump_stacks`` leaves nothing in the working tree on hosts that allow cores."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def dump_stacks(token: str, settle_s: float = 3.0) -> int:
    """SIGABRT every live process carrying ``token``: each worker dumps every thread's Python stack
    to its stderr on the way out (the trainer enables ``faulthandler``), so a hung test says where
    each process was stuck. Returns how many were signalled."""
    pids = tagged(token)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    if pids:
        time.sleep(settle_s)
    return len(pids)


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without launcher and job settings, plus a fresh ``TOKEN_VAR``."""
    env = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(_NOT_INHERITED)}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), TOKEN_VAR: uuid.uuid4().hex})
    env.update(extra or {})
    return env


@dataclass
class Finished:
    """A command that ran to its end: its exit code, output and duration."""

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
    """SIGKILL ``proc``'s whole session (it was started with ``start_new_session=True``)."""
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
    """Run to completion in a new session; on timeout kill the whole group and fail.

    Whatever the outcome, nothing it started outlives it: its session and every process carrying
    its token are killed (``Finished.leftovers`` says whether there was anything to kill).
    """
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
        preexec_fn=no_core_dumps,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        dumped = dump_stacks(token)
        kill_group(proc)
        # torchrun's workers (sessions of their own) and their DataLoader workers hold the output
        # pipes too: until they are gone, reading to the end would wait for ever.
        kill_tagged(token)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "(unread: the pipes stayed open)", ""
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(args)}\n"
            f"(SIGABRT sent to {dumped} process(es) first: their Python stacks are in stderr)\n"
            f"--- stdout\n{out}\n--- stderr\n{err}"
        ) from None
    finally:
        leftovers = group_alive(proc.pid) or bool(tagged(token))
        kill_group(proc)  # reap anything the child left behind
        kill_tagged(token)  # including workers that torchrun put in sessions of their own
    return Finished(list(args), proc.returncode, out, err, time.monotonic() - start, leftovers)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines log.

    Strict about what was written whole: a line that ends in a newline and does not parse fails,
    unlike the report's reader. A last line without its newline is a record still being appended
    (tests poll logs of running jobs) and is left for the next read.
    """
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
