"""Ctrl-C in a terminal: ``python -m elastic_train`` gets SIGINT with its whole process group.

The signal is sent to the process group, as a terminal does (DataLoader workers included), while
the trainer is held at the start of step 3 (a ``hold`` fault, released by the test), so the stop
step is known. The first Ctrl-C ends the run like a stop: a checkpoint of the step, one line
saying how to continue, exit 130; the rerun continues bitwise. A second Ctrl-C ends it at once.
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
from tests.helpers import ROOT, assert_bitwise_equal, base_env, cli, dirs, final_state, flags, kill_group

pytestmark = pytest.mark.timeout(240)
RUN = flags(
    batch_size=32,
    max_steps_per_epoch=5,
    max_val_samples=64,
    epochs=2,
    target_accuracy=1.0,
    patience=0,
    checkpoint_every=2,
    image_size=16,
    num_workers=1,  # a loader worker in the terminal's process group, as users run it
)


def _start(base: Path, step: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elastic_train", *RUN, *dirs(base)],
        env=base_env({"ELASTIC_TRAIN_FAULTS": f"hold:rank=0:step={step}:until=go"}),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the test's "terminal"
    )


def _wait_held(proc: subprocess.Popen[str], base: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (base / "ckpt" / ".faults" / f"fault-hold-rank0-step{step}-untilgo.fired").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the run never reached step {step}"
        time.sleep(0.05)


def test_ctrl_c_checkpoints_the_step_exits_130_and_a_rerun_continues_bitwise(tmp_path: Path) -> None:
    reference = cli([*RUN, *dirs(tmp_path / "reference")])
    assert reference.returncode == 0, reference.output
    base = tmp_path / "interrupted"
    proc = _start(base, 3)
    try:
        _wait_held(proc, base, 3)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        time.sleep(0.2)
        (base / "ckpt" / ".faults" / "go").write_text("")
        released = time.time()
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == ExitCode.INTERRUPTED, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    marker = read_marker(base / "ckpt" / INTERRUPTED_MARKER)
    assert marker is not None and marker.committed and marker.signal == "SIGINT", out
    assert f"Interrupted by SIGINT at step {marker.step}: checkpoint committed; exiting with code 130" in out, out
    assert "To continue, run the same command again" in out
    assert latest_target(base / "ckpt") == base / "ckpt" / f"step-{marker.step:08d}"
    # The same command again, after a pause: it resumes at the stop step and ends where the
    # reference ended; the pause is time between launches, neither lost nor the job's.
    time.sleep(3)
    relaunched = time.time()
    again = cli([*RUN, *dirs(base)])
    assert again.returncode == 0, again.output
    assert f"step {marker.step}" in again.stdout and "(interrupt: 1)" in again.stdout, again.stdout
    between = float(again.stdout.split("seconds (")[1].split(" s between launches")[0])
    lost = float(again.stdout.split("Time lost to recovery: ")[1].split()[0])
    # The pause (from the stop's end to the relaunch) is booked between launches, whatever the
    # machine's load; what is lost is the second run's own start-up, inside its own wall time.
    assert 3 <= between <= relaunched - released + 1.0, again.stdout
    assert lost < again.seconds, again.stdout
    assert not (base / "ckpt" / INTERRUPTED_MARKER).exists()
    assert_bitwise_equal(final_state(base), final_state(tmp_path / "reference"))


def test_a_second_ctrl_c_ends_at_once_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    proc = _start(tmp_path, 5)  # by then step 2's checkpoint is committed
    try:
        _wait_held(proc, tmp_path, 5)  # never released: only the second Ctrl-C can end it
        before = latest_target(tmp_path / "ckpt")
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)  # a person's second press, not a copy of the first
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        ended_s = time.monotonic() - began
        out, err = proc.communicate(timeout=30)  # the loader worker, still holding the pipes, follows
    finally:
        kill_group(proc)
    assert proc.returncode == ExitCode.INTERRUPTED, out + err
    assert ended_s < 5, f"the second Ctrl-C took {ended_s:.1f}s"
    assert "Second Ctrl-C: exiting now without a checkpoint" in err, err
    assert before is not None and latest_target(tmp_path / "ckpt") == before
    verify = subprocess.run(
        [sys.executable, "-m", "elastic_train.ckpt", "verify", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
