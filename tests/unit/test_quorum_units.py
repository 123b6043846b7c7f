"""Quorum mode's pure pieces: the per-step exact sums, the replicated progress, the lock handed
between replicas of one job, the agent's command line and exit status, the replica settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.checkpoint.lock import MUTEX_NAME, CheckpointLock
from elastic_train.config import TrainConfig
from elastic_train.data.sampler import split_evenly
from elastic_train.errors import UsageError
from elastic_train.metrics import MetricSums, format_digest, index_digest
from elastic_train.outcome import ExitCode
from elastic_train.quorum.launch import Agent, Slot, parse
from elastic_train.quorum.replica import MAX_OVERSIZED_IN_A_ROW, Replica, ReplicaConfig, _GroupEnv
from elastic_train.quorum.run import replica_config
from elastic_train.quorum.schedule import QuorumSchedule
from elastic_train.quorum.strategy import (
    CORRECT,
    LOSS_SUM,
    SAMPLES,
    STOP,
    QuorumProgress,
    agreed_stop,
    digest_lanes,
    stop_vote,
    sums_stats,
)
from elastic_train.resilience.preemption import StopKind
from elastic_train.steps import QuorumSteps

NO_VOTES = (StopKind.NONE, False)


def share_stats(
    correct: torch.Tensor, mean_loss: torch.Tensor, indices: torch.Tensor, votes: tuple[StopKind, bool]
) -> torch.Tensor:
    """One participant's addends, as the loop hands its share's sums to the strategy."""
    sums = MetricSums(torch.device("cpu"))
    sums.add_batch(correct, int(indices.numel()), mean_loss)
    sums.add_indices(indices)
    return sums_stats(sums, votes)


def votes(stop: bool) -> tuple[StopKind, bool]:
    return (StopKind.INTERRUPT if stop else StopKind.NONE, False)


@settings(max_examples=60, deadline=None)
@given(
    indices=st.lists(st.integers(0, 2**40), min_size=1, max_size=200, unique=True),
    world=st.integers(1, 9),
    stop_from=st.integers(0, 9),
)
def test_the_summed_share_stats_are_the_global_batch_exactly_for_any_split(
    indices: list[int], world: int, stop_from: int
) -> None:
    world = min(world, len(indices))
    total = torch.zeros_like(share_stats(torch.tensor(0), torch.tensor(0.0), torch.tensor([0]), NO_VOTES))
    for rank in range(world):
        share = split_evenly(len(indices), world, rank)
        part = torch.tensor(indices[share.start : share.stop])
        correct = torch.tensor(int(part.numel()) // 2)
        total += share_stats(
            correct, torch.tensor(0.5), part, (StopKind.INTERRUPT if rank == stop_from else StopKind.NONE, False)
        )
    assert total[SAMPLES] == len(indices) and total[LOSS_SUM] == 0.5 * len(indices)
    assert total[CORRECT] == sum(len(split_evenly(len(indices), world, r)) // 2 for r in range(world))
    assert (total[STOP] > 0) == (stop_from < world), "a stop requested by any participant reaches all"
    assert agreed_stop(float(total[STOP])) is (StopKind.INTERRUPT if stop_from < world else StopKind.NONE)
    # The digest lanes travel as 32-bit halves in float64 and come back mod 2^64, bit for bit.
    assert format_digest(digest_lanes(total)) == format_digest(index_digest(torch.tensor(indices)))


def test_a_repeated_or_missing_sample_changes_the_summed_digest() -> None:
    full = [0, 1, 2, 3]
    parts = ([0, 1], [2, 3])
    summed = sum(share_stats(torch.tensor(0), torch.tensor(0.0), torch.tensor(p), NO_VOTES) for p in parts)
    assert isinstance(summed, torch.Tensor)
    assert format_digest(digest_lanes(summed)) == format_digest(index_digest(torch.tensor(full)))
    repeated = sum(share_stats(torch.tensor(0), torch.tensor(0.0), torch.tensor(p), NO_VOTES) for p in ([0, 1], [1, 3]))
    assert isinstance(repeated, torch.Tensor)
    assert format_digest(digest_lanes(repeated)) != format_digest(index_digest(torch.tensor(full)))


def test_the_replicated_progress_round_trips_through_json_with_its_digest() -> None:
    progress = QuorumProgress(epoch=2, batch_in_epoch=7, sums=[3.0, 1.5, 8.0], history=[{"epoch": 1}], finished=False)
    progress.add_digest(index_digest(torch.tensor([5, 6, 7])))
    progress.add_digest(index_digest(torch.tensor([8])))
    copy = QuorumProgress()
    copy.load(json.loads(json.dumps(progress.to_json())))
    assert copy == progress
    assert copy.totals().digest == format_digest(index_digest(torch.tensor([5, 6, 7, 8])))
    assert copy.totals().samples == 8 and copy.totals().accuracy == pytest.approx(3 / 8)
    assert all(0 <= lane < 2**64 for lane in copy.digest) and isinstance(copy.digest[0], int)
    assert np.array(copy.digest, dtype=np.uint64).dtype == np.uint64


def test_the_lock_passes_between_replicas_of_one_job_and_never_to_another_job(tmp_path: Path) -> None:
    first, second = CheckpointLock(tmp_path, "job-1", 60), CheckpointLock(tmp_path, "job-1", 60)
    other = CheckpointLock(tmp_path, "job-2", 60)
    try:
        first.ensure_held()
        first.ensure_held()  # still ours: nothing changes
        assert not first.lost()
        second.ensure_held()  # the next saver of the same job takes it
        assert first.lost() and not second.lost()
        first.ensure_held()  # and back
        assert second.lost() and not first.lost()
        with pytest.raises(UsageError, match="in use by run 'job-1'"):
            other.ensure_held()
        assert not first.lost()
    finally:
        for lock in (first, second, other):
            lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_former_holder_never_takes_a_reused_inode_for_its_own_lock(tmp_path: Path) -> None:
    """tmpfs and ext4 give a freed inode number to the next file at once: after a takeover the
    new holder's ``.lock`` can carry the old holder's inode number. The old holder, exiting,
    then removed the new holder's lock and failed its final commit (a CI run: exit 81). Its
    inode is set to the new lock's here, as such a reuse leaves it."""
    old, new = CheckpointLock(tmp_path, "job-1", 60), CheckpointLock(tmp_path, "job-1", 60)
    try:
        old.ensure_held()
        new.ensure_held()  # the next saver of the same job takes the lock over
        old._inode = (tmp_path / ".lock").stat().st_ino  # the removed lock's number, reused
        assert old.lost(), "a lock with our inode number but another hold's record is not ours"
        old.release()
        assert (tmp_path / ".lock").exists(), "the former holder removed the new holder's lock"
        with new.still_held() as held:
            assert held
    finally:
        new.release()
    assert not (tmp_path / ".lock").exists()


