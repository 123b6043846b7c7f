"""Quorum mode (issue 11) on torchft: examples/char_lm.py --ft quorum, one torchrun agent per replica group.

A Lighthouse on loopback and two single-worker replica groups. A SIGKILLed worker must cost the
survivor one discarded attempt and never a restart; the killed worker's agent restarts it and it
heals from the live peer (no checkpoint). Whatever the membership, every committed step trains
its global batch exactly once, and the replicas end with the same weights as a run without
failures, up to float reduction order.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import statistics
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from elastic_train.data.sampler import global_batches
from elastic_train.quorum.lighthouse import Lighthouse, LighthouseConfig
from elastic_train.quorum.names import JOB_VAR, SECRET_VAR
from elastic_train.quorum.schedule import QuorumSchedule
from examples.char_lm import splits
from tests.helpers import BIN, ROOT, TOKEN_VAR, base_env, kill_tagged, read_jsonl

SCRIPT = str(ROOT / "examples" / "char_lm.py")
STEPS, BATCH, CHARS, CONTEXT, SEED = 80, 16, 20_000, 32, 0  # 35 steps per epoch: 3 epochs
RUN = [
    "--ft",
    "quorum",
    "--steps",
    str(STEPS),
    "--batch-size",
    str(BATCH),
    "--chars",
    str(CHARS),
    "--context",
    str(CONTEXT),
]
# Padding each step with a sleep (no CPU) keeps a short run going while a killed worker restarts
# (torchrun, then importing torch and torchft: 5-10 s on this shared 2-core machine).
PADDED = ["--step-time", "0.25"]
SURVIVOR, VICTIM = 0, 1


def schedule() -> QuorumSchedule:
    samples = len(splits(CHARS, CONTEXT)[0])  # what the example trains on
    return QuorumSchedule(samples, BATCH, SEED)


def job_identity() -> dict[str, str]:
    """What every replica of one job shares (the quorum agent mints it; one torchrun per replica does not)."""
    return {JOB_VAR: f"quorum-lm-{secrets.token_hex(4)}", SECRET_VAR: secrets.token_hex(16)}


@dataclass
class Replicas:
    """A Lighthouse and one torchrun agent per replica group, all carrying one reaping token."""

    base: Path
    lighthouse: Lighthouse
    env: dict[str, str]
    agents: dict[int, subprocess.Popen[bytes]]

    def start(self, group: int, *extra: str) -> None:
        command = [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node=1",
            "--max-restarts=3",
            SCRIPT,
            *RUN,
            *extra,
            "--lighthouse",
            self.lighthouse.address,
            "--log-dir",
            str(self.base),
        ]
        with (self.base / f"agent_{group}.out").open("wb") as out:
            self.agents[group] = subprocess.Popen(
                command,
                env={**self.env, "REPLICA_GROUP_ID": str(group)},
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self, group: int) -> list[dict[str, Any]]:
        path = self.base / f"replica_{group}.jsonl"
        return read_jsonl(path) if path.exists() else []

    def until(self, what: str, condition: Callable[[], bool], timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while not condition():
            running = all(agent.poll() is None for agent in self.agents.values())
            assert running and time.monotonic() < deadline, f"never saw {what}\n{self.output()}"
            time.sleep(0.05)
        return time.time()

    def wait(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for group, agent in self.agents.items():
            try:
                codes[group] = agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"replica {group} still running after {timeout}s\n{self.output()}") from None
        return codes

    def output(self) -> str:
        return "\n".join(
            f"--- agent {g}\n" + "\n".join((self.base / f"agent_{g}.out").read_text().splitlines()[-30:])
            for g in sorted(self.agents)
        )

    def final_weights(self, group: int) -> dict[str, torch.Tensor]:
        return load_file(self.base / f"replica_{group}.final.safetensors")


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Callable[[LighthouseConfig], Replicas]]:
    """Starts a job's Lighthouse on demand; at the end reaps everything the job started."""
    env = base_env(job_identity())
    started: list[Lighthouse] = []

    def start(config: LighthouseConfig) -> Replicas:
        lighthouse = Lighthouse(config, log=tmp_path / "lighthouse.log", env=env)
        started.append(lighthouse)
        lighthouse.start()
        return Replicas(tmp_path, lighthouse, env, {})

    try:
        yield start
    finally:
        kill_tagged(env[TOKEN_VAR])  # agents and the workers torchrun put in sessions of their own
        for lighthouse in started:
            lighthouse.stop()


def commits(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in log if r["event"] == "commit"]


