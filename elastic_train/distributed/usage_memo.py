"""A usage error ends the launch at its first attempt: later attempts exit 2 at once.

torchrun restarts its workers on any non-zero exit, so a bad flag or missing data under
``--max-restarts=3`` used to run four times over (32 s on the test machine) and print its
message four times. Retrying cannot fix input. The first attempt that finds a usage error
leaves a note for its launch; every later attempt of the *same launch* finds it before importing
torch and exits 2 with the same message, saying it was not tried again.

What "the same launch" is: the launcher process (torchrun's agent, the warm launcher's
forkserver) identified by its pid *and* its start time (``/proc/<pid>/stat``), so a pid reused
by a later launch never matches, and neither does a second run beside this one. Nothing here
relies on the rendezvous id: plain ``torchrun --rdzv-backend=c10d`` gives every job the id
``none``. The note lives on this host (``$TMPDIR/elastic-train-<uid>/``): a multi-node job's
nodes each find the error themselves (they read the same flags and data). Notes of launchers
that are gone are removed when a new one is written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Launch:
    """One launcher process on this host."""

    pid: int
    started: str  # the process's start time in clock ticks since boot, as /proc shows it

    @property
    def key(self) -> str:
        return f"{self.pid}-{self.started}"


def _started(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of proc(5), after "pid (comm)"


def launch_of(launcher_pid: int) -> Launch | None:
    """The launch ``launcher_pid`` stands for, or None where /proc cannot say (then nothing is noted)."""
    started = _started(launcher_pid)
    return Launch(launcher_pid, started) if started is not None else None


def memo_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"elastic-train-{os.getuid()}"


def _path(launch: Launch) -> Path:
    return memo_dir() / f"usage-error-{launch.key}.txt"


def remember(launch: Launch, message: str) -> None:
    """Note ``message`` for the later attempts of ``launch``. Best effort: a note that cannot be
    written costs the retries it would have saved, nothing else."""
    with contextlib.suppress(OSError):
        folder = memo_dir()
        folder.mkdir(mode=0o700, exist_ok=True)
        _forget_gone(folder)
        path = _path(launch)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(message)
        os.replace(tmp, path)


def recall(launch: Launch) -> str | None:
    """The usage error an earlier attempt of ``launch`` met, if any."""
    try:
        return _path(launch).read_text()
    except OSError:
        return None


def _forget_gone(folder: Path) -> None:
    for note in folder.glob("usage-error-*.txt"):
        pid, _, started = note.stem.removeprefix("usage-error-").partition("-")
        if not pid.isdigit() or _started(int(pid)) != started:
            with contextlib.suppress(OSError):
                note.unlink()
