"""Ctrl-C under each launcher: torchrun, the warm launcher, the quorum launcher.

A terminal sends SIGINT to its foreground process group: the launcher. Their workers sit in
sessions of their own, so only the launcher's forwarded SIGINT reaches them. Every worker must
checkpoint the agreed step and exit 130 (no restart), and the same command again must continue
from it. Rank 0 is held at the start of step 3 (a ``hold`` fault) when the signal is sent, so the
stop lands in a known place.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import latest_target
from elastic_train.outcome import INTERRUPTED_MARKER, ExitCode, read_marker
from tests.helpers import (
    BIN,
    ROOT,
    assert_bitwise_equal,
    base_env,
    dirs,
    final_state,
    flags,
    kill_group,
    kill_tagged,
    read_jsonl,
    reference_run,
    run,
    torchrun,
)

pytestmark = pytest.mark.timeout(300)
RUN = flags(
    batch_size=32,
    max_steps_per_epoch=5,
    max_val_samples=64,
    epochs=2,
    target_accuracy=1.0,
    patience=0,
    checkpoint_every=2,
    image_size=16,
)
STANDALONE_2 = ["--standalone", "--nproc_per_node=2"]
HOLD = {"ELASTIC_TRAIN_FAULTS": "hold:rank=0:step=3:until=go"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("interrupt-reference")
    reference_run(2, [*RUN, *dirs(base)])
    return base


def _interrupt(cmd: list[str], base: Path, fired: str) -> tuple[int, str]:
    """Start ``cmd`` as a terminal would, Ctrl-C it once rank 0 is held, release the hold."""
    env = base_env(HOLD)
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 150
        while not (base / "ckpt" / ".faults" / fired).exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "rank 0 never reached step 3"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's foreground group: the launcher only
        time.sleep(0.3)
        (base / "ckpt" / ".faults" / "go").write_text("")
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
        kill_tagged(env["ELASTIC_TRAIN_TEST_TOKEN"])
    return proc.returncode, out


def _assert_interrupted(base: Path, out: str, ranks: int) -> int:
    marker = read_marker(base / "ckpt" / INTERRUPTED_MARKER)
    assert marker is not None and marker.committed and marker.signal == "SIGINT", out
    assert f"at step {marker.step}: checkpoint committed; exiting with code 130" in out, out
    assert "To continue, run the same command again" in out
    for rank in range(ranks):
        exits = [e for e in read_jsonl(base / "logs" / f"rank-{rank}.jsonl") if e.get("event") == "exit"]
        assert exits and exits[-1]["code"] == ExitCode.INTERRUPTED, f"rank {rank}: {exits}"
    starts = [e for e in read_jsonl(base / "logs" / "rank-0.jsonl") if e.get("event") == "start"]
    assert len(starts) == 1, "the launcher restarted its workers after a Ctrl-C"
    return marker.step


def test_ctrl_c_on_torchrun_checkpoints_exits_130_in_every_worker_and_a_rerun_continues_bitwise(
    tmp_path: Path, reference: Path
) -> None:
    cmd = [str(BIN / "torchrun"), *STANDALONE_2, "--max-restarts=3", "-m", "elastic_train", *RUN, *dirs(tmp_path)]
    code, out = _interrupt(cmd, tmp_path, "fault-hold-rank0-step3-untilgo.fired")
    assert code != 0, out  # torchrun's own: 1 ("got signal: 2"); the workers' 130 is in their logs
    step = _assert_interrupted(tmp_path, out, ranks=2)
    again = torchrun([*STANDALONE_2, "--max-restarts=3"], [*RUN, *dirs(tmp_path)])
    assert again.returncode == 0, again.output
    assert f"step {step}" in again.stdout and "(interrupt: 1)" in again.stdout, again.stdout
    assert_bitwise_equal(final_state(tmp_path), final_state(reference))


def test_ctrl_c_on_the_warm_launcher_exits_130_and_a_rerun_continues_bitwise(tmp_path: Path, reference: Path) -> None:
    launch = [sys.executable, "-m", "elastic_train.launch", *STANDALONE_2, "--max-restarts=3"]
    code, out = _interrupt(
        [*launch, "-m", "elastic_train", *RUN, *dirs(tmp_path)], tmp_path, "fault-hold-rank0-step3-untilgo.fired"
    )
    assert code == ExitCode.INTERRUPTED, out
    assert "Traceback" not in out, out
    _assert_interrupted(tmp_path, out, ranks=2)
    again = run([*launch, "-m", "elastic_train", *RUN, *dirs(tmp_path)], timeout=180)
    assert again.returncode == 0, again.output
    assert_bitwise_equal(final_state(tmp_path), final_state(reference))


def test_ctrl_c_on_the_quorum_launcher_exits_130_and_a_rerun_continues(tmp_path: Path) -> None:
    launch = [sys.executable, "-m", "elastic_train.quorum.launch", "--nproc-per-node", "2"]
    code, out = _interrupt(
        [*launch, "-m", "elastic_train", *RUN, *dirs(tmp_path)], tmp_path, "fault-hold-rank0-step3-untilgo.fired"
    )
    assert code == ExitCode.INTERRUPTED, out
    marker = read_marker(tmp_path / "ckpt" / INTERRUPTED_MARKER)
    assert marker is not None and marker.committed, out
    assert "exiting with code 130" in out and "To continue, run the same command again" in out, out
    assert "restarting" not in out, out
    again = run([*launch, "-m", "elastic_train", *RUN, *dirs(tmp_path)], timeout=180)
    assert again.returncode == 0, again.output
    assert f"step {marker.step}" in again.stdout, again.stdout


def test_a_failed_final_save_in_quorum_mode_is_the_jobs_failure_not_a_success(tmp_path: Path) -> None:
    """Participant 0 (whichever replica group it is) cannot write the final checkpoint: the other has
    finished the same training, but the job's end is not on disk, so the agent exits 81."""
    launch = [sys.executable, "-m", "elastic_train.quorum.launch", "--nproc-per-node", "2", "--max-restarts", "0"]
    short = flags(
        batch_size=32,
        max_steps_per_epoch=4,
        max_val_samples=64,
        epochs=1,
        target_accuracy=1.0,
        image_size=16,
        log_every=1,
    )
    done = run(
        [*launch, "-m", "elastic_train", *short, *dirs(tmp_path)],
        timeout=180,
        env={"ELASTIC_TRAIN_FAULTS": "enospc:rank=0:step=4,enospc:rank=1:step=4"},
    )
    assert done.returncode == ExitCode.FINAL_CHECKPOINT_FAILED, done.output
    assert "Training finished at step 4, but its final checkpoint could NOT be committed" in done.stdout, done.output
    assert not (tmp_path / "ckpt" / "step-00000004").exists(), "the failed save's files were left behind"
    # The per-step curve: each committed step once, written by its participant 0 (the global loss).
    curve = read_jsonl(tmp_path / "logs" / "steps.jsonl")
    assert [line["step"] for line in curve] == [1, 2, 3, 4] and all(line["loss"] > 0 for line in curve), curve


