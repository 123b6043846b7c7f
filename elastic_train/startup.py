"""How long a worker takes to become useful: the phases from process start to the first step.

A restart costs the launcher's detection and rendezvous, then this startup (interpreter and
imports, process group, data, checkpoint load). The ``start`` log event carries the phases so a
slow recovery can be attributed without a profiler (``benchmarks/recovery.py`` reports them).
"""

from __future__ import annotations

import os
import time


def process_start_time(pid: int | None = None) -> float:
    """Wall-clock time process ``pid`` (default: this one) was started by the kernel; this
    module's import time where /proc cannot say."""
    try:
        with open(f"/proc/{pid if pid is not None else 'self'}/stat") as f:
            # Field 22 (starttime, clock ticks since boot); the command name may contain spaces.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        # Against the boot clock, not /proc/stat's btime: btime has a resolution of 1 s.
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


class StartupClock:
    """Marks the end of each startup phase; ``phases()`` gives seconds per phase, in order."""

    def __init__(self, launcher_pid: int | None = None) -> None:
        self.started = process_start_time()
        # When this launch began: its launcher's start (torchrun's agent, the warm launcher's
        # forkserver), else this process's. Goodput's time between launches ends here.
        self.launch_started = min(self.started, process_start_time(launcher_pid)) if launcher_pid else self.started
        self._marks: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self._marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        out, previous = {}, self.started
        for phase, at in self._marks:
            out[phase] = round(max(0.0, at - previous), 3)
            previous = at
        return out
