"""``--ft quorum`` on the built-in trainer, under its own agent (``python -m elastic_train.quorum.launch``).

Real processes, real faults: SIGKILLed workers (a short soak: two kills, one of them the replica
that prints and saves), a frozen node (SIGSTOP of a whole agent session: the survivor is blocked
in a collective until its timeout), and a node that joins late. In every case the survivors keep
training without a restart, a returning worker heals from a live peer (no checkpoint read), each
epoch trains exactly its global batches' samples once (the sample digests are checked against
the data order computed here, independently of the trainer), and the final weights equal those
of a run without failures up to float reduction order.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastic_train.checkpoint.manager import load
from elastic_train.data.sampler import global_batches
from elastic_train.faults import ENV_VAR as FAULTS
from elastic_train.metrics import format_digest, index_digest
from elastic_train.outcome import ExitCode
from tests.helpers import (
    BIN,
    ROOT,
    TOKEN_VAR,
    base_env,
    final_state,
    free_port,
    kill_tagged,
    read_jsonl,
    shared_once,
)

# A global batch of 16: every fault path here is the same at 32, and the model's arithmetic is
# three quarters of a quorum run's CPU (a fault-free 2-replica run: 29.5 CPU-s at 32, 18 at 16;
# these tests' files: 1014 CPU-s at 32, 730 at 16, Dec 7, before four window-bound tests got more
# epochs below and in test_quorum_lighthouse_seat.py). --patience 0: at 16 the validation
# accuracy can stall for 3 epochs, and an early stop would end the run these tests time faults in.
EPOCHS, STEPS, BATCH, SEED, TRAIN_SAMPLES = 3, 40, 16, 42, 4096  # synthetic: 4096 training images
RUN = [
    "--epochs", str(EPOCHS), "--max-steps-per-epoch", str(STEPS), "--batch-size", str(BATCH),
    "--target-accuracy", "1.0", "--patience", "0", "--seed", str(SEED), "--checkpoint-every", "10",
    # SGD: AdamW divides by sqrt(v) and so amplifies float reduction-order noise in tiny gradients
    # (two fault-free runs of 1 and 2 replicas end 2.5e-3 apart with AdamW): the weight check
    # would then say little.
    "--optimizer", "sgd", "--base-lr", "0.05",
    "--max-val-samples", "64",
]  # fmt: skip
TOTAL = EPOCHS * STEPS
SALVAGED = 25  # the soak's placed kill: the step whose gradient average fails (mid epoch 1)
WORKER = re.compile(r"replica group (\d+): worker pid (\d+) \(restart (\d+)\)")
LIGHTHOUSE = re.compile(r"Lighthouse at \S+ \(pid (\d+)\)")
EXITED = re.compile(r"replica group (\d+): worker exited with (-?\d+); restarting")


@dataclass
class Node:
    """One agent (a "node") and its output."""

    proc: subprocess.Popen[bytes]
    out: Path

    def workers(self) -> list[tuple[int, int, int]]:
        """(group, pid, restart) of every worker it started, in order."""
        return [tuple(map(int, m.groups())) for m in WORKER.finditer(self.out.read_text())]  # type: ignore[misc]

    def pid(self, group: int) -> int:
        return [pid for g, pid, _ in self.workers() if g == group][-1]

    def lighthouse_pid(self) -> int:
        found = LIGHTHOUSE.findall(self.out.read_text())
        assert found, "the agent did not say where its Lighthouse runs"
        return int(found[-1])


@dataclass
class Job:
    base: Path
    env: dict[str, str]
    nodes: list[Node] = field(default_factory=list)

    def start(self, *launch: str, name: str = "node0", flags: Sequence[str] = ()) -> Node:
        """Start an agent with ``launch`` flags; ``flags`` are the trainer's, after ``RUN``."""
        out = self.base / f"{name}.out"
        command = [
            str(BIN / "python"), "-m", "elastic_train.quorum.launch", *launch, "-m", "elastic_train", *RUN, *flags,
            "--log-dir", str(self.base / "logs"), "--checkpoint-dir", str(self.base / "ckpt"),
        ]  # fmt: skip
        with out.open("wb") as sink:
            proc = subprocess.Popen(
                command, env=self.env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = Node(proc, out)
        self.nodes.append(node)
        return node

    def log(self, group: int) -> list[dict[str, Any]]:
        path = self.base / "logs" / f"replica_{group}.jsonl"
        return read_jsonl(path) if path.exists() else []

    def until(self, what: str, condition: Callable[[], bool], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"never saw {what}\n{self.output()}"
            time.sleep(0.05)

    def committed_steps(self, group: int) -> int:
        """The highest step this replica reported (quorum changes, checkpoints, epoch ends)."""
        steps = [int(r["step"]) for r in self.log(group) if isinstance(r.get("step"), int)]
        return max(steps, default=0)

    def output(self) -> str:
        return "\n".join(f"--- {n.out.name}\n" + "\n".join(n.out.read_text().splitlines()[-40:]) for n in self.nodes)

    def wait(self, node: Node, timeout: float = 120) -> int:
        try:
            return node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{node.out.name} still running after {timeout}s\n{self.output()}") from None


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    # Agents of several nodes share one secret (it signs the state a healing replica fetches).
    job = Job(tmp_path, base_env({"ELASTIC_TRAIN_QUORUM_SECRET": secrets.token_hex(16)}))
    try:
        yield job
    finally:
        for node in job.nodes:  # a frozen node must be thawed to die cleanly
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGCONT)
        kill_tagged(job.env[TOKEN_VAR])


def expected_digest(epoch: int, steps: int = STEPS) -> str:
    """The digest of epoch ``epoch``'s samples, from the data order alone."""
    order = global_batches(TRAIN_SAMPLES, BATCH, SEED, epoch, steps).reshape(-1)
    return format_digest(index_digest(order))


def assert_exactly_once(base: Path, epochs: int = EPOCHS, steps: int = STEPS) -> list[dict[str, Any]]:
    """The final checkpoint: finished at the last step, every epoch's samples exactly once."""
    done = load((base / "ckpt" / "latest").resolve())
    finished = (done.manifest.step, done.manifest.finished)
    assert done.manifest.finished and done.manifest.step == epochs * steps, finished
    history: list[dict[str, Any]] = done.payload.app["history"]
    assert [r["epoch"] for r in history] == list(range(1, epochs + 1))
    for epoch, record in enumerate(history):
        assert record["samples_seen"] == steps * BATCH, record
        repeated = f"epoch {epoch + 1}: samples skipped or repeated"
        assert record["sample_digest"] == expected_digest(epoch, steps), repeated
    return history


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    model = [k for k in a if k.startswith("model.")]
    assert model and a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in model)