def test_a_former_saver_cannot_move_latest_back_once_another_replica_took_the_lock(tmp_path: Path) -> None:
    """The old holder's check and its move of ``latest`` are one step for a takeover: a replica
    that takes the lock meanwhile waits until the block ends, and the old holder's next commit
    is refused (``still_held`` yields False)."""
    old, new = CheckpointLock(tmp_path, "job-1", 60), CheckpointLock(tmp_path, "job-1", 60)
    try:
        old.ensure_held()
        took_over = threading.Event()
        with old.still_held() as held:
            assert held
            taker = threading.Thread(target=lambda: (new.ensure_held(), took_over.set()))
            taker.start()
            assert not took_over.wait(0.3), "a takeover slipped in between the check and the commit"
        assert took_over.wait(5), "the takeover never went through after the commit"
        taker.join()
        with old.still_held() as held:
            assert not held  # its pending, older save is not committed
        with new.still_held() as held:
            assert held
    finally:
        for lock in (old, new):
            lock.release()


def test_a_commit_mutex_left_by_a_killed_process_of_this_host_is_cleared_at_once(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = CheckpointLock(tmp_path, "job-1", 60)
    namespace = lock.pid_namespace or "-"
    try:
        lock.ensure_held()
        (tmp_path / MUTEX_NAME).write_text(f"{lock.host} {namespace} {int(dead.stdout)}\n")  # killed mid-commit
        started = time.monotonic()
        with lock.still_held() as held:
            assert held and time.monotonic() - started < 1.0
        (tmp_path / MUTEX_NAME).write_text(f"{lock.host} {namespace} {os.getppid()}\n")  # alive: a contender's turn
        with lock.still_held(wait_s=0.2) as held:
            assert not held
        assert (tmp_path / MUTEX_NAME).exists()
        # The same host name in another PID namespace (a container on the host's network): its
        # pid cannot be judged from here, so only the mutex's age clears it.
        (tmp_path / MUTEX_NAME).write_text(f"{lock.host} 1 {int(dead.stdout)}\n")
        with lock.still_held(wait_s=0.2) as held:
            assert not held
    finally:
        (tmp_path / MUTEX_NAME).unlink(missing_ok=True)
        lock.release()


def test_a_commit_never_removes_a_mutex_that_is_no_longer_its_own(tmp_path: Path) -> None:
    """A holder whose mutex was cleared as stale (it stalled for MUTEX_STALE_S) and taken by a
    contender leaves the contender's in place when it finishes."""
    lock = CheckpointLock(tmp_path, "job-1", 60)
    try:
        lock.ensure_held()
        with lock.still_held() as held:
            assert held
            (tmp_path / MUTEX_NAME).unlink()  # cleared as stale by another process...
            (tmp_path / MUTEX_NAME).write_text("elsewhere - 1\n")  # ...which holds its own now
        assert (tmp_path / MUTEX_NAME).read_text() == "elsewhere - 1\n"
    finally:
        (tmp_path / MUTEX_NAME).unlink(missing_ok=True)
        lock.release()


def test_a_lock_released_or_not_taken_back_is_no_licence_to_commit(tmp_path: Path) -> None:
    """``ensure_held`` releases a lost lock before taking it again; when taking it fails, the
    replica holds nothing and a pending save's commit must be refused, not let through."""
    lock = CheckpointLock(tmp_path, "job-1", 60)
    with lock.still_held() as held:
        assert held  # never taken: a caller without a lock is not fenced by it
    lock.ensure_held()
    lock.release()
    with lock.still_held() as held:
        assert not held


def test_the_agent_reads_torchrun_style_flags_and_refuses_what_it_cannot_launch() -> None:
    args, trainer = parse(["--nproc-per-node", "2", "--max-restarts", "5", "-m", "elastic_train", "--epochs", "3"])
    assert (args.nproc_per_node, args.max_restarts, trainer) == (2, 5, ["--epochs", "3"])
    with pytest.raises(SystemExit, match="launches the trainer only"):
        parse(["-m", "other_module"])
    with pytest.raises(SystemExit):
        parse(["--nnodes", "2", "--node-rank", "1", "-m", "elastic_train"])  # no Lighthouse for node 1
    with pytest.raises(SystemExit):
        parse(["--nnodes", "2", "--node-rank", "2", "--lighthouse", "http://h:1", "-m", "elastic_train"])


def test_procs_per_replica_gives_each_group_its_own_world_and_store_and_counts_workers_per_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args, _ = parse(["--nproc-per-node", "2", "--procs-per-replica", "3", "-m", "elastic_train"])
    agent = Agent(args, [], "http://127.0.0.1:1")
    slot = agent.slots[1]
    slot.address, slot.store = "127.0.0.1", SimpleNamespace(port=4242)  # as ``start`` sets them
    env = [agent.environ(slot, rank) for rank in range(3)]
    assert [e["RANK"] for e in env] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in env} == {"3"}
    assert [e["LOCAL_RANK"] for e in env] == ["3", "4", "5"]  # group 1's GPUs follow group 0's
    assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"6"} and {e["REPLICA_GROUP_ID"] for e in env} == {"1"}
    # The group's workers are clients of the agent's store (torchrun's convention).
    assert (env[0]["MASTER_ADDR"], env[0]["MASTER_PORT"], env[0]["TORCHELASTIC_USE_AGENT_STORE"]) == (
        "127.0.0.1",
        "4242",
        "True",
    )
    assert env[0]["ELASTIC_TRAIN_QUORUM_GROUPS"] == "2"  # groups, not workers
    single = Agent(parse(["-m", "elastic_train"])[0], [], "http://127.0.0.1:1")
    assert "MASTER_ADDR" not in single.environ(single.slots[0])  # a group of one hosts its own
    with pytest.raises(SystemExit):
        parse(["--procs-per-replica", "0", "-m", "elastic_train"])


