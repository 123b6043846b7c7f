"""The step boundary: the one owner of what happens between two optimizer steps.

At each boundary every rank must take the same decisions at the same step, or the next
collective deadlocks: stop now (a signal reached some rank), commit the async save in flight
(every shard is durable), start a save (every N steps, or rank 0's clock says it is time).
``StepBoundary`` takes them all, from one agreement per step, and returns them as a named
``Decision``; the training loop only supplies a snapshot of its state when one is needed.

A run whose checkpoint lock another job took over (``CheckpointLock.was_lost``: its lock had
gone stale) can commit nothing more: every rank raises ``DirectoryLost`` at the boundary where
that is agreed, so no rank trains on without checkpoints (the caller exits
``ExitCode.LOCK_LOST``).

The agreement is a MAX all-reduce of each rank's ``Votes`` on the ``ControlPlane``'s gloo
group, posted at one boundary and collected at the next, so it overlaps the step in between:
decisions take effect one step after the vote, the same step everywhere. Only while a save is
in flight and not yet durable everywhere does a boundary also ask synchronously, so a shard
that became durable during the step commits now rather than a step later. The last step of an
epoch collects without posting: ``epoch_end`` then saves the evaluated epoch and agrees
synchronously.

Usage (a custom loop; the built-in trainer does the same)::

    boundary = StepBoundary(checkpointer, ControlPlane(), SavePolicy(every_steps=100), flag)
    for step, batch in ...:
        train_step(batch)
        decision = boundary.after_step(step, lambda: capture(...), epoch_end=last_batch)
        if decision.stop:
            sys.exit(decision.stop.exit_code)  # its checkpoint is committed (decision.stop_committed)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from elastic_train.checkpoint.format import latest_target
from elastic_train.checkpoint.manager import Checkpointer
from elastic_train.checkpoint.snapshot import Snapshot
from elastic_train.distributed.process_group import ControlPlane
from elastic_train.outcome import ExitCode
from elastic_train.resilience.preemption import PreemptionFlag, StopKind

log = structlog.get_logger(__name__)

SnapshotFn = Callable[[], Snapshot]


@dataclass(frozen=True)
class SavePolicy:
    """When to save besides epoch ends and stops: every ``every_steps`` global steps and/or every
    ``every_seconds`` of rank 0's clock since the last save (0: off)."""

    every_steps: int = 0
    every_seconds: float = 0.0

    def due_by_step(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def due_by_time(self, since_last_save_s: float) -> bool:
        return self.every_seconds > 0 and since_last_save_s >= self.every_seconds


@dataclass(frozen=True)
class Votes:
    """One rank's input to a boundary's agreement; each field is MAX-reduced over ranks."""

    stop: StopKind = StopKind.NONE  # the strongest stop this rank was asked for (PREEMPT > STOP)
    save_due: bool = False  # rank 0's clock: a timed save is due (other ranks vote False)
    shard_pending: bool = False  # this rank's shard of the save in flight is not durable yet
    lock_lost: bool = False  # rank 0: another job took the directory's lock over

    def encode(self) -> list[int]:
        return [int(self.stop), int(self.save_due), int(self.shard_pending), int(self.lock_lost)]

    @classmethod
    def decode(cls, values: Sequence[int]) -> Votes:
        stop, save_due, shard_pending, lock_lost = values
        return cls(StopKind(stop), bool(save_due), bool(shard_pending), bool(lock_lost))


class DirectoryLost(Exception):
    """Raised on every rank at the same boundary: another job holds the checkpoint directory now,
    so this run stops rather than train on without checkpoints (``ExitCode.LOCK_LOST``)."""

    def __init__(self, step: int, lock: str) -> None:
        super().__init__(
            f"the checkpoint lock {lock} was taken over by another job at or before step {step}; "
            "this run can commit nothing more and stops"
        )
        self.step = step


class FinalCheckpointFailed(Exception):
    """Raised on every rank when training finished but its final checkpoint did not commit (a
    full disk, a storage error): the run is not over until its final state is on disk
    (``ExitCode.FINAL_CHECKPOINT_FAILED``)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"training finished at step {step}, but its final checkpoint was not committed")
        self.step = step

    def console_lines(self, checkpoint_dir: Path) -> list[str]:
        """What the person at the console reads instead of "Training completed successfully"."""
        kept = latest_target(checkpoint_dir)
        return [
            f"Training finished at step {self.step}, but its final checkpoint could NOT be committed "
            "(the checkpoint_failed line in the log says why; a full disk?).",
            f"{checkpoint_dir}/latest is {kept.name if kept else 'missing'}: fix the storage and run the same "
            f"command again; it resumes from there and trains the rest again. Exiting with code "
            f"{int(ExitCode.FINAL_CHECKPOINT_FAILED)}",
        ]


@dataclass(frozen=True)
class Decision:
    """What a boundary did; identical on every rank."""

    stop: StopKind = StopKind.NONE  # agreed stop: a checkpoint of this step was saved; exit now
    stop_committed: bool = False  # for a stop: its checkpoint (or an identical one) is committed
    committed: bool = False  # the save that was in flight committed here
    saved: bool = False  # a save of this step started (async) or committed (sync)


class StepBoundary:
    """Collective: every rank calls ``after_step`` after each step and ``epoch_end`` after each
    epoch's evaluation, in the same order."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        control: ControlPlane,
        policy: SavePolicy | None = None,
        stop_flag: PreemptionFlag | None = None,
        *,
        async_save: bool = True,
        is_main: bool | None = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.control = control
        self.policy = policy or SavePolicy()
        self.stop_flag = stop_flag
        self.async_save = async_save
        # Rank 0's clock decides timed saves (default: the checkpointer's rank 0).
        self.is_main = checkpointer.env.is_main if is_main is None else is_main
        self._last_save = time.monotonic()

    # ------------------------------------------------------------------ votes
    def _votes(self) -> Votes:
        ck = self.checkpointer
        return Votes(
            stop=self.stop_flag.kind if self.stop_flag is not None else StopKind.NONE,
            save_due=self.is_main and self.policy.due_by_time(time.monotonic() - self._last_save),
            shard_pending=not ck.local_done(),
            lock_lost=self._lock_lost(),
        )

    def _lock_lost(self) -> bool:
        """Whether this rank holds the directory's lock and found it taken over (rank 0's vote)."""
        return self.checkpointer.lock.was_lost

    def _raise_lost(self, step: int) -> None:
        raise DirectoryLost(step, str(self.checkpointer.lock.path))

    def _agree(self, votes: Votes) -> Votes:
        return Votes.decode(self.control.agree(votes.encode()))

    # ------------------------------------------------------------------ boundaries
    def after_step(self, step: int, snapshot: SnapshotFn, *, epoch_end: bool = False) -> Decision:
        """Between two steps (``step`` optimizer steps are done). ``epoch_end``: the epoch's
        last step: no mid-epoch save (the evaluated epoch-end save follows) and nothing posted."""
        ck = self.checkpointer
        posted = self.control.collect()
        # Nothing posted yet (the first step of this process or epoch): no stop, no commit.
        agreed = Votes.decode(posted) if posted is not None else Votes(shard_pending=True)
        if agreed.lock_lost:
            self._raise_lost(step)
        if agreed.stop:
            return self.stop_now(StopKind(agreed.stop), snapshot)
        not_done = agreed.shard_pending
        if ck.pending and not_done:
            # Every rank has the same save pending: ask again now, not a step later.
            not_done = self._agree(Votes(shard_pending=not ck.local_done())).shard_pending
        committed = False
        if ck.pending and not not_done:
            committed = ck.commit_pending()
        saved = False
        if (self.policy.due_by_step(step) or agreed.save_due) and not epoch_end:
            if ck.pending:  # a new save waits for the one in flight: commit it first
                committed = ck.commit_pending()
            self.save(snapshot(), sync=not self.async_save)
            saved = True
        if not epoch_end:
            self.control.post(self._votes().encode())
        return Decision(committed=committed, saved=saved)

    def epoch_end(self, snapshot: SnapshotFn, *, finished: bool) -> Decision:
        """After an epoch's evaluation: save it (synchronously if it is the last), then, unless
        training is finished, agree on a stop requested during the epoch."""
        snap = snapshot()
        committed = self.save(snap, sync=finished or not self.async_save)
        if finished:
            if not committed:
                log.error("final_checkpoint_failed", detail="the newest committed checkpoint is older")
                if self._agree(Votes(lock_lost=self._lock_lost())).lock_lost:
                    self._raise_lost(snap.step)
            return Decision(saved=bool(committed), committed=bool(committed))
        agreed = self._agree(Votes(stop=self._votes().stop, lock_lost=self._lock_lost()))
        if agreed.lock_lost:
            self._raise_lost(snap.step)
        if agreed.stop:
            return self.stop_now(agreed.stop, snapshot)
        return Decision(saved=True)

    def stop_now(self, kind: StopKind, snapshot: SnapshotFn) -> Decision:
        """Every rank, at an agreed boundary: commit a checkpoint of this exact state
        synchronously; the caller exits with ``kind.exit_code``."""
        ck = self.checkpointer
        if self.stop_flag is not None:
            self.stop_flag.acknowledge()  # the boundary is reached: no grace-period exit now
        if ck.pending:
            ck.commit_pending()
        snap = snapshot()
        # save() skips a state this run's timeline already committed (rank 0 decides for all).
        committed = bool(self.save(snap, sync=True))
        signal_name = self.stop_flag.signal_name if self.stop_flag is not None else None
        log.warning("preempted", step=snap.step, signal=signal_name, kind=kind.name, checkpoint_committed=committed)
        return Decision(stop=kind, stop_committed=committed, saved=committed)

    def save(self, snap: Snapshot, sync: bool) -> bool | None:
        """Any save of the loop's (the clock of timed saves restarts): see ``Checkpointer.save``.
        A loop that uses a boundary saves through it, never ``Checkpointer.save`` directly: the
        boundary's clock would not see that save and a timed save would follow too soon."""
        self._last_save = time.monotonic()
        return self.checkpointer.save(snap, sync=sync)
