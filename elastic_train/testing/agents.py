"""Two (or more) torchrun agents, each standing for a node, for elastic tests and benchmarks.

By default every agent and the rendezvous store are on loopback. Given a ``netns.Host``, each
runs inside that host's network namespace instead, at the host's address, so a test can cut a
node off the network (``Host.set_link``). A node is its agent plus its workers, found by the
agent's environment token (torchrun puts each worker in a session of its own: a process-group
signal misses them).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from elastic_train.checkpoint.format import MANIFEST, aside_folders, checkpoint_key, read_manifest, step_folders
from elastic_train.logs import parse_timestamp
from elastic_train.testing.netns import Host
from elastic_train.testing.processes import (
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
def rendezvous_store(tmp: Path, host: Host | None = None) -> Iterator[str]:
    """A standalone store (python -m elastic_train.rendezvous), on loopback or inside ``host``'s
    namespace at its address; yields host:port."""
    addr = host.addr if host is not None else "127.0.0.1"
    port = free_port()  # free here; in a fresh namespace every port is free
    ready = tmp / "store.ready"
    command = [
        sys.executable,
        "-m",
        "elastic_train.rendezvous",
        "--host",
        addr,
        "--port",
        str(port),
        "--ready-file",
        str(ready),
    ]
    proc = subprocess.Popen(
        host.command(command) if host is not None else command,
        env=base_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "rendezvous store did not start"
            time.sleep(0.1)
        yield f"{addr}:{port}"
    finally:
        kill_group(proc)
        proc.wait()


class Agent:
    """``jobs/elastic-agent.sh`` with one worker, output to files, in its own session.

    With ``host``, the agent and its worker run in the host's namespace: the agent announces the
    host's address (``ET_LOCAL_ADDR``) and the worker's gloo uses the host's interface
    (``GLOO_SOCKET_IFNAME``), because the hostname both would use otherwise resolves to an address
    outside the namespace.
    """

    def __init__(
        self,
        name: str,
        base: Path,
        endpoint: str,
        job: str,
        args: list[str],
        env: dict[str, str] | None = None,
        host: Host | None = None,
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
            **({"ET_LOCAL_ADDR": host.addr, "GLOO_SOCKET_IFNAME": host.ifname} if host is not None else {}),
            **(env or {}),
        }
        self.started = time.time()
        child_env = base_env(agent_env)
        self.token = child_env[TOKEN_VAR]  # marks the agent and its workers: "the node"
        command = ["bash", str(ROOT / "jobs" / "elastic-agent.sh"), *args]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                host.command(command) if host is not None else command,
                env=child_env,
                cwd=ROOT,
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
            )

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill_node(self) -> float:
        """SIGKILL the agent and its workers at once, like a node that lost power."""
        kill_tagged(self.token)
        return time.time()

    def freeze(self) -> float:
        """SIGSTOP the agent and every worker, like a node that stopped answering (a kernel stall,
        a hypervisor pause): nothing exits, no socket closes. Returns when all are stopped."""
        for _ in range(50):  # a worker being (re)started between listing and signalling is caught next round
            pids = tagged(self.token)
            self._signal_all(pids, signal.SIGSTOP)
            if all(_stopped(pid) for pid in pids) and set(tagged(self.token)) == set(pids):
                return time.time()
            time.sleep(0.05)
        raise AssertionError(f"node {self.name} did not stop: {[(p, _state(p)) for p in tagged(self.token)]}")

    def thaw(self) -> float:
        """SIGCONT every process of the node (after ``freeze``)."""
        self._signal_all(tagged(self.token), signal.SIGCONT)
        return time.time()

    @staticmethod
    def _signal_all(pids: list[int], sig: int) -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)

    def worker_ranks(self) -> list[int]:
        """The global ranks of this node's live workers (RANK as torchrun set it)."""
        ranks = []
        for pid in self.worker_pids():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks += [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
        return ranks

    def exited(self) -> int | None:
        """The agent's exit code, or None while it runs."""
        return self.proc.poll()

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


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T, Z, ...), "gone" if it no longer exists."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _stopped(pid: int) -> bool:
    return _state(pid) in ("T", "t", "gone", "Z")


