"""How an attempt ended: exit codes, marker files and restart causes, in one place.

An *attempt* is one launch of the workers (torchrun starts one per restart, Slurm one per
requeue). It tells whoever comes next how it ended through two channels, both defined here:

* the **exit code** of every worker (``ExitCode``). torchrun restarts the group on any code but 0
  (within its budget); torchrun itself then exits 1 whatever its workers returned, so the job
  scripts cannot rely on a worker's code;
* **marker files** in the checkpoint directory (``Marker``): read by the job script after the
  launcher returns (``jobs/lib/common.sh``: a preemption marker of its own launch means
  "requeue") and by the next attempt's goodput accounting (``previous_exit_cause``).

``python -m elastic_train.outcome table`` prints the table of codes and markers that
``docs/fault-tolerance.md`` carries (a test keeps the two equal).

**Marker lifecycle.** Rank 0 of an attempt writes ``.preempted.json``, ``.stopped.json`` or
``.interrupted.json`` after
its stop checkpoint; rank *r*'s step watchdog writes ``.hang-rank-<r>.json`` before it exits
``HUNG``. When the next attempt resumes, rank 0 first asks ``previous_exit_cause`` (it reads the
markers) and only then calls ``clear_markers`` (it deletes them all), before training starts:
the other order would book every restart as a failure. Clearing right away also means a marker
always describes the attempt just before, whichever rank of the new attempt writes the next one.
``.lock-lost.json`` is the exception: rank 0 of a run whose directory another job took over
writes it for its job script, and no attempt reads or clears it (the directory is the other
job's now); it counts only for the launch whose id it carries.

**Format.** JSON with one key per line and fixed separators (``"key": value``), so the shell
reads a field exactly without a JSON parser (``et_marker_field`` in ``jobs/lib/common.sh``;
a test runs it on this writer's output). Values the shell compares (``launch_id``,
``exit_code``) never need JSON escapes: launch ids are made by ``et_new_launch`` from digits,
letters, dots and dashes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any


class ExitCode(IntEnum):
    """Every exit code elastic-train's processes return; ``MEANINGS`` says who and what follows."""

    OK = 0  # training finished (target reached, patience exhausted, all epochs done)
    CHECKPOINT_INVALID = 1  # the checkpoint tool found a checkpoint that fails verification
    USAGE = 2  # bad flags, environment or input data: retrying cannot help
    PREEMPTED = 75  # SIGUSR1/SIGUSR2: the exact step is checkpointed, requeue me (EX_TEMPFAIL)
    STOPPED = 76  # SIGTERM from the launcher: the exact step is checkpointed, not a preemption
    STOP_GRACE_EXPIRED = 77  # a stop signal, but no agreed step boundary within --stop-grace
    ORPHANED = 78  # the launcher died: the worker leaves instead of training on
    QUORUM_STATE_UNSAFE = 79  # --ft quorum: an error after the commit vote; the restarted worker heals
    LOCK_LOST = 80  # another job took the checkpoint directory's lock over: stopped, nothing more commits
    FINAL_CHECKPOINT_FAILED = 81  # training finished, but its final checkpoint did not commit (full disk?)
    HUNG = 124  # the step watchdog saw no progress for --hang-timeout (as timeout(1) exits)
    INTERRUPTED = 130  # Ctrl-C (SIGINT): the exact step is checkpointed; rerun the command to continue


class RestartCause(str, Enum):
    """Why the previous attempt ended, as goodput accounting books it.

    The values are stored in checkpoints (``Accounting.restarts``) and logged (the ``recovery``
    event ``python -m elastic_train.report`` reads): never rename one.
    """

    PREEMPTION = "preemption"  # the scheduler took the allocation (.preempted.json)
    HANG = "hang"  # a rank's step watchdog fired (.hang-rank-<r>.json)
    STOP = "stop"  # the launcher stopped the workers: a peer failed, a node joined or left (.stopped.json)
    FAILURE = "failure"  # anything that left no marker: a crash, a kill, an exit 77 or 78
    INTERRUPT = "interrupt"  # a person pressed Ctrl-C (.interrupted.json): the run continues when rerun
    # Another job took the directory (.lock-lost.json): for the job script and people only. Never
    # read back by a next attempt (not in PRECEDENCE): the directory and its markers are the
    # other job's now, and that job's attempts must not book it as their own.
    LOCK_LOST = "lock_lost"

    def __str__(self) -> str:  # the value in f-strings on every Python version, as stored
        return self.value