class _FakeProc:
    def __init__(self, code: int | None) -> None:
        self.exitcode, self.pid, self.joined = code, None, False

    def join(self) -> None:
        self.joined = True


def test_a_group_ends_with_its_first_failure_and_its_running_workers_are_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slot = Slot(0, procs=[_FakeProc(-9), _FakeProc(None)])  # type: ignore[list-item]
    killed: list[int] = []
    monkeypatch.setattr(Slot, "signal", lambda self, signum: killed.append(signum))
    assert slot.ended() is None and killed == [9]  # SIGKILL: a SIGTERM would be a preemption
    slot.procs[1].exitcode = 1  # type: ignore[misc]  # the sibling's own failure, after the kill
    assert slot.ended() == -9  # the first failure is the group's
    # Both seen in one poll (the sibling's collective failed within the interval): the kill
    # is the cause, whichever worker is listed first.
    together = Slot(0, procs=[_FakeProc(1), _FakeProc(-9)])  # type: ignore[list-item]
    assert together.ended() == -9
    # A worker's group watch SIGKILLed its frozen sibling, then exited HUNG: the freeze is the cause.
    frozen = Slot(0, procs=[_FakeProc(-9), _FakeProc(int(ExitCode.HUNG))])  # type: ignore[list-item]
    assert frozen.ended() == ExitCode.HUNG
    both = Slot(0, procs=[_FakeProc(0), _FakeProc(75)])  # type: ignore[list-item]
    assert both.ended() == 75  # ended on their own: the first nonzero code
    assert Slot(0, procs=[_FakeProc(0), _FakeProc(0)]).ended() == 0  # type: ignore[list-item]
    waiting = Slot(0, procs=[_FakeProc(0), _FakeProc(None)])  # type: ignore[list-item]
    assert waiting.ended() is None and killed == [9]  # a worker that finished kills nobody
    # Bad input in one worker ends the group as bad input, whatever its sibling's crash says.
    usage = Slot(0, procs=[_FakeProc(1), _FakeProc(int(ExitCode.USAGE))])  # type: ignore[list-item]
    assert usage.ended() == ExitCode.USAGE
    early = Slot(0, procs=[_FakeProc(int(ExitCode.USAGE)), _FakeProc(None)])  # type: ignore[list-item]
    assert early.ended() is None and killed == [9, 9]  # the sibling is not left blocked