def assert_exactly_once(logs: dict[int, list[dict[str, Any]]], killed_at: float | None = None) -> None:
    """Every step 0..STEPS-1 committed, each replica commits a step at most once, all commits of
    a step agree on the membership and train the schedule's shares, and together they cover the
    step's global batch exactly once (so every epoch trains each of its samples once).

    One share may lack its record: a worker SIGKILLed after its gradient reached the survivor
    but before it logged (the survivor's commit at the full size proves the share was trained).
    That is allowed only for the killed replica at the survivor's first commit after the kill.
    """
    plan = schedule()
    by_step: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for group, log in logs.items():
        steps = [c["step"] for c in commits(log)]
        assert steps == sorted(set(steps)), f"replica {group} committed a step twice or out of order: {steps}"
        for c in commits(log):
            by_step[c["step"]].append((group, c))
    assert sorted(by_step) == list(range(STEPS)), f"steps never committed: {set(range(STEPS)) - set(by_step)}"
    first_after_kill = (
        min(c["step"] for c in commits(logs[SURVIVOR]) if c["time"] > killed_at) if killed_at is not None else None
    )
    trained: dict[int, Counter[int]] = defaultdict(Counter)
    for step, records in sorted(by_step.items()):
        worlds = {c["world"] for _, c in records}
        assert len(worlds) == 1, f"step {step} committed by different memberships: {records}"
        world = worlds.pop()
        ranks = sorted(c["rank"] for _, c in records)
        assert len(set(ranks)) == len(ranks), f"step {step}: two replicas trained the same share: {records}"
        for _, c in records:
            assert tuple(c["indices"]) == plan.share(step, world, c["rank"]).indices, f"step {step}: {c}"
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            assert step == first_after_kill and len(missing) == 1, f"step {step}: no record of shares {missing}"
            assert {g for g, _ in records} == {SURVIVOR}, f"step {step}: {records}"
        shares = [plan.share(step, world, r).indices for r in range(world)]
        epoch, batch = plan.position(step)
        expected = global_batches(plan.num_samples, BATCH, SEED, epoch)[batch].tolist()
        assert [i for s in shares for i in s] == expected, f"step {step}: shares do not cover the global batch"
        trained[epoch].update(i for s in shares for i in s)
    for epoch, counts in trained.items():
        assert max(counts.values()) == 1, f"epoch {epoch}: samples trained twice: {counts.most_common(3)}"


def assert_same_final_weights(job: Replicas) -> str:
    done = [[r for r in job.log(g) if r["event"] == "done"] for g in (0, 1)]
    assert all(len(d) == 1 and d[0]["step"] == STEPS for d in done), done
    assert done[0][0]["sha256"] == done[1][0]["sha256"], "the replicas ended with different weights"
    return str(done[0][0]["sha256"])


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    """Two replicas from start to end, no failure (the Lighthouse waits for both: min 2)."""
    base = tmp_path_factory.mktemp("fault_free")
    env = base_env(job_identity())
    started = time.monotonic()
    # Nothing fails here: a generous heartbeat timeout keeps a loaded machine from dropping a live replica.
    config = LighthouseConfig(min_replicas=2, heartbeat_timeout_ms=3000)
    with Lighthouse(config, log=base / "lighthouse.log", env=env) as lighthouse:
        job = Replicas(base, lighthouse, env, {})
        try:
            job.start(0)
            job.start(1)
            codes = job.wait(timeout=80)
        finally:
            kill_tagged(env[TOKEN_VAR])
    print(f"fault-free run: {time.monotonic() - started:.1f}s")
    assert codes == {0: 0, 1: 0}, job.output()
    yield job


@pytest.mark.timeout(90)
def test_two_replicas_without_failures_commit_every_step_together_and_end_equal(fault_free: Replicas) -> None:
    logs = {g: fault_free.log(g) for g in (0, 1)}
    for group, log in logs.items():
        assert [c["step"] for c in commits(log)] == list(range(STEPS)), f"replica {group}"
        assert {(c["world"], c["rank"]) for c in commits(log)} == {(2, group)}, f"replica {group} left the quorum"
        assert not [r for r in log if r["event"] in ("heal", "discarded")], f"replica {group}: {log}"
    assert_exactly_once(logs)
    assert_same_final_weights(fault_free)
    assert torch.equal(fault_free.final_weights(0)["head.weight"], fault_free.final_weights(1)["head.weight"])


