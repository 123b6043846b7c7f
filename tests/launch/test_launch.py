"""``python -m elastic_train.launch``: torchrun's agent with workers forked from a preloaded process.

The restarted workers must behave exactly like torchrun's (same env, exact resume, signals, exit
codes) while skipping the interpreter start-up and the imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_train.outcome import PREEMPTED_MARKER, STOPPED_MARKER, ExitCode, read_marker
from tests.helpers import (
    RESUME_RUN,
    ROOT,
    Finished,
    assert_bitwise_equal,
    base_env,
    dirs,
    epoch_metrics,
    final_state,
    flags,
    kill_group,
    kill_tagged,
    load_chaos,
    pid_alive,
    read_jsonl,
    resume_run_at_2,
    run,
)

pytestmark = pytest.mark.timeout(300)
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STANDALONE_2 = ["--standalone", "--nproc_per_node=2"]


def warm(launch_args: list[str], args: list[str], env: dict[str, str] | None = None) -> Finished:
    cmd = [sys.executable, "-m", "elastic_train.launch", *launch_args, "-m", "elastic_train", *args]
    return run(cmd, 240, {**AGENT_ENV, **(env or {})})


def test_a_killed_worker_is_forked_again_warm_and_ends_bitwise_equal(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = resume_run_at_2(tmp_path_factory)  # torchrun's, shared with test_checkpoint_torchrun.py
    ours = tmp_path / "warm"
    done = warm(
        [*STANDALONE_2, "--max-restarts=1"], [*RESUME_RUN, *dirs(ours)], {"ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=8"}
    )
    assert done.returncode == 0, done.output
    assert "Resumed from" in done.stdout and "Restarts: 1 (failure: 1)" in done.stdout
    assert "Training completed successfully." in done.stdout and not done.leftovers
    assert_bitwise_equal(final_state(reference), final_state(ours))
    assert epoch_metrics(ours) == epoch_metrics(reference)
    # Forked from the preloaded server: no interpreter start-up, no imports (torchrun's take ~3 s here).
    starts = [e for e in read_jsonl(ours / "logs" / "rank-1.jsonl") if e.get("event") == "start"]
    assert len(starts) == 2 and all(e["startup_s"]["interpreter_and_imports"] < 1.0 for e in starts), starts


def test_sigterm_to_the_warm_launcher_checkpoints_and_is_booked_as_a_stop_not_a_preemption(tmp_path: Path) -> None:
    short = flags(
        batch_size=32,
        max_steps_per_epoch=6,
        max_val_samples=64,
        epochs=2,
        target_accuracy=1.0,
        patience=0,
        checkpoint_every=2,
    )
    args = [*short, *dirs(tmp_path)]
    # Rank 0 holds at the start of step 5 (step 2's checkpoint committed) until the test releases
    # it after the signal: the stop lands mid-run whatever the machine's speed.
    env = base_env({**AGENT_ENV, "ELASTIC_TRAIN_FAULTS": "hold:rank=0:step=5:until=go"})
    cmd = [sys.executable, "-m", "elastic_train.launch", *STANDALONE_2, "-m", "elastic_train", *args]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        faults = tmp_path / "ckpt" / ".faults"
        while not (faults / "fault-hold-rank0-step5-untilgo.fired").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the agent forwards it to both forked workers
        time.sleep(0.3)
        (faults / "go").write_text("")
        out, err = proc.communicate(timeout=90)
    finally:
        kill_group(proc)
        kill_tagged(env["ELASTIC_TRAIN_TEST_TOKEN"])
    # torchrun's SIGTERM is "the launcher stops its workers", not the scheduler's preemption:
    # a checkpoint, exit 76 and .stopped.json; no .preempted.json that a job script would requeue on.
    assert not (tmp_path / "ckpt" / PREEMPTED_MARKER).exists()
    marker = read_marker(tmp_path / "ckpt" / STOPPED_MARKER)
    assert marker is not None and marker.committed and marker.signal == "SIGTERM", out + err
    exits = [e for e in read_jsonl(tmp_path / "logs" / "rank-0.jsonl") if e.get("event") == "exit"]
    assert exits and exits[-1]["code"] == ExitCode.STOPPED
    resumed = warm(STANDALONE_2, args)
    assert resumed.returncode == 0, resumed.output
    assert f"step {marker.step}" in resumed.stdout and "Steps recomputed: 0" in resumed.stdout
    assert "(stop: 1)" in resumed.stdout


def test_finished_workers_exit_without_waiting_for_the_agent(tmp_path: Path) -> None:
    """torch's agent, once every worker's result is in, sets an Event that waits until every
    worker sleeping on it has woken: a worker SIGKILLed in that wait left the agent blocked forever
    (the goodput soak's last kill met it, Dec 7). Our workers hand in their result and exit without
    the wait: with the agent frozen they still end, and the thawed agent then exits 0."""
    short = flags(batch_size=32, max_steps_per_epoch=4, max_val_samples=64, epochs=1, target_accuracy=1.0)
    env = base_env({**AGENT_ENV, "ELASTIC_TRAIN_FAULTS": "hold:rank=0:step=4:until=go"})  # the last step
    cmd = [sys.executable, "-m", "elastic_train.launch", *STANDALONE_2, "-m", "elastic_train", *short, *dirs(tmp_path)]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    token = env["ELASTIC_TRAIN_TEST_TOKEN"]
    try:
        faults = tmp_path / "ckpt" / ".faults"
        deadline = time.monotonic() + 120
        while not (faults / "fault-hold-rank0-step4-untilgo.fired").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = load_chaos().workers(str(tmp_path))  # those the launcher's forkserver forked
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGSTOP)  # the agent reads no result and sets no Event from now on
        (faults / "go").write_text("")
        deadline = time.monotonic() + 60
        while any(pid_alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"finished workers {workers} still wait for the frozen agent"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        kill_group(proc)
        kill_tagged(token)
    assert proc.returncode == 0, out + err
    assert "Training completed successfully." in out


def test_only_the_trainer_can_be_launched(tmp_path: Path) -> None:
    done = run([sys.executable, "-m", "elastic_train.launch", "--standalone", "-m", "json.tool"], timeout=60)
    assert done.returncode == 2 and "it launches the trainer only" in done.stderr