def test_group_sums_are_exact_and_a_single_failure_fails_the_whole_group() -> None:
    from elastic_train.quorum.group_comm import GroupComm

    one = GroupComm()
    t = torch.tensor([1.5, 2.0], dtype=torch.float64)
    assert one.sum(t, True) and one.sum(t, False) is False and t.tolist() == [1.5, 2.0]
    code = """
import sys, torch, torch.distributed as dist
from elastic_train.quorum.group_comm import GroupComm
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
comm = GroupComm.of_default_group()
t = torch.tensor([float(rank) + 0.25, 3.0], dtype=torch.float64)
ok = comm.sum(t, True)
failed = comm.sum(torch.zeros(1, dtype=torch.float64), rank == 0)
print(comm.size, comm.rank, ok, t.tolist(), failed, comm.all(True), comm.all(rank == 1), flush=True)
dist.destroy_process_group()
"""
    rendezvous = Path(tempfile.mkdtemp()) / "rdzv"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r), str(rendezvous)], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for rank, out in enumerate(outs):
        assert out[:3] == ["2", str(rank), "True"] and out[3:5] == ["[1.5,", "6.0]"], out
        assert out[5:] == ["False", "True", "False"], out


def _agent(codes: list[list[int]]) -> Agent:
    agent = Agent.__new__(Agent)
    agent.slots = [Slot(g, codes=c) for g, c in enumerate(codes)]
    agent.failures = [c for slot in codes for c in slot]  # in this order
    return agent


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([[-9, 0], [0]], ExitCode.OK),  # a restarted replica finished: the training did
        ([[0], [-9, -9, -9, -9]], ExitCode.OK),  # one replica gave up, the other finished
        ([[75], [75]], ExitCode.PREEMPTED),
        ([[2], [-15]], ExitCode.USAGE),
        ([[-9], [124]], 124),  # nobody finished: the last failure's code
        ([[124], [-9]], 137),  # a signal as the shell reports it
        ([[130], [130]], ExitCode.INTERRUPTED),  # Ctrl-C
        ([[81, 81], [0]], ExitCode.FINAL_CHECKPOINT_FAILED),  # the others finished, but the end is not on disk
    ],
)
def test_the_agent_exit_status_says_how_the_training_ended(codes: list[list[int]], expected: int) -> None:
    assert _agent(codes).outcome() == expected


