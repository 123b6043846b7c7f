"""The test harness's own promise: a hung child fails its test quickly, says where it hung, and
leaves nothing behind, even when a grandchild in a session of its own holds the output pipes
(torchrun's workers and their DataLoader workers do: a hung run once kept a CI test reading for
ever after its timeout, with no stack to show where it hung)."""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest

from elastic_train.testing.processes import carrying, run
from tests.helpers import QUICK, cli, cli_process, dirs

# A parent that enables faulthandler (as the trainer does) and starts a child in a new session
# that keeps stdout/stderr open; the parent then hangs in a function named for the test to find.
HUNG = """
import faulthandler, subprocess, sys, time
faulthandler.enable(all_threads=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("started", flush=True)
def stuck_in_a_named_place():
    time.sleep(600)
stuck_in_a_named_place()
"""


@pytest.mark.timeout(60)
def test_a_hung_run_fails_with_its_stack_and_leaves_no_process() -> None:
    mark = uuid.uuid4().hex
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run([sys.executable, "-c", HUNG], timeout=3, env={"MARK": mark})
    message = str(failed.value)
    assert time.monotonic() - start < 30, "reading the output waited on the grandchild's pipes"
    assert "timed out after 3s" in message and "started" in message
    assert "stuck_in_a_named_place" in message, message[-2000:]  # faulthandler's dump on SIGABRT
    assert carrying("MARK", mark) == [], "a process outlived the timed-out run"


def _in_session(sid: int) -> list[int]:
    """Live processes of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # the session id; a zombie is gone
                found.append(int(entry))
    return found


@pytest.mark.timeout(180)
def test_a_forked_trainer_run_ends_as_a_fresh_interpreters_does(tmp_path: Path) -> None:
    """``tests.helpers.cli`` forks the trainer from a server that imported torch (most process
    tests run it so): its exit code and output must be a fresh ``python -m elastic_train``'s,
    for a run killed mid-way (its exit code, the lines printed before the kill), bad input, and a hang
    (the stack shown, nothing left behind, its DataLoader worker included)."""
    run_ = [*QUICK, "--num-workers", "1"]
    for name, launch in (("forked", cli), ("fresh", cli_process)):
        killed = launch([*run_, *dirs(tmp_path / name)], env={"ELASTIC_TRAIN_FAULTS": "kill:rank=0:step=2"})
        assert killed.returncode == -9, killed.output[-3000:]
        assert killed.stdout.splitlines()[0] == "Training started with 1 processes", (name, killed.stdout)
        bad = launch(["--batch-size", "0", *dirs(tmp_path / name / "bad")])
        assert bad.returncode == 2 and "--batch-size" in bad.stderr and "Traceback" not in bad.stderr, bad.output
    with pytest.raises(AssertionError) as hung:
        cli([*run_, *dirs(tmp_path / "hung")], timeout=25, env={"ELASTIC_TRAIN_FAULTS": "hang:rank=0:step=1"})
    message = str(hung.value)
    assert "still running after 25s" in message and "at_step" in message, message[-3000:]  # faulthandler's stack
    session = re.search(r"sessions (\d+), ended", message)
    assert session is not None, message[:500]
    deadline = time.monotonic() + 10  # SIGKILLed: gone once the kernel has torn each down
    while _in_session(int(session.group(1))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_session(int(session.group(1))) == [], "a process of the hung run outlived it"