PREEMPTED_MARKER = ".preempted.json"
STOPPED_MARKER = ".stopped.json"
INTERRUPTED_MARKER = ".interrupted.json"
HANG_MARKER_GLOB = ".hang-rank-*.json"
LOCK_LOST_MARKER = ".lock-lost.json"
LAUNCH_ID_VAR = "ELASTIC_TRAIN_LAUNCH_ID"  # set by the job scripts for each launch, copied into markers
MARKER_VERSION = 1
# A hang marker's write is bounded: the hang may be a wedged filesystem, and the watchdog must
# exit whatever the disk does.
HANG_MARKER_WRITE_S = 2.0
# Markers are compared with the last progress rank 0 recorded; other nodes' clocks may be behind.
CLOCK_SLACK_S = 1.0
# Which marker wins when an attempt left several: a preemption decides the requeue; a hang is the
# root cause of whatever stop followed it.
# A Ctrl-C under torchrun reaches the workers as SIGINT only, so an interrupt and a stop of one
# attempt do not meet; when they do, the launcher's stop is the more specific cause.
PRECEDENCE = (RestartCause.PREEMPTION, RestartCause.HANG, RestartCause.STOP, RestartCause.INTERRUPT)
_EXIT_OF = {
    RestartCause.PREEMPTION: ExitCode.PREEMPTED,
    RestartCause.STOP: ExitCode.STOPPED,
    RestartCause.INTERRUPT: ExitCode.INTERRUPTED,
    RestartCause.HANG: ExitCode.HUNG,
    RestartCause.LOCK_LOST: ExitCode.LOCK_LOST,
}


@dataclass(frozen=True)
class Meaning:
    """One row of the exit-code table."""

    who: str  # the process that returns the code
    then: str  # what the launcher and the job scripts do with it
    marker: str = ""  # the marker file written with it, if any


