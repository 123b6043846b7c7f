"""Impolite ends of a torchrun job: the agent itself dies; bad input found after the process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_train.outcome import ExitCode
from tests.datagen import tiny_imagenet_zip
from tests.helpers import BIN, ROOT, TOKEN_VAR, base_env, events, flags, kill_group, kill_tagged, tagged, torchrun

pytestmark = pytest.mark.timeout(240)
STANDALONE_2 = ["--standalone", "--nproc_per_node=2"]
LONG = flags(batch_size=32, max_steps_per_epoch=500, max_val_samples=64, epochs=20, target_accuracy=1.0, patience=0)


def dirs(base: Path) -> list[str]:
    return ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt")]


def assert_no_worker_traceback(stderr: str) -> None:
    """torchrun prints its own ChildFailedError traceback; none may come from a worker (@record)."""
    assert "elastic_train/" not in stderr and "DataError" not in stderr and "UsageError" not in stderr, stderr


def test_workers_of_a_sigkilled_agent_exit_within_seconds_instead_of_training_on(tmp_path: Path) -> None:
    env = base_env()
    token = env[TOKEN_VAR]
    agent = subprocess.Popen(
        [str(BIN / "torchrun"), *STANDALONE_2, "-m", "elastic_train", *LONG, *dirs(tmp_path)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        progress = tmp_path / "ckpt" / ".progress.json"
        deadline = time.monotonic() + 120
        while not (progress.exists() and json.loads(progress.read_text() or "{}").get("step", 0) >= 2):
            assert agent.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        workers = [pid for pid in tagged(token) if pid != agent.pid]
        assert len(workers) >= 2, workers
        os.kill(agent.pid, signal.SIGKILL)  # the agent only: its workers live in sessions of their own
        agent.wait()
        killed = time.monotonic()
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() - killed < 15:
            time.sleep(0.1)
        took = time.monotonic() - killed
    finally:
        kill_group(agent)
        kill_tagged(token)
    print(f"orphaned workers gone {took:.2f}s after their agent was SIGKILLed")
    assert took < 5, f"orphaned workers still alive {took:.1f}s after their agent died"
    # Each worker notices within its 0.5 s poll; the slower one may first see its peer's socket
    # close in a collective and end with that error instead: either way it is logged.
    lost = [e for rank in (0, 1) for e in events(tmp_path / "logs", rank, "launcher_lost")]
    assert lost and all(e["exit_code"] == ExitCode.ORPHANED for e in lost)
    for rank in (0, 1):
        assert events(tmp_path / "logs", rank, "launcher_lost") or events(tmp_path / "logs", rank, "crashed")


def test_a_missing_data_dir_under_torchrun_exits_2_on_every_rank_with_one_message(tmp_path: Path) -> None:
    done = torchrun(
        STANDALONE_2,
        ["--dataset", "tiny-imagenet", "--data-dir", str(tmp_path / "nonexistent"), *dirs(tmp_path / "run")],
        timeout=90,
    )
    assert done.returncode != 0
    assert done.stderr.count(f"--data-dir {tmp_path / 'nonexistent'} does not exist") == 1, done.stderr
    assert done.stderr.count("exitcode  : 2") == 2, done.stderr  # both ranks, neither SIGTERMed (-15)
    assert_no_worker_traceback(done.stderr)
    assert not (tmp_path / "run").exists(), "nothing may be written for bad input"


def test_a_usage_error_ends_the_launch_at_its_first_attempt_and_restarts_exit_at_once(tmp_path: Path) -> None:
    """Retrying cannot fix input: under --max-restarts=3 the restarts find the first attempt's
    note (before importing torch) and exit 2 with its message, instead of running it all again."""
    done = torchrun(
        [*STANDALONE_2, "--max-restarts=3"],
        ["--dataset", "tiny-imagenet", "--data-dir", str(tmp_path / "nonexistent"), *dirs(tmp_path / "run")],
        timeout=120,
    )
    assert done.returncode != 0
    problem = f"--data-dir {tmp_path / 'nonexistent'} does not exist"
    assert done.stderr.count(problem) == 4, done.stderr  # once per attempt, from rank 0
    assert done.stderr.count("was not tried: retrying cannot fix input") == 3, done.stderr
    assert_no_worker_traceback(done.stderr)
    assert not (tmp_path / "run").exists(), "nothing may be written for bad input"


def test_corrupt_data_found_after_the_process_group_exits_2_on_every_rank_without_a_traceback(tmp_path: Path) -> None:
    data = tmp_path / "data"
    tiny_imagenet_zip(data)
    archive = next(data.glob("*.zip"))
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 3])  # truncated download
    done = torchrun(
        STANDALONE_2, ["--dataset", "tiny-imagenet", "--data-dir", str(data), *dirs(tmp_path / "run")], timeout=120
    )
    assert done.returncode != 0
    assert done.stderr.count("elastic-train: error:") == 1, done.stderr
    assert done.stderr.count("exitcode  : 2") == 2, done.stderr
    assert_no_worker_traceback(done.stderr)
    assert not done.leftovers
