"""The job's identity (the checkpoint lock's owner), the read-only ownership check, a lost lock
stopping the run, and stop markers that say a failed stop save failed (issue 17, point 5)."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic_train.checkpoint.lock import CheckpointLock
from elastic_train.distributed.env import JOB_ID_VAR, JOB_STORE_VAR, DistEnv
from elastic_train.distributed.identity import mint_in_store, resolve_job
from elastic_train.errors import UsageError
from elastic_train.outcome import (
    LAUNCH_ID_VAR,
    LOCK_LOST_MARKER,
    ExitCode,
    RestartCause,
    clear_markers,
    lock_lost_marker,
    previous_exit_cause,
    read_marker,
    stop_marker,
    write_marker,
    write_stop_marker,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def test_torchruns_default_run_id_names_no_job_and_must_be_minted() -> None:
    env = DistEnv.from_environ({**WORKER, "TORCHELASTIC_RUN_ID": "none"})
    assert env.needs_minted_job


def test_a_named_job_wins_slurm_next_then_an_explicit_run_id() -> None:
    base = {**WORKER, "TORCHELASTIC_RUN_ID": "mine"}
    assert DistEnv.from_environ(base).job_id == "mine"
    assert DistEnv.from_environ({**base, "SLURM_JOB_ID": "42"}).job_id == "slurm-42"
    assert DistEnv.from_environ({**base, "SLURM_JOB_ID": "42", JOB_ID_VAR: "given"}).job_id == "given"
    # The agent script's generic run id with its rendezvous store: minted there, not trusted.
    assert DistEnv.from_environ({**base, JOB_STORE_VAR: "h:1"}).needs_minted_job


def test_the_shared_agent_store_is_where_an_identity_is_kept() -> None:
    shared = {**WORKER, "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    assert DistEnv.from_environ({**shared, "TORCHELASTIC_USE_AGENT_STORE": "True"}).identity_store == "h:7"
    assert DistEnv.from_environ({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}).identity_store == ""


def test_a_minted_identity_survives_a_restart_and_differs_in_another_store() -> None:
    first = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    env = {**WORKER, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    one = resolve_job(DistEnv.from_environ({**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(first.port)}))
    again = resolve_job(DistEnv.from_environ({**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(first.port)}))
    two = resolve_job(DistEnv.from_environ({**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(other.port)}))
    assert one.job_id == again.job_id != two.job_id
    assert one.job_id.startswith("job-")
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", first.port, is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    assert mint_in_store(client, "none") == one.job_id


def test_without_a_store_the_launchers_identity_is_used() -> None:
    env = resolve_job(DistEnv.from_environ({**WORKER, "TORCHELASTIC_RUN_ID": "none"}), launcher_pid=os.getpid())
    assert env.job_id.startswith("agent-") and str(os.getpid()) in env.job_id


# ------------------------------------------------------------------ the lock


def test_the_read_only_check_refuses_another_job_and_takes_nothing_from_this_one(tmp_path: Path) -> None:
    saver = CheckpointLock(tmp_path, owner="job-a", ttl_s=60)
    saver.acquire()
    try:
        inode = os.stat(saver.path).st_ino
        CheckpointLock(tmp_path, owner="job-a", ttl_s=60).check_available()  # this job: passes
        with pytest.raises(UsageError, match="is in use by"):
            CheckpointLock(tmp_path, owner="job-b", ttl_s=60).check_available()
        assert os.stat(saver.path).st_ino == inode and not saver.lost(), "the check took the lock"
    finally:
        saver.release()


def test_a_lock_taken_over_is_seen_as_lost_until_taken_again(tmp_path: Path) -> None:
    old = CheckpointLock(tmp_path, owner="job-a", ttl_s=0.01)
    old.acquire()
    thief = CheckpointLock(tmp_path, owner="job-b", ttl_s=60)
    try:
        os.utime(old.path, (0, 0))  # stale
        thief.acquire()
        assert not old.was_lost  # not looked yet (heartbeat or commit)
        with old.still_held() as held:
            assert not held
        assert old.was_lost
    finally:
        thief.release()
        old.release()


# ------------------------------------------------------------------ markers and codes


def test_lock_lost_has_its_own_code_and_marker_that_no_attempt_books_or_clears(tmp_path: Path) -> None:
    marker = lock_lost_marker(7)
    assert marker.exit_code is ExitCode.LOCK_LOST == 80 and marker.file_name == LOCK_LOST_MARKER
    path = write_marker(tmp_path, marker)
    assert read_marker(path) == marker
    assert previous_exit_cause(tmp_path, since=0) is RestartCause.FAILURE
    clear_markers(tmp_path)
    assert path.exists()


def test_a_failed_stop_save_writes_its_marker_but_never_hides_a_committed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCH_ID_VAR, "1.0.2.3")
    failed = stop_marker(RestartCause.PREEMPTION, 5, "SIGUSR1", committed=False)
    path = write_stop_marker(tmp_path, failed)
    assert path is not None and read_marker(path) == failed
    ok = stop_marker(RestartCause.PREEMPTION, 5, "SIGUSR1", committed=True)
    write_stop_marker(tmp_path, ok)
    assert write_stop_marker(tmp_path, failed) is None  # a peer replica that did not save
    found = read_marker(tmp_path / failed.file_name)
    assert found is not None and found.committed


def test_the_job_script_does_not_requeue_a_launch_that_lost_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCH_ID_VAR, "9.0.1.2")
    write_marker(tmp_path, lock_lost_marker(11))
    script = f'source "{ROOT}/jobs/lib/common.sh"; ET_CHECKPOINT_DIR="{tmp_path}"; SLURM_JOB_ID=9 et_finish 1'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == ExitCode.LOCK_LOST, done.stdout + done.stderr
    assert "not requeued" in done.stdout + done.stderr and "step 11" in done.stdout + done.stderr