MEANINGS: Mapping[ExitCode, Meaning] = {
    ExitCode.OK: Meaning("every worker; the tools on success", "torchrun and the job script exit 0"),
    ExitCode.CHECKPOINT_INVALID: Meaning(
        "`python -m elastic_train.ckpt verify/inspect/export`",
        "nothing automatic: the tool names the damaged file (torchrun's own exit 1 means 'a worker failed')",
    ),
    ExitCode.USAGE: Meaning(
        "every worker, before any step and before anything on disk changes; the tools; the job scripts",
        "only fixing the flags, environment or data helps: torchrun retries while its restart budget lasts, "
        "then the job script counts it as a crash",
    ),
    ExitCode.PREEMPTED: Meaning(
        "every worker after the agreed stop checkpoint of a SIGUSR1/SIGUSR2",
        "the job script requeues on the marker of its own launch (and exits 75 past its cap)",
        f"`{PREEMPTED_MARKER}` (rank 0)",
    ),
    ExitCode.STOPPED: Meaning(
        "every worker after the agreed stop checkpoint of a SIGTERM",
        "none: torchrun was restarting or ending the group; booked as a `stop` restart, never requeued",
        f"`{STOPPED_MARKER}` (rank 0)",
    ),
    ExitCode.STOP_GRACE_EXPIRED: Meaning(
        "a worker with no agreed step boundary within `--stop-grace` of a stop signal",
        "torchrun restarts without waiting for its SIGKILL; the last committed checkpoint stands",
    ),
    ExitCode.ORPHANED: Meaning(
        "a worker whose launcher died", "a restarted agent finds no second set of workers on the devices"
    ),
    ExitCode.QUORUM_STATE_UNSAFE: Meaning(
        "a quorum-mode worker whose update failed after its replicas voted to commit (state may be half applied)",
        "its agent restarts it alone; the new worker heals from a live replica, the others never stop",
    ),
    ExitCode.LOCK_LOST: Meaning(
        "every worker, at the step boundary after rank 0 found the directory's lock taken over by another job "
        "(its own had gone stale)",
        "torchrun restarts, and the new attempt is refused (exit 2) while the other job holds the directory; "
        "the job script does not requeue on the marker of its own launch",
        f"`{LOCK_LOST_MARKER}` (rank 0)",
    ),
    ExitCode.FINAL_CHECKPOINT_FAILED: Meaning(
        "every worker when training finished but its final checkpoint could not be committed (a full disk, a "
        "storage error); the failed save's files are removed, the newest committed checkpoint is kept",
        "a failure: torchrun restarts while its budget lasts (the restart resumes from the newest checkpoint, "
        "trains the rest again and saves again), then the job script counts a crash; never 'completed'",
    ),
    ExitCode.HUNG: Meaning(
        "a worker whose step watchdog saw no progress for `--hang-timeout`",
        "torchrun restarts the group from the newest checkpoint; booked as a `hang` restart",
        "`.hang-rank-<r>.json` (that rank, best effort)",
    ),
    ExitCode.INTERRUPTED: Meaning(
        "every worker after the agreed stop checkpoint of a SIGINT (Ctrl-C; torchrun and our launchers forward "
        "it to their workers); the launchers of elastic-train; a second Ctrl-C ends at once, without a checkpoint",
        "nothing is restarted; rerunning the same command continues from the checkpoint (torchrun itself "
        "exits 1 with 'got signal: 2')",
        f"`{INTERRUPTED_MARKER}` (rank 0)",
    ),
}


def continue_hint(checkpoint_dir: Path) -> str:
    """The line after a Ctrl-C: how to go on from where the run stopped."""
    return (
        f"To continue, run the same command again: it resumes from {checkpoint_dir}/latest "
        "(the same samples and updates as a run that was never stopped)."
    )


def hang_marker_name(rank: int) -> str:
    return f".hang-rank-{rank}.json"


@dataclass(frozen=True)
class Marker:
    """What an attempt that ended by a stop or a hang leaves for the job script and the next attempt."""

    cause: RestartCause  # PREEMPTION, STOP, INTERRUPT, HANG or LOCK_LOST: a failure leaves no marker
    step: int  # the step checkpointed (stop), or the last finished step (hang)
    rank: int  # the global rank that wrote it
    time: float = field(default_factory=time.time)
    launch_id: str | None = field(default_factory=lambda: os.environ.get(LAUNCH_ID_VAR))
    signal: str = ""  # stop: the signal received ("a peer's signal" when another rank got it)
    committed: bool = False  # stop: whether the stop checkpoint was committed
    phase: str = ""  # hang: what the rank was doing ("train", "eval", "checkpoint")

    def __post_init__(self) -> None:
        if self.cause not in _EXIT_OF:
            raise ValueError(f"no marker for restart cause {self.cause.value!r}: only {[c.value for c in _EXIT_OF]}")

    @property
    def exit_code(self) -> ExitCode:
        return _EXIT_OF[self.cause]

    @property
    def file_name(self) -> str:
        if self.cause is RestartCause.HANG:
            return hang_marker_name(self.rank)
        if self.cause is RestartCause.LOCK_LOST:
            return LOCK_LOST_MARKER
        if self.cause is RestartCause.INTERRUPT:
            return INTERRUPTED_MARKER
        return PREEMPTED_MARKER if self.cause is RestartCause.PREEMPTION else STOPPED_MARKER

    def to_text(self) -> str:
        """One key per line, fixed separators: the form ``et_marker_field`` reads."""
        record = {
            "version": MARKER_VERSION,
            "cause": self.cause.value,
            "exit_code": int(self.exit_code),
            "launch_id": self.launch_id,
            "rank": self.rank,
            "step": self.step,
            "time": self.time,
            "signal": self.signal,
            "committed": self.committed,
            "phase": self.phase,
        }
        return json.dumps(record, indent=0, separators=(",", ": "), ensure_ascii=True) + "\n"

    @classmethod
    def from_text(cls, text: str, cause: RestartCause) -> Marker:
        """Parse a marker of ``cause`` (told by its file name); also reads the unversioned markers
        written before this module (no ``cause``, ``rank`` or ``phase``). ``ValueError`` if malformed."""
        raw: Any = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a marker is a JSON object")
        launch_id = raw.get("launch_id")
        return cls(
            cause=cause,
            step=int(raw["step"]),
            rank=int(raw.get("rank", 0)),
            time=float(raw["time"]),
            launch_id=str(launch_id) if launch_id is not None else None,
            signal=str(raw.get("signal", "")),
            committed=bool(raw.get("committed", False)),
            phase=str(raw.get("phase", "")),
        )


