"""Replica groups of several workers in the built-in trainer (issue 20): ``python -m
elastic_train.quorum.launch --procs-per-replica 2`` runs each replica group as 2 workers with
DDP or FSDP2 inside it and the quorum across the groups (torchft's fault-tolerant HSDP shape).

SIGKILL one worker of group 1: its agent kills the group's other worker and restarts the group,
group 0 goes on alone without a restart, and the restarted group heals worker by worker from
group 0 (under FSDP2 each worker fetches only its own shards) and trains with it again; a
frozen worker (SIGSTOP) is found by its group's watch, and the group restarts the same way. Each
epoch trains its global batches' samples exactly once (digests against the data order), the
final weights equal the fault-free 2-replica run's up to float summation order, and every group
rank ends with the same weights (its shards) in both groups. A preemption of the job saves one
agreed step of the sharded state, and a job of another shape resumes it exactly.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_train.checkpoint.manager import load
from elastic_train.outcome import ExitCode
from tests.helpers import TOKEN_VAR, base_env, final_state, kill_tagged, read_jsonl, shared_once
from tests.launch.test_quorum_trainer import (
    EXITED,
    TOTAL,
    Job,
    Node,
    _time,
    assert_exactly_once,
    max_abs_diff,
    run_fault_free,
)

K = 2  # workers per replica group
GROUP_WORKER = re.compile(r"replica group (\d+): worker pid (\d+) \(restart (\d+)\), group rank (\d+)")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    job = Job(tmp_path, base_env())
    try:
        yield job
    finally:
        kill_tagged(job.env[TOKEN_VAR])  # agents, forkservers and every worker


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free 2-replica run (one worker each), shared with test_quorum_trainer.py."""
    return shared_once(tmp_path_factory, "quorum-fault-free", run_fault_free)


def worker_log(job: Job, group: int, rank: int) -> list[dict[str, Any]]:
    path = job.base / "logs" / f"replica_{group}.rank{rank}.jsonl"
    return read_jsonl(path) if path.exists() else []


def worker_events(job: Job, group: int, rank: int, name: str, after: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in worker_log(job, group, rank) if r["event"] == name and _time(r) > after]


def committed(job: Job, group: int) -> int:
    """The highest step group ``group``'s rank 0 reported."""
    steps = [int(r["step"]) for r in worker_log(job, group, 0) if isinstance(r.get("step"), int)]
    return max(steps, default=0)


def worker_pid(node_out: Path, group: int, rank: int) -> int:
    found = [m.groups() for m in GROUP_WORKER.finditer(node_out.read_text())]
    return [int(pid) for g, pid, _, r in found if int(g) == group and int(r) == rank][-1]


def first_change(job: Job, rank: int, fault_at: float) -> dict[str, Any]:
    """Group 0's worker ``rank``: its first quorum change after a fault in group 1 (the redo of
    the step the fault broke), with its time since the commit before. Alone (K of 2K workers),
    or beside group 1 already back: the agent restarts a group in ~0.5 s here (forked warm, the
    data already open), so its request may reach the Lighthouse before the dead group's
    heartbeat expires (400 ms). No change at all (an empty record, nothing lost to bound) when
    the fault fell between two attempts and the new group was in the next quorum at once."""
    changed = worker_events(job, 0, rank, "quorum_changed", fault_at)
    if not changed:
        return {"seconds_since_commit": 0.0}
    assert changed[0]["world"] in (K, 2 * K), changed[0]
    return changed[0]