def all_events(base: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted((base / "logs").glob("rank-*.jsonl")):
        found += [e for e in read_jsonl(path) if e.get("event") == name]
    return sorted(found, key=lambda e: e["timestamp"])


def event_time(event: dict[str, Any]) -> float:
    at = parse_timestamp(event["timestamp"])
    assert at is not None, f"unreadable timestamp in {event}"
    return at


def first_step_after(base: Path, since: float, world_size: int) -> float | None:
    """When the first step at ``world_size`` after ``since`` finished (any rank), or None."""
    times = [event_time(e) for e in all_events(base, "first_step") if e["world_size"] == world_size]
    later = [t for t in times if t > since]
    return min(later) if later else None


def rank_log_events(base: Path, name: str) -> dict[int, list[dict[str, Any]]]:
    """``name`` events per rank log file, in time order (a rank id is reused by every group)."""
    found: dict[int, list[dict[str, Any]]] = {}
    for path in (base / "logs").glob("rank-*.jsonl"):
        rank = int(path.stem.split("-")[1])
        found[rank] = sorted((e for e in read_jsonl(path) if e.get("event") == name), key=event_time)
    return found


def _commit_key(event: dict[str, Any]) -> tuple[int, int]:
    """``(step, version)`` of a ``checkpoint_committed`` event, from the folder it names."""
    key = checkpoint_key(Path(event.get("path", "")))
    return key if key is not None else (int(event["step"]), 1)


def _folder_key(name: str) -> tuple[int, int]:
    key = checkpoint_key(Path(name))
    assert key is not None, f"{name} is not a step folder"
    return key


def assert_one_lineage(base: Path) -> None:
    """Checkpoints form one line of training, whoever survived a fault.

    No checkpoint was committed twice (by two groups, or at all) and commits only move forward
    in ``(step, version)`` (a step has a second version only for an evaluated epoch end after a
    mid-epoch commit of it); all manifests carry one timeline, run id and fingerprint; each
    names as its parent a checkpoint before it; the data position advances with the step;
    nothing was set aside as corrupt or abandoned; the newest checkpoint is the final one; and
    every committed folder verifies with ``python -m elastic_train.ckpt verify`` (sizes, xxh3,
    sha256). Needs every checkpoint kept (``--keep-last`` above their number).
    """
    commits = rank_log_events(base, "checkpoint_committed")
    # Every group has a rank 0, and all of them log to the same rank-0.jsonl.
    by_key = {_commit_key(e): e["world_size"] for e in commits.get(0, [])}
    assert by_key, "no checkpoint was committed"
    for rank, events in sorted(commits.items()):
        keys = [_commit_key(e) for e in events]
        assert all(a < b for a, b in itertools.pairwise(keys)), f"rank {rank}'s commits do not move forward: {keys}"
        for e in events:
            assert by_key.get(_commit_key(e)) == e["world_size"], (
                f"rank {rank} committed {e['path']} at world size {e['world_size']}; rank 0's commits: {by_key}"
            )
    root = base / "ckpt"
    assert not aside_folders(root), f"checkpoints set aside: {[f.name for f in aside_folders(root)]}"
    folders = [f for f in reversed(step_folders(root)) if (f / MANIFEST).exists()]  # oldest first
    manifests = {f.name: read_manifest(f) for f in folders}
    on_disk = [_folder_key(f.name) for f in folders]
    # A group can die between rank 0's manifest and the verdict's broadcast (a node frozen
    # mid-commit): that checkpoint is complete on disk but no rank logged its commit. It counts
    # only if a later attempt resumed from it, i.e. it is part of the line of training.
    resumed = {_commit_key(e) for events in rank_log_events(base, "resumed").values() for e in events}
    unlogged = set(on_disk) - set(by_key)
    assert on_disk and unlogged <= resumed, (
        f"committed folders {on_disk}, commits logged: {sorted(by_key)}, resumed from: {sorted(resumed)}"
    )
    first, last = manifests[folders[0].name], manifests[folders[-1].name]
    for name, m in manifests.items():
        assert (m.timeline, m.run_id, m.fingerprint) == (first.timeline, first.run_id, first.fingerprint), (
            f"{name} is of another line of training: timeline {m.timeline!r}, run {m.run_id!r}"
        )
        if m.parent:
            assert m.parent in manifests, f"{name} resumed from {m.parent}, which is not a committed checkpoint here"
            assert _folder_key(m.parent) < _folder_key(name), f"{name}'s parent {m.parent} is not older than it"
    assert first.timeline, "the manifests carry no timeline"
    positions = [(m.epoch, m.batch_in_epoch) for m in manifests.values()]
    assert positions == sorted(set(positions)), f"the data position does not advance with the step: {positions}"
    assert last.finished, f"the newest checkpoint ({folders[-1].name}) is not the final one"
    done = subprocess.run(
        [sys.executable, "-m", "elastic_train.ckpt", "verify", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, f"checkpoint verification failed:\n{done.stdout}{done.stderr}"


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.2 s until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