@pytest.mark.parametrize("launcher", ["torchrun", "warm"])
def test_a_second_ctrl_c_on_a_launcher_ends_its_workers_at_once(tmp_path: Path, launcher: str) -> None:
    """torch's agent, interrupted a second time while it waits for its workers, stops them with
    SIGTERM (not the second SIGINT): the workers take it as the second press and exit 130 at
    once, keeping the last committed checkpoint, long before the agent's 30 s SIGKILL."""
    head = [str(BIN / "torchrun")] if launcher == "torchrun" else [sys.executable, "-m", "elastic_train.launch"]
    cmd = [*head, *STANDALONE_2, "-m", "elastic_train", *RUN, *dirs(tmp_path)]
    env = base_env({"ELASTIC_TRAIN_FAULTS": "hold:rank=0:step=5:until=never"})  # never released
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "ckpt" / ".faults" / "fault-hold-rank0-step5-untilnever.fired").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "rank 0 never reached step 5"
            time.sleep(0.05)
        before = latest_target(tmp_path / "ckpt")
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        kill_group(proc)
        kill_tagged(env["ELASTIC_TRAIN_TEST_TOKEN"])
    # Before the agent's 30 s SIGKILL: the workers print their line at once, but on a loaded
    # 2-core machine the exits of the workers, the agent and its forkserver took 15.9 s once.
    assert took < 25, f"the second Ctrl-C took {took:.1f}s:\n{out[-3000:]}"
    assert "Second Ctrl-C: exiting now without a checkpoint" in out, out[-3000:]
    assert proc.returncode != 0 and (launcher == "torchrun" or proc.returncode == ExitCode.INTERRUPTED), out[-2000:]
    assert before is not None and latest_target(tmp_path / "ckpt") == before