def stop_marker(cause: RestartCause, step: int, signal: str, committed: bool, rank: int = 0) -> Marker:
    """The marker of a preemption (``RestartCause.PREEMPTION``), a launcher's stop (``STOP``) or a
    Ctrl-C (``INTERRUPT``)."""
    if cause not in (RestartCause.PREEMPTION, RestartCause.STOP, RestartCause.INTERRUPT):
        raise ValueError(f"a stop marker is for a preemption, a stop or an interrupt, not {cause.value!r}")
    return Marker(cause, step, rank, signal=signal, committed=committed)


def lock_lost_marker(step: int, rank: int = 0) -> Marker:
    """The marker of a run that stopped because another job took its directory over."""
    return Marker(RestartCause.LOCK_LOST, step, rank)


def write_stop_marker(checkpoint_dir: Path, marker: Marker) -> Path | None:
    """Write a stop marker, committed or not; one saying the stop checkpoint failed never
    replaces this stop's marker saying it committed (same launch and step). Quorum mode: every
    replica stops at the same step and only the one that saved knows it committed, so the
    others' markers must not hide it. None when the committed marker was kept.

    Limit: the check and the write are two operations; a saver's marker landing between them
    is overwritten. Savers write after a synchronous save, the others at once, so in practice
    the others write first. ``OSError`` on failure."""
    if not marker.committed:
        found = read_marker(checkpoint_dir / marker.file_name)
        if found is not None and found.committed and (found.launch_id, found.step) == (marker.launch_id, marker.step):
            return None
    return write_marker(checkpoint_dir, marker)