@pytest.mark.timeout(120)  # the fault-free reference run is this test's setup when it runs alone
def test_a_killed_worker_costs_the_survivor_one_attempt_and_heals_from_it_on_restart(
    replicas: Callable[[LighthouseConfig], Replicas], fault_free: Replicas
) -> None:
    started = time.monotonic()
    job = replicas(LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=400, join_timeout_ms=100))
    job.start(SURVIVOR, *PADDED)
    job.start(VICTIM, *PADDED)

    def both_at_full_size_past(step: int) -> bool:
        return all(any(c["world"] == 2 and c["step"] >= step for c in commits(job.log(g))) for g in (0, 1))

    job.until("both replicas training together", lambda: both_at_full_size_past(10))
    victim_pid = job.log(VICTIM)[0]["pid"]  # the worker, not its agent
    os.kill(victim_pid, signal.SIGKILL)
    killed_at = time.time()
    codes = job.wait(timeout=70)
    assert codes == {0: 0, 1: 0}, job.output()

    survivor, victim = job.log(SURVIVOR), job.log(VICTIM)
    # The survivor was never restarted: one worker, one start, throughout.
    starts = [r for r in survivor if r["event"] == "start"]
    assert len(starts) == 1 and starts[0]["restart_count"] == 0, starts
    assert {r["pid"] for r in survivor} == {starts[0]["pid"]}
    # Alone after the kill (a first commit at 2 is the step whose allreduce the victim finished
    # before it died), then with the restarted victim again.
    worlds_after = [c["world"] for c in commits(survivor) if c["time"] > killed_at]
    assert worlds_after[worlds_after[0] == 2 :][0] == 1 and worlds_after[-1] == 2, worlds_after
    # The victim's agent restarted it once; the new worker healed from the survivor, mid-run.
    restarted = [r for r in victim if r["event"] == "start"][1:]
    assert len(restarted) == 1 and restarted[0]["restart_count"] == 1 and restarted[0]["pid"] != victim_pid
    # (its first worker may have healed too: it can start after the survivor's first steps)
    heals = [r for r in victim if r["event"] == "heal" and r["pid"] == restarted[0]["pid"]]
    assert len(heals) == 1, heals
    heal = heals[0]
    assert heal["from_step"] == 0 and 0 < heal["to_step"] < STEPS, heal
    after_heal = [c for c in commits(victim) if c["pid"] == restarted[0]["pid"]]
    assert after_heal[0]["step"] == heal["to_step"] and {c["world"] for c in after_heal} == {2}, after_heal[:3]

    assert_exactly_once({SURVIVOR: survivor, VICTIM: victim}, killed_at=killed_at)
    assert_same_final_weights(job)
    difference = max_abs_diff(job.final_weights(SURVIVOR), fault_free.final_weights(0))
    assert difference < 1e-5, f"weights differ from the fault-free run by {difference}"

    # Time lost: the survivor's time from its last commit before the kill to its first commit
    # alone, beyond the typical step time of the steps it committed in between.
    times = [c["time"] for c in commits(survivor)]
    typical = statistics.median(b - a for a, b in itertools.pairwise(times))
    before = max(t for t in times if t <= killed_at)
    alone = [c for c in commits(survivor) if c["time"] > killed_at and c["world"] == 1]
    after = alone[0]["time"]
    lost = after - before - typical * sum(1 for t in times if before < t <= after)
    at = {c["step"]: c["time"] for c in commits(survivor)}
    join_step = at[heal["to_step"]] - at[heal["to_step"] - 1]  # the survivor's step that the victim rejoined
    redo = alone[0]
    discarded = [r for r in survivor if r["event"] == "discarded"]
    print(
        f"\nquorum kill: survivor discarded {len(discarded)} attempt(s) (failure seen "
        f"{min((r['time'] for r in discarded), default=float('nan')) - killed_at:.3f}s after the kill), "
        f"waited {redo['quorum_seconds']:.3f}s for the smaller quorum"
    )
    print(
        f"quorum kill: typical step {typical:.3f}s; survivor's gap {after - before:.3f}s -> lost "
        f"{lost:.3f}s per failure; killed replica back (restart + import + heal) "
        f"{after_heal[0]['time'] - killed_at:.2f}s after the kill; heal (quorum + state fetch) {heal['seconds']:.3f}s "
        f"at step {heal['to_step']}; survivor's step at the rejoin {join_step:.3f}s; "
        f"max |w - w_fault_free| = {difference:.2e}; test {time.monotonic() - started:.1f}s"
    )


@pytest.mark.timeout(90)
def test_a_replica_that_joins_late_heals_from_the_running_one_and_trains_with_it(
    replicas: Callable[[LighthouseConfig], Replicas],
) -> None:
    started = time.monotonic()
    job = replicas(LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=400, join_timeout_ms=100))
    job.start(0, *PADDED)
    job.until("replica 0 training alone", lambda: len(commits(job.log(0))) >= 10)
    job.start(1, *PADDED)
    codes = job.wait(timeout=70)
    assert codes == {0: 0, 1: 0}, job.output()

    first, late = job.log(0), job.log(1)
    heals = [r for r in late if r["event"] == "heal"]
    assert len(heals) == 1 and heals[0]["from_step"] == 0 and heals[0]["to_step"] >= 10, heals
    late_commits = commits(late)
    assert late_commits[0]["step"] == heals[0]["to_step"] and {c["world"] for c in late_commits} == {2}
    worlds = [c["world"] for c in commits(first)]
    assert worlds[:10] == [1] * 10 and worlds[-1] == 2, worlds
    assert not [r for r in first if r["event"] == "heal"]
    assert_exactly_once({0: first, 1: late})
    assert_same_final_weights(job)
    print(
        f"\nlate join: healed to step {heals[0]['to_step']} in {heals[0]['seconds']:.3f}s; "
        f"test {time.monotonic() - started:.1f}s"
    )
