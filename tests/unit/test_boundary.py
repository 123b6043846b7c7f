"""The step boundary in a world of one: every decision it owns, named, without subprocesses.

A gloo group of one process (an in-memory store) runs the same collectives a real run does,
so the agreement, the async commit, the policies and the stop path are all exercised.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from elastic_train.boundary import Decision, SavePolicy, StepBoundary, Votes
from elastic_train.checkpoint.format import latest_target, read_manifest
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
from elastic_train.checkpoint.snapshot import Position, Snapshot, capture
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import ControlPlane
from elastic_train.resilience.preemption import PreemptionFlag, StopKind

FINGERPRINT = {"test": "boundary"}


class Loop:
    """A tiny model and optimizer, stepped by hand; ``snapshot`` is what a loop passes in."""

    def __init__(self, root: Path, policy: SavePolicy, flag: PreemptionFlag | None = None, sync: bool = False):
        self.model = nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.step = 0
        self.checkpointer = Checkpointer(CheckpointConfig(root=root), DistEnv(), FINGERPRINT)
        self.checkpointer.start()
        self.boundary = StepBoundary(self.checkpointer, ControlPlane(), policy, flag, async_save=not sync, is_main=True)
        self.snapshots = 0

    def snapshot(self, finished: bool = False) -> Snapshot:
        self.snapshots += 1
        return capture(
            Position(self.step, 0, self.step, finished),
            self.model,
            self.optimizer,
            device=torch.device("cpu"),
        )

    def train_step(self, epoch_end: bool = False) -> Decision:
        self.model(torch.ones(1, 3)).sum().backward()
        self.checkpointer.wait_staged()
        self.optimizer.step()
        self.step += 1
        return self.boundary.after_step(self.step, self.snapshot, epoch_end=epoch_end)

    def close(self) -> None:
        self.checkpointer.close()


def committed_steps(root: Path) -> list[int]:
    return sorted(read_manifest(f).step for f in root.glob("step-*") if (f / "manifest.json").exists())


def test_votes_round_trip_through_their_encoding() -> None:
    votes = Votes(StopKind.PREEMPT, save_due=True, shard_pending=False)
    assert Votes.decode(votes.encode()) == votes
    assert Votes.decode([0, 0, 1, 0]) == Votes(shard_pending=True)


def test_saves_every_n_steps_and_commits_at_a_later_boundary(world_of_one: None, tmp_path: Path) -> None:
    loop = Loop(tmp_path, SavePolicy(every_steps=2))
    try:
        decisions = [loop.train_step() for _ in range(5)]
        assert [d.saved for d in decisions] == [False, True, False, True, False]
        # Step 2's async save is committed at a later boundary, never at its own.
        assert not decisions[1].committed and any(d.committed for d in decisions[2:4])
        assert all(d.stop is StopKind.NONE for d in decisions)
        assert loop.snapshots == 2, "a snapshot is taken only for a save"
        loop.boundary.epoch_end(lambda: loop.snapshot(finished=True), finished=True)
        assert committed_steps(tmp_path) == [2, 4, 5]
        assert latest_target(tmp_path) == tmp_path / "step-00000005"
    finally:
        loop.close()


def test_no_mid_epoch_save_on_the_epochs_last_step(world_of_one: None, tmp_path: Path) -> None:
    loop = Loop(tmp_path, SavePolicy(every_steps=1), sync=True)
    try:
        assert loop.train_step().saved
        last = loop.train_step(epoch_end=True)
        assert not last.saved, "the evaluated epoch-end save follows instead"
        assert committed_steps(tmp_path) == [1]
    finally:
        loop.close()


def test_a_timed_save_follows_rank_0s_clock(world_of_one: None, tmp_path: Path) -> None:
    loop = Loop(tmp_path, SavePolicy(every_seconds=0.2), sync=True)
    try:
        assert not any(loop.train_step().saved for _ in range(2))
        time.sleep(0.25)
        loop.train_step()  # votes "due" for the next boundary (the agreement runs one step behind)
        assert loop.train_step().saved
        assert not loop.train_step().saved and not loop.train_step().saved, "the clock restarts at a save"
    finally:
        loop.close()


def test_a_stop_signal_checkpoints_the_exact_step_and_says_so(world_of_one: None, tmp_path: Path) -> None:
    flag = PreemptionFlag()
    loop = Loop(tmp_path, SavePolicy(), flag)
    try:
        assert loop.train_step().stop is StopKind.NONE
        flag.kind = StopKind.PREEMPT  # what the SIGUSR1 handler records
        voted = loop.train_step()
        assert voted.stop is StopKind.NONE, "the vote of step 2 is collected at step 3's boundary"
        decision = loop.train_step()
        assert decision.stop is StopKind.PREEMPT and decision.stop_committed and decision.saved
        assert committed_steps(tmp_path) == [3]
        assert int(decision.stop.exit_code) == 75
    finally:
        loop.close()


def test_a_stop_requested_during_an_epoch_is_agreed_at_its_end(world_of_one: None, tmp_path: Path) -> None:
    flag = PreemptionFlag()
    loop = Loop(tmp_path, SavePolicy(), flag)
    try:
        loop.train_step()
        flag.kind = StopKind.STOP
        assert loop.train_step(epoch_end=True).stop is StopKind.NONE, "the last step posts nothing"
        decision = loop.boundary.epoch_end(loop.snapshot, finished=False)
        assert decision.stop is StopKind.STOP and decision.stop_committed
        assert committed_steps(tmp_path) == [2]
    finally:
        loop.close()


def test_a_finished_epoch_end_is_saved_synchronously_even_with_a_stop_pending(
    world_of_one: None, tmp_path: Path
) -> None:
    flag = PreemptionFlag()
    loop = Loop(tmp_path, SavePolicy(), flag)
    try:
        loop.train_step(epoch_end=True)
        flag.kind = StopKind.PREEMPT
        decision = loop.boundary.epoch_end(lambda: loop.snapshot(finished=True), finished=True)
        assert decision == Decision(saved=True, committed=True), "nothing left to train: no stop"
        assert read_manifest(tmp_path / "step-00000001").finished
    finally:
        loop.close()
