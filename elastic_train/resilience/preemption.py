"""Preemption: SIGTERM, SIGUSR1 and SIGUSR2 ask the run to checkpoint and exit.

The handlers only record the request. At the next step boundary the trainer MAX-all-reduces
the flag (so a signal that reached one rank stops all of them at the same step), every rank takes
part in a synchronous checkpoint commit, rank 0 writes ``<checkpoint-dir>/.preempted.json``,
and every process exits with ``EXIT_PREEMPTED`` (75, EX_TEMPFAIL: "try again later"), distinct
from success (0), bad input (2) and a crash (1). Repeated signals are ignored: Slurm signals
every process of a job step and torchrun forwards the agent's signals too, so a worker often
receives each signal twice; the hard stop is the launcher's SIGKILL after its grace period.

torchrun forwards SIGTERM to its workers and kills them about 30 s later: the checkpoint must be
committed inside that grace period. torchrun itself then exits 1, whatever the workers returned,
which is why the marker file exists: a job script learns from it that the run was preempted
(and at which step) rather than crashed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
MARKER = ".preempted.json"
LAUNCH_ID_VAR = "ELASTIC_TRAIN_LAUNCH_ID"


class Preempted(Exception):
    """Raised by the trainer after the preemption checkpoint; ``run`` turns it into exit 75."""

    def __init__(self, step: int, committed: bool) -> None:
        super().__init__(f"preempted at step {step} (checkpoint {'committed' if committed else 'FAILED'})")
        self.step = step
        self.committed = committed


class PreemptionFlag:
    """Set by a signal handler; read at step boundaries. Install from the main thread only."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:  # only flags: no logging, no I/O inside a handler
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.time()


def write_marker(checkpoint_dir: Path, step: int, signal_name: str, committed: bool) -> Path:
    path = checkpoint_dir / MARKER
    tmp = path.with_name(f"{MARKER}.tmp-{os.getpid()}")
    record = {
        "step": step,
        "signal": signal_name,
        "committed": committed,
        "time": time.time(),
        "exit_code": EXIT_PREEMPTED,
        # Set by the job scripts for each launch: they requeue only on a marker of their own launch.
        "launch_id": os.environ.get(LAUNCH_ID_VAR),
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def clear_marker(checkpoint_dir: Path) -> None:
    (checkpoint_dir / MARKER).unlink(missing_ok=True)