def events(job: Job, group: int, name: str, after: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in job.log(group) if r["event"] == name and _time(r) > after]


def _time(record: dict[str, Any]) -> float:
    from elastic_train.logs import parse_timestamp

    return parse_timestamp(record.get("timestamp")) or 0.0


def run_fault_free(base: Path) -> None:
    """The reference: the same job, 2 replicas, no failures."""
    job = Job(base, base_env())
    try:
        node = job.start("--nproc-per-node", "2")
        assert job.wait(node) == 0, job.output()
    finally:
        kill_tagged(job.env[TOKEN_VAR])


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fault-free run per test session, shared with test_quorum_composes.py."""
    return shared_once(tmp_path_factory, "quorum-fault-free", run_fault_free)


def test_a_short_soak_of_sigkills_costs_the_survivors_no_restart_and_keeps_every_sample_exactly_once(
    job: Job, fault_free: Path
) -> None:
    # The first kill is placed: replica 1 SIGKILLs itself in step SALVAGED, after the attempt's first
    # collective succeeded and right before its gradient average, so replica 0's average fails for
    # sure (an outside kill lands there only by chance) and its work must be salvaged.
    job.env[FAULTS] = f"kill_before_average:rank=1:step={SALVAGED}"
    node = job.start("--nproc-per-node", "2", "--max-restarts", "3")
    job.until("replica 1's injected kill", lambda: bool(events(job, 1, "fault_injected")))
    placed = _time(events(job, 1, "fault_injected")[0])
    kills: list[tuple[int, float]] = [(1, placed)]
    job.until("replica 1 healed", lambda: bool(events(job, 1, "healed", placed)))
    # The second, from outside at whatever point replica 0 is (it is participant 0: it prints and saves).
    reached = job.committed_steps(1)
    job.until("progress", lambda: job.committed_steps(1) >= reached + 8)
    kills.append((0, time.time()))
    os.kill(node.pid(0), signal.SIGKILL)
    job.until("replica 0 healed", lambda: bool(events(job, 0, "healed", kills[-1][1])))
    # The Lighthouse dies too: its agent starts it again on its port, and the replicas' quorum
    # requests go to the new one (torchft's quorum retries); no worker restarts for it.
    reached = job.committed_steps(0)
    os.kill(node.lighthouse_pid(), signal.SIGKILL)
    job.until("the Lighthouse started again", lambda: "starting it again" in node.out.read_text())
    job.until("progress past the Lighthouse's death", lambda: job.committed_steps(0) >= reached + 5)
    assert job.wait(node) == 0, job.output()
    history = assert_exactly_once(job.base)
    # Every worker, the first ones and the replacements, took the task's data from the agent's
    # forkserver instead of opening it again (a replacement's start: ~0.02 s instead of ~0.5 s).
    starts = events(job, 0, "start") + events(job, 1, "start")
    assert len(starts) >= 4 and all(e["warm_data"] for e in starts), starts
    # Only the killed workers restart for the kills. A Lighthouse started again knows nobody: a
    # replica that reaches it before the other's heartbeat does gets a quorum of its own for a
    # step (torchft forms a quorum of every replica it has heard from). The position check stops
    # the two at their next common step and the one behind rejoins (exit 79, healed from the
    # other): that restart is allowed, after the Lighthouse's death and of that kind only.
    before, _, after = node.out.read_text().partition("starting it again")
    assert EXITED.findall(before) == [("1", "-9"), ("0", "-9")], before
    rejoins = EXITED.findall(after)
    assert all(code == str(int(ExitCode.QUORUM_STATE_UNSAFE)) for _, code in rejoins), after
    restarted = sorted((g, r) for g, _, r in node.workers())
    killed = {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert len(restarted) == len(killed) + len(rejoins) and killed <= set(restarted), restarted
    for victim, at in kills:
        survivor = 1 - victim
        # The survivor's first commit after the kill: alone (world 1), or already beside the
        # replacement when its warm fork (~0.15 s here: the usual case) asked before the
        # Lighthouse dropped the dead worker (400 ms heartbeat timeout); no change at all
        # when the kill fell between two of its attempts and the replacement joined at once.
        # Its cost: from its last commit before the kill to its first one after, one step's own
        # time included (the target, <= 1 s, is the benchmark's: this is a bound).
        for first in events(job, survivor, "quorum_changed", at)[:1]:
            assert first["world"] in (1, 2) and first["seconds_since_commit"] < 3.0, first
        assert not events(job, victim, "resumed", at), "a restarted replica must heal from a peer, not a checkpoint"
    # A survivor whose gradient average failed keeps its share's gradients and trains only the rest.
    # No average fails when the kill falls between two of its attempts and the Lighthouse drops the
    # dead worker before the next one (a fresh-clone run met this for both kills): then there is
    # nothing to salvage.
    failed = [e for victim, at in kills for e in events(job, 1 - victim, "gradient_average_failed", at)]
    salvaged = [e for victim, at in kills for e in events(job, 1 - victim, "salvaged", at)]
    assert salvaged or not failed, failed
    # The placed kill: replica 0's average of that step failed and the step's redo kept its work.
    # (The fault counts steps from 1, the schedule's shares from 0.)
    assert any(e["step"] == SALVAGED - 1 for e in events(job, 0, "salvaged", placed)), events(job, 0, "salvaged")
    # It kept its old share (half the batch) and trains the rest of its new one: the whole batch
    # alone, or its same half when the replacement was back in the redo's quorum.
    assert all(e["kept"] == BATCH // 2 and e["kept"] + e["computing"] in (BATCH // 2, BATCH) for e in salvaged), (
        salvaged
    )
    diff = max_abs_diff(final_state(job.base), final_state(fault_free))
    assert diff < 1e-5, f"weights differ from the fault-free run by {diff}"
    assert [r["val_acc"] for r in history] == pytest.approx(
        [r["val_acc"] for r in assert_exactly_once(fault_free)], abs=2 / 64
    )


def test_a_frozen_node_is_left_behind_within_seconds_and_a_late_node_joins_by_healing(job: Job) -> None:
    port = free_port()
    lighthouse = f"http://127.0.0.1:{port}"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--run-id", f"frozen-{port}"]
    # Node 0 trains alone while node 1's agent starts (in a fresh-clone CI run node 1 joined at
    # step 77): 6 epochs leave room to freeze node 1 mid-epoch after it joined.
    epochs = 6
    longer = ["--epochs", str(epochs)]
    node0 = job.start(*common, "--node-rank", "0", "--lighthouse-port", str(port), name="node0", flags=longer)
    job.until("node 0 training alone", lambda: job.committed_steps(0) >= 10)
    node1 = job.start(*common, "--node-rank", "1", "--lighthouse", lighthouse, name="node1", flags=longer)
    job.until("node 1 healed into the quorum", lambda: bool(events(job, 1, "healed")))
    joined = events(job, 1, "healed")[0]
    assert joined["from_step"] == 0 and joined["to_step"] > 0, joined
    assert not events(job, 1, "resumed"), "a joining node heals from a peer, not from the checkpoint"
    job.until("a commit at world 2", lambda: any(e["world"] == 2 for e in events(job, 0, "quorum_changed")))
    # Freeze in the middle of an epoch. The evaluation round at an epoch's end waits for its
    # slowest shard up to half the watchdog's limit (reduce_eval), not a step's peer timeout: a
    # node frozen there costs that long by design (CI once froze it there and saw 33 s).
    target = joined["to_step"] + 5
    if not 5 <= target % STEPS <= STEPS - 10:
        target = (target // STEPS + 1) * STEPS + 5
    assert target < epochs * STEPS - STEPS // 2, f"node 1 joined too late to freeze mid-epoch: {joined}"
    job.until("progress at world 2", lambda: job.committed_steps(1) >= target)
    frozen_at = time.time()
    os.killpg(node1.proc.pid, signal.SIGSTOP)  # the whole node: agent, forkserver, worker
    assert job.wait(node0) == 0, job.output()
    shrink = [e for e in events(job, 0, "quorum_changed", frozen_at) if e["world"] == 1]
    assert shrink, job.output()
    # Node loss -> first step at the smaller size: the collective timeout (2 s) plus a quorum.
    assert shrink[0]["seconds_since_commit"] < 6.0, shrink[0]
    assert_exactly_once(job.base, epochs=epochs)
    os.killpg(node1.proc.pid, signal.SIGKILL)  # the frozen node never comes back


def test_the_digest_of_an_epoch_changes_when_one_sample_is_repeated() -> None:
    """The exactly-once check above can fail: one repeated sample changes the digest."""
    order = global_batches(TRAIN_SAMPLES, BATCH, SEED, 0, STEPS).reshape(-1)
    repeated = order.clone()
    repeated[1] = repeated[0]
    assert format_digest(index_digest(repeated)) != expected_digest(0)
    assert format_digest(index_digest(order)) == expected_digest(0)
    assert np.unique(order.numpy()).size == order.numel()
