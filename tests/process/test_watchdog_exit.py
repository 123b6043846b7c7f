"""A rank the watchdog ends takes its DataLoader workers with it, even one that is itself the hang.

``os._exit`` skips the atexit hook that ends daemonic children, and a loader worker deadlocked in
a dataset's code never looks at its parent: left alone it outlives the rank, holding memory and
the launcher's output pipes (a test once waited on such pipes until its timeout)."""

from __future__ import annotations

import sys
import uuid

import pytest

from elastic_train.testing.processes import carrying
from tests.helpers import run

STUCK_LOADER = """
import os, time
import torch
from torch.utils.data import DataLoader, Dataset
from elastic_train.resilience.watchdog import StepWatchdog

class Stuck(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        time.sleep(600)  # a worker that never answers and never returns to its loop

dog = StepWatchdog(2.0, rank=0, poll_s=0.2)
dog.start()
print("started", flush=True)
next(iter(DataLoader(Stuck(), num_workers=1, persistent_workers=True)))
"""


@pytest.mark.timeout(120)
def test_a_hung_rank_s_exit_ends_its_stuck_loader_worker_too() -> None:
    mark = uuid.uuid4().hex
    done = run([sys.executable, "-c", STUCK_LOADER], timeout=90, env={"MARK": mark})
    assert done.returncode == 124, done.output  # ExitCode.HUNG
    assert "hang_detected" in done.output and "in __next__" in done.stderr  # the stack dump: in the loader
    # The worker holds the output pipes: had it survived, ``run`` would still be reading them.
    assert not done.leftovers and carrying("MARK", mark) == [], "the loader worker outlived its rank"
