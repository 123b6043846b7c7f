"""The test harness's own promise: a hung child fails its test quickly, says where it hung, and
leaves nothing behind, even when a grandchild in a session of its own holds the output pipes
(torchrun's workers and their DataLoader workers do: a hung run once kept a CI test reading for
ever after its timeout, with no stack to show where it hung)."""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from elastic_train.testing.processes import carrying, run

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