def write_marker(checkpoint_dir: Path, marker: Marker) -> Path:
    """Write ``marker`` atomically (temporary name, fsync, rename); ``OSError`` on failure."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_dir / marker.file_name
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="ascii") as fh:
        fh.write(marker.to_text())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_marker_best_effort(checkpoint_dir: Path, marker: Marker, timeout_s: float = HANG_MARKER_WRITE_S) -> bool:
    """``write_marker`` from a daemon thread, waiting at most ``timeout_s``: for a process about
    to ``os._exit`` (the watchdog), whose checkpoint directory may sit on the wedged filesystem
    that caused the hang. True if the marker was written in time.

    Limit: a thread stuck in an uninterruptible kernel write can still delay the process's exit
    until the write returns; the main thread stuck on that filesystem would delay it anyway.
    """
    finished = threading.Event()  # set when the write returns, written or failed: no wait for a failure
    written: list[bool] = []

    def write() -> None:
        try:
            write_marker(checkpoint_dir, marker)
            written.append(True)
        except OSError:
            pass
        finally:
            finished.set()

    threading.Thread(target=write, name="outcome-marker", daemon=True).start()
    return finished.wait(timeout_s) and bool(written)


def _cause_of_file(name: str) -> RestartCause | None:
    if name == PREEMPTED_MARKER:
        return RestartCause.PREEMPTION
    if name == STOPPED_MARKER:
        return RestartCause.STOP
    if name == INTERRUPTED_MARKER:
        return RestartCause.INTERRUPT
    if name == LOCK_LOST_MARKER:
        return RestartCause.LOCK_LOST
    if name.startswith(".hang-rank-") and name.endswith(".json"):
        return RestartCause.HANG
    return None


def read_marker(path: Path) -> Marker | None:
    """The marker in ``path``, or None when it is missing, unreadable, malformed or not a marker."""
    cause = _cause_of_file(path.name)
    if cause is None:
        return None
    try:
        return Marker.from_text(path.read_text(encoding="utf-8"), cause)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _marker_paths(checkpoint_dir: Path) -> list[Path]:
    return [
        checkpoint_dir / PREEMPTED_MARKER,
        checkpoint_dir / STOPPED_MARKER,
        checkpoint_dir / INTERRUPTED_MARKER,
        *sorted(checkpoint_dir.glob(HANG_MARKER_GLOB)),
    ]


def read_markers(checkpoint_dir: Path) -> list[Marker]:
    """Every readable marker in ``checkpoint_dir``: preempted, stopped, interrupted, then hangs by rank name."""
    return [m for m in map(read_marker, _marker_paths(checkpoint_dir)) if m is not None]


def clear_markers(checkpoint_dir: Path) -> None:
    """Delete every marker (and a temporary file a killed writer left). Rank 0 calls it when an
    attempt starts, after ``previous_exit_cause`` has read them."""
    for pattern in (PREEMPTED_MARKER, STOPPED_MARKER, INTERRUPTED_MARKER, HANG_MARKER_GLOB):
        for path in checkpoint_dir.glob(pattern + "*"):  # "*": the writers' .tmp-<pid> files too
            path.unlink(missing_ok=True)


# Causes that end a launch (the job script requeues, or a person reruns): the time until the next
# launch starts is between launches, not a recovery's (goodput's ``away_s``).
ENDS_LAUNCH = frozenset({RestartCause.PREEMPTION, RestartCause.INTERRUPT})


def previous_exit(checkpoint_dir: Path, since: float) -> Marker | None:
    """The marker that says why the previous attempt ended (``previous_exit_cause``'s choice), or
    None when it left none (a failure)."""
    found = [m for m in read_markers(checkpoint_dir) if m.time >= since - CLOCK_SLACK_S]
    for cause in PRECEDENCE:
        chosen = [m for m in found if m.cause is cause]
        if chosen:
            return max(chosen, key=lambda m: m.time)
    return None


def previous_exit_cause(checkpoint_dir: Path, since: float) -> RestartCause:
    """Why the previous attempt ended, from its markers alone.

    ``since``: ``time.time()`` of the last progress rank 0 recorded (``.progress.json``), 0 if
    none. A marker older than that (less ``CLOCK_SLACK_S``) describes an earlier attempt and is
    ignored. Several markers: ``PRECEDENCE`` decides. No marker: ``FAILURE``. Call it before
    ``clear_markers``.
    """
    marker = previous_exit(checkpoint_dir, since)
    return marker.cause if marker is not None else RestartCause.FAILURE


def markdown_table() -> str:
    """The table of exit codes and markers in ``docs/fault-tolerance.md``."""
    rows = [
        "| code | `ExitCode` | returned by | marker | what follows |",
        "| --- | --- | --- | --- | --- |",
    ]
    for code in ExitCode:
        m = MEANINGS[code]
        rows.append(f"| {int(code)} | `{code.name}` | {m.who} | {m.marker or 'none'} | {m.then} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["table"]:
        print("usage: python -m elastic_train.outcome table", file=sys.stderr)
        return ExitCode.USAGE
    sys.stdout.write(markdown_table())
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