def fault_in_group_1(job: Job, signum: int, parallel: str = "ddp") -> tuple[Node, float, str]:
    """Two groups of K workers training; ``signum`` to group 1's worker 1; both of group 1's
    workers healed again and the job finished. Returns the agent, the fault's time, its output."""
    node = job.start(
        "--nproc-per-node", "2", "--procs-per-replica", str(K), "--max-restarts", "3", flags=["--parallel", parallel]
    )  # fmt: skip
    job.until("both groups training", lambda: committed(job, 0) >= 12 and committed(job, 1) >= 12, timeout=120)
    at = time.time()
    os.kill(worker_pid(node.out, 1, 1), signum)
    for rank in range(K):
        job.until(
            f"group 1's worker {rank} healed",
            lambda r=rank: bool(worker_events(job, 1, r, "healed", at)),  # type: ignore[misc]
            timeout=120,
        )
    assert job.wait(node, timeout=180) == 0, job.output()
    return node, at, node.out.read_text()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_killed_worker_takes_its_group_out_the_other_group_commits_on_and_the_group_heals_worker_by_worker(
    job: Job, fault_free: Path, parallel: str
) -> None:
    _node, killed_at, out = fault_in_group_1(job, signal.SIGKILL, parallel)
    inside = "FSDP2" if parallel == "fsdp" else "DDP"
    assert f"replica groups of 2 workers ({inside} inside)" in out, out[:3000]
    # Only group 1 restarted, once, for the kill (the group's first failure is its code).
    assert EXITED.findall(out) == [("1", "-9")], out[-3000:]
    for rank in range(K):
        # The survivor group went on without a restart, within seconds.
        first = first_change(job, rank, killed_at)
        assert first["seconds_since_commit"] < 5.0, first
        # The restarted group healed from a live peer, not from a checkpoint.
        healed = worker_events(job, 1, rank, "healed", killed_at)
        assert healed[0]["to_step"] > 12, healed
        assert not worker_events(job, 1, rank, "resumed", killed_at)
    assert_exactly_once(job.base)
    # 4 members sum each step in another order than 2: measured 4e-7 to 5e-7 (DDP and FSDP2) at
    # the global batch of 16, 5e-7 to 1.7e-6 at 32.
    diff = max_abs_diff(final_state(job.base), final_state(fault_free))
    assert diff < 1e-5, f"weights differ from the fault-free run by {diff}"
    done = {
        (group, rank): worker_events(job, group, rank, "done")[-1]["weights_sha256"]
        for group in (0, 1)
        for rank in range(K)
    }
    for rank in range(K):
        assert done[(0, rank)] == done[(1, rank)], done
    if parallel == "fsdp":  # each worker holds its own shards
        assert done[(0, 0)] != done[(0, 1)], done


def test_a_frozen_worker_is_killed_by_its_group_which_restarts_and_heals_while_the_other_group_commits_on(
    job: Job, fault_free: Path
) -> None:
    """SIGSTOP one worker of group 1 (its sockets stay open; nothing answers). Its sibling's
    ``GroupWatch`` sees it silent, SIGKILLs it and leaves; the agent restarts the group."""
    _node, frozen_at, out = fault_in_group_1(job, signal.SIGSTOP)
    assert [group for group, _ in EXITED.findall(out)] == ["1"], out[-3000:]  # that group, once
    assert "has been silent" in out, out[-3000:]  # the group watch said why
    for rank in range(K):
        first = first_change(job, rank, frozen_at)
        # The group watch's silence bound (--peer-timeout, 1 s), the Lighthouse's heartbeat timeout,
        # a quorum and a step; the rest is margin for a loaded machine.
        assert first["seconds_since_commit"] < 10.0, first
    assert_exactly_once(job.base)
    assert max_abs_diff(final_state(job.base), final_state(fault_free)) < 1e-5


def test_a_preempted_fsdp_group_job_saves_one_agreed_step_and_a_ddp_job_of_another_shape_resumes_it_exactly(
    tmp_path: Path, fault_free: Path
) -> None:
    """Two groups of two FSDP2 workers are preempted (Slurm's signal to the agent): group 0's
    workers write their shards of one agreed step. The requeued job is two one-worker replicas
    (DDP) and ends where the fault-free run ends, every sample once."""
    job = Job(tmp_path, base_env())
    try:
        node = job.start("--nproc-per-node", "2", "--procs-per-replica", str(K), flags=["--parallel", "fsdp"])
        job.until("training", lambda: committed(job, 0) >= 25, timeout=120)
        node.proc.send_signal(signal.SIGUSR1)
        assert job.wait(node) == ExitCode.PREEMPTED, job.output()
    finally:
        kill_tagged(job.env[TOKEN_VAR])
    stopped = load((tmp_path / "ckpt" / "latest").resolve())
    assert 25 <= stopped.manifest.step < TOTAL and not stopped.manifest.finished
    assert stopped.world_size == K, "group 0's two workers wrote the checkpoint"
    out = node.out.read_text()
    assert out.count(f"Preempted at step {stopped.manifest.step}: checkpoint committed") == 1, out[-3000:]
    resumed = Job(tmp_path, base_env())
    try:
        again = resumed.start("--nproc-per-node", "2", name="requeued")
        assert resumed.wait(again) == 0, resumed.output()
    finally:
        kill_tagged(resumed.env[TOKEN_VAR])
    assert f"Resumed from {tmp_path / 'ckpt'}" in again.out.read_text()
    assert_exactly_once(tmp_path)
    assert max_abs_diff(final_state(tmp_path), final_state(fault_free)) < 1e-5
