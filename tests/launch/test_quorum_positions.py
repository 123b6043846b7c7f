"""Quorum replicas agree on the training position by check, not by convention (issue 17, 1).

The sequence that broke it: three replica groups; one is busy (here held at the start of a
step, as a long synchronous save or a lock wait would hold it) past the Lighthouse's join
timeout while the other two are killed. The two restart, form a quorum of their own, resume
from the newest checkpoint and train on. When the busy one comes back it meets them. Before
the fix, a resumed replica's Manager step left out the evaluation rounds, so the two sides met
at EQUAL Manager steps but different positions: torchft healed nobody, each side cut its share
from its own global batch, the gradients of two different batches were averaged, every vote
passed, and the epoch's samples were no longer exactly once.

The meeting is ordered exactly by injected faults, not by timing: the busy replica is
``hold``-ed until the resumed ones reach the chosen step, and the resumed ones ``release`` it
and wait until it has asked for the quorum they then join.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_train.checkpoint.format import MANIFEST, aside_folders, read_manifest, step_folders
from elastic_train.checkpoint.manager import load
from elastic_train.data.sampler import global_batches
from elastic_train.faults import ENV_VAR as FAULTS
from elastic_train.metrics import format_digest, index_digest
from tests.helpers import TOKEN_VAR, base_env, kill_tagged
from tests.launch.test_quorum_trainer import Job

pytestmark = pytest.mark.timeout(300)

EPOCHS, STEPS, BATCH, SEED, TRAIN_SAMPLES = 2, 20, 32, 42, 4096
FLAGS = [
    "--epochs", str(EPOCHS), "--max-steps-per-epoch", str(STEPS), "--batch-size", str(BATCH),
    "--target-accuracy", "1.0", "--seed", str(SEED), "--checkpoint-every", "5", "--keep-last", "50",
    "--optimizer", "sgd", "--base-lr", "0.05", "--max-val-samples", "64",
    # The held replica waits for the others to restart, resume and train a few steps: its
    # watchdog must not take that for a hang.
    "--hang-timeout", "180",
]  # fmt: skip
# Step 28 starts epoch 2's 8th batch: the held replica has committed 27 batches and one
# evaluation round (Manager step 28). The killed ones resume from step 20 or 25 (epoch 1 done).
MEET = 28
SCRIPT = ",".join(
    [
        f"kill:rank=0:step={MEET}",
        f"kill:rank=1:step={MEET}",
        f"hold:rank=2:step={MEET}:until=go:then=joining",
        # After the restart (the kills have fired): the resumed pair releases the held one when
        # it starts step MEET again, and asks for its next quorum only after the held one asked.
        f"release:rank=0:step={MEET}:file=go:until=joining",
        f"release:rank=1:step={MEET}:file=go:until=joining",
    ]
)


def _expected_digest(epoch: int) -> str:
    order = global_batches(TRAIN_SAMPLES, BATCH, SEED, epoch, STEPS).reshape(-1)
    return format_digest(index_digest(order))


def _done(job: Job, group: int) -> dict[str, Any]:
    done = [r for r in job.log(group) if r["event"] == "done"]
    assert len(done) == 1, f"replica {group} did not finish once: {done}\n{job.output()}"
    return done[0]


def _assert_one_line_of_checkpoints(root: Path) -> None:
    """Every committed checkpoint on disk belongs to one timeline, positions only advance, and
    nothing was moved aside as abandoned or corrupt."""
    assert not aside_folders(root), [f.name for f in aside_folders(root)]
    folders = [f for f in reversed(step_folders(root)) if (f / MANIFEST).exists()]
    manifests = [read_manifest(f) for f in folders]
    assert manifests and len({m.timeline for m in manifests}) == 1, [
        (f.name, m.timeline) for f, m in zip(folders, manifests, strict=True)
    ]
    positions = [(m.epoch, m.batch_in_epoch) for m in manifests]
    assert positions == sorted(set(positions)), f"the data position does not advance with the step: {positions}"


def test_replicas_that_resumed_meet_a_busy_one_at_the_position_not_just_the_step(tmp_path: Path) -> None:
    job = Job(tmp_path, base_env({FAULTS: SCRIPT}))
    try:
        node = job.start("--nproc-per-node", "3", "--max-restarts", "3", flags=FLAGS)
        assert job.wait(node, timeout=280) == 0, job.output()
    finally:
        kill_tagged(job.env[TOKEN_VAR])
    faults = tmp_path / "ckpt" / ".faults"
    assert (faults / "go").exists() and (faults / "joining").exists(), "the held replica was never released"
    resumed = [r for g in (0, 1) for r in job.log(g) if r["event"] == "resumed"]
    assert resumed, f"the killed replicas did not resume from a checkpoint\n{job.output()}"

    final = load((tmp_path / "ckpt" / "latest").resolve())
    assert final.manifest.finished and final.manifest.step == EPOCHS * STEPS
    history = final.payload.app["history"]
    assert [r["epoch"] for r in history] == list(range(1, EPOCHS + 1))
    for epoch, record in enumerate(history):
        assert record["samples_seen"] == STEPS * BATCH, record
        assert record["sample_digest"] == _expected_digest(epoch), f"epoch {epoch + 1}: samples skipped or repeated"
    digests = {g: _done(job, g)["weights_sha256"] for g in (0, 1, 2)}
    assert len(set(digests.values())) == 1, f"the replicas ended with different weights: {json.dumps(digests)}"
    _assert_one_line_of_checkpoints(tmp_path / "ckpt")


def test_a_replica_that_cannot_read_the_chosen_checkpoint_restarts_and_heals_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    """One settler: participant 0 chooses the checkpoint, the others load that folder. A replica
    whose read fails (EIO, injected at the read) leaves with exit 79, is restarted by its agent
    and rejoins (healing, or choosing again); before, a checkpoint that failed to load on one
    replica ended it with exit 2, and the agent then ended the whole job."""
    first = Job(tmp_path, base_env({FAULTS: "preempt:rank=0:step=12"}))
    try:
        node = first.start("--nproc-per-node", "2", flags=FLAGS)
        assert first.wait(node, timeout=200) == 75, first.output()
    finally:
        kill_tagged(first.env[TOKEN_VAR])
    stopped = load((tmp_path / "ckpt" / "latest").resolve()).manifest.step
    # Both replicas' first read of it fails once: whichever chooses (participant 0) or follows,
    # and whoever formed the first quorum alone, every failing replica must restart and rejoin.
    again = Job(tmp_path, base_env({FAULTS: f"load_error:rank=0:step={stopped},load_error:rank=1:step={stopped}"}))
    try:
        node = again.start("--nproc-per-node", "2", "--max-restarts", "3", name="node1", flags=FLAGS)
        assert again.wait(node, timeout=200) == 0, again.output()
    finally:
        kill_tagged(again.env[TOKEN_VAR])
    rejoined = {g: [r for r in again.log(g) if r["event"] == "rejoin"] for g in (0, 1)}
    assert any(rejoined.values()), f"no replica left the quorum after a failed read\n{again.output()}"
    for group, events in rejoined.items():
        assert all("injected load_error" in r["reason"] for r in events), events
        restarts = [r for g, _, r in node.workers() if g == group]
        assert restarts == list(range(len(events) + 1)), f"group {group}: {node.workers()} after {events}"
    final = load((tmp_path / "ckpt" / "latest").resolve())
    assert final.manifest.finished and final.manifest.step == EPOCHS * STEPS
    for epoch, record in enumerate(final.payload.app["history"]):
        assert record["sample_digest"] == _expected_digest(epoch), f"epoch {epoch + 1}: samples skipped or repeated"
    digests = {g: _done(again, g)["weights_sha256"] for g in (0, 1)}
    assert len(set(digests.values())) == 1, digests
    _assert_one_line_of_checkpoints(tmp_path / "ckpt")