def test_quorum_settings_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="needs a Lighthouse"):
        replica_config(TrainConfig(ft="quorum"))
    monkeypatch.setenv("REPLICA_GROUP_ID", "a")
    with pytest.raises(UsageError, match="REPLICA_GROUP_ID"):
        replica_config(TrainConfig(ft="quorum", lighthouse="http://127.0.0.1:1"))
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    config = replica_config(TrainConfig(ft="quorum", lighthouse="http://127.0.0.1:1"))
    assert config.replica_id == "replica_3" and config.collective_timeout_s == 1.0
    with pytest.raises(UsageError, match="--ft"):
        TrainConfig(ft="torchft")


def _replica_in_quorum(groups: int, group_rank: int, group_size: int) -> Replica:
    """A Replica whose Manager reports a quorum of ``groups`` groups, this one the last."""
    replica = object.__new__(Replica)
    replica.config = ReplicaConfig("http://127.0.0.1:1", groups - 1)
    replica.group = _GroupEnv(group_rank, group_size, None, None)
    replica._oversized_in_a_row = 0
    replica.manager = SimpleNamespace(
        start_quorum=lambda: None,
        current_step=lambda: 7,
        num_participants=lambda: groups,
        participating_rank=lambda: groups - 1,
        errors=[],
    )
    replica.manager.report_error = replica.manager.errors.append
    return replica


def test_a_quorum_with_more_members_than_samples_is_refused_and_only_a_standing_one_ends_the_job() -> None:
    schedule = QuorumSchedule(num_samples=64, global_batch=8, seed=0)
    attempt = _replica_in_quorum(groups=4, group_rank=1, group_size=2).begin_step(schedule)
    assert (attempt.world, attempt.rank, len(attempt.share.indices)) == (8, 7, 1)  # 4 x 2 = 8: one sample each
    # A group too many (or a dead group's request counted for a moment): the attempt is refused,
    # so its commit fails and the next quorum is formed, but the job goes on.
    replica = _replica_in_quorum(groups=5, group_rank=1, group_size=2)
    for _ in range(MAX_OVERSIZED_IN_A_ROW):
        refused = replica.begin_step(schedule)
        assert len(refused.share.indices) == 1 and refused.rank == 7  # a valid share; nothing commits
    assert len(replica.manager.errors) == MAX_OVERSIZED_IN_A_ROW  # every one of them voted down
    with pytest.raises(UsageError, match=r"10 members \(5 replica groups of 2 workers\) for a global batch of 8"):
        replica.begin_step(schedule)  # a standing surplus is bad input: exit 2 naming the fix
    with pytest.raises(UsageError, match=r"a replica group of 9 workers cannot share a global batch of 8"):
        QuorumSteps(_replica_in_quorum(groups=1, group_rank=0, group_size=9), schedule)


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        ([], StopKind.NONE),
        ([StopKind.INTERRUPT] * 1000, StopKind.INTERRUPT),
        ([StopKind.INTERRUPT, StopKind.STOP, StopKind.INTERRUPT], StopKind.STOP),
        ([StopKind.STOP] * 999 + [StopKind.PREEMPT], StopKind.PREEMPT),
    ],
)
def test_the_summed_stop_votes_give_the_strongest_kind_asked_for(kinds: list[StopKind], expected: StopKind) -> None:
    """A Ctrl-C on one node's replicas stops every replica as an interrupt (not a preemption a
    job script would requeue); a preemption anywhere wins."""
    total = sum((stop_vote(k) for k in kinds), 0.0)
    assert agreed_stop(total) is expected


def test_the_launcher_names_its_own_thread_share_and_passes_the_users_on_as_the_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic_train.quorum.names import LAUNCHER_THREADS_VAR

    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ours = Agent(parse(["--nproc-per-node", "2", "-m", "elastic_train"])[0], [], "http://127.0.0.1:1")
    env = ours.environ(ours.slots[0])
    assert env["OMP_NUM_THREADS"] == env[LAUNCHER_THREADS_VAR] == "8"  # a default: capped on a GPU
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    users = Agent(parse(["--nproc-per-node", "2", "-m", "elastic_train"])[0], [], "http://127.0.0.1:1")
    env = users.environ(users.slots[0])
    assert env["OMP_NUM_THREADS"] == "3" and LAUNCHER_THREADS_VAR not in env
