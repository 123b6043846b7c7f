"""Elastic fault tolerance with real torchrun agents on loopback: two agents stand for two nodes.

Every test starts agents through jobs/elastic-agent.sh, so the launch settings it documents are
the ones tested.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import step_dir_name
from elastic_train.data.synthetic import SYNTHETIC_TRAIN
from elastic_train.outcome import PREEMPTED_MARKER, ExitCode, read_marker
from elastic_train.testing.agents import Agent, all_events, event_time, rendezvous_store, wait_for
from tests.helpers import (
    assert_bitwise_equal,
    cli,
    dirs,
    epoch_metrics,
    final_state,
    free_port,
    planned_samples,
    reference_run,
)

pytestmark = pytest.mark.timeout(300)
RUN = [
    "--batch-size",
    "32",
    "--max-steps-per-epoch",
    "6",
    "--epochs",
    "3",
    "--target-accuracy",
    "1.0",
    "--patience",
    "0",
    "--checkpoint-every",
    "2",
    "--hang-timeout",
    "60",
    "--max-val-samples",
    "64",
]
# Long enough that a node can be killed while training is under way.
LONG = [*RUN, "--max-steps-per-epoch", "24"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2-process run (same world size as two one-worker agents)."""
    base = tmp_path_factory.mktemp("elastic-reference")
    reference_run(2, [*RUN, *dirs(base)])
    return base


# Every epoch's samples as the sampler plans them, whatever the world size: what a run of LONG
# that loses a node must still report (its own samples, not a second run's).
LONG_SAMPLES = planned_samples(SYNTHETIC_TRAIN, 32, epochs=3, max_steps=24)


def committed_steps(base: Path) -> list[int]:
    return [e["step"] for e in all_events(base, "checkpoint_committed")]


def samples(base: Path) -> list[tuple[int, int, str]]:
    return [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(base)]


def test_sigkill_of_a_worker_mid_epoch_restarts_the_group_and_ends_bitwise_equal(
    tmp_path: Path, agents: list[Agent], reference: Path
) -> None:
    with rendezvous_store(tmp_path) as endpoint:
        faults = {"ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=9"}
        agents += [Agent(n, tmp_path, endpoint, "kill-worker", RUN, env=faults) for n in ("a", "b")]
        codes = [a.wait(240) for a in agents]
    assert codes == [0, 0], agents[0].output[-3000:] + agents[1].output[-3000:]
    resumed = all_events(tmp_path, "resumed")
    # The async save of step 8 commits at the next step boundary; the kill comes first (start of
    # step 9), so the newest committed checkpoint is the epoch end at step 6.
    assert resumed and {e["step"] for e in resumed} == {6}, "restarted workers resume from step 6"
    assert_bitwise_equal(final_state(reference), final_state(tmp_path))
    assert epoch_metrics(tmp_path) == epoch_metrics(reference)


def test_losing_a_node_that_does_not_host_the_store_shrinks_to_one_and_finishes_exactly(
    tmp_path: Path, agents: list[Agent]
) -> None:
    # Agent a hosts the rendezvous store itself (torchrun's default layout); b is killed.
    endpoint = f"127.0.0.1:{free_port()}"
    agents.append(Agent("a", tmp_path, endpoint, "lose-node", LONG, env={"ET_STORE_HOST": "1"}))
    time.sleep(2)
    agents.append(Agent("b", tmp_path, endpoint, "lose-node", LONG))
    wait_for(lambda: 4 in committed_steps(tmp_path), 120, "a checkpoint at step 4")
    killed_at = agents[1].kill_node()
    assert agents[0].wait(240) == 0, agents[0].output[-3000:]
    smaller = [e for e in all_events(tmp_path, "first_step") if e["world_size"] == 1 and event_time(e) > killed_at]
    assert smaller, "the survivor never trained at world size 1"
    # A bound that tells a prompt shrink from one that waited out a timeout (the step watchdog's
    # 60 s; the rendezvous's): the restart, a fresh `import torch` and the resume took 18-21 s in
    # two fresh-clone CI runs on a loaded 2-core machine (the imports 4-6 s of it). Its speed is
    # the benchmark's (docs/benchmarks.md), not this test's.
    assert event_time(smaller[0]) - killed_at < 45, f"shrink took {event_time(smaller[0]) - killed_at:.1f}s"
    assert samples(tmp_path) == LONG_SAMPLES, "a sample was skipped or repeated across the shrink"


def test_a_new_node_joining_grows_the_job_back_to_two(tmp_path: Path, agents: list[Agent]) -> None:
    long_run = LONG
    with rendezvous_store(tmp_path) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "grow", long_run) for n in ("a", "b")]
        wait_for(lambda: 4 in committed_steps(tmp_path), 120, "a checkpoint at step 4")
        killed_at = agents[1].kill_node()
        wait_for(
            lambda: any(e["world_size"] == 1 and event_time(e) > killed_at for e in all_events(tmp_path, "first_step")),
            60,
            "the shrink to one node",
        )
        joined = Agent("c", tmp_path, endpoint, "grow", long_run)
        agents.append(joined)
        assert agents[0].wait(240) == 0 and joined.wait(60) == 0, agents[0].output[-3000:]
    bigger = [e for e in all_events(tmp_path, "first_step") if e["world_size"] == 2 and event_time(e) > joined.started]
    assert bigger, "the job never grew back to world size 2"
    # Unloaded the grow takes ~10 s (the new agent's start, the next membership check, a stop at the
    # exact step, the workers' start); CI's second lane makes that up to ~3x. The bound separates
    # "grown at the next membership check" from "grown only when a timeout fired" (--hang-timeout 60);
    # the grow's cost itself is measured by the benchmarks, not here.
    grow_s = event_time(bigger[0]) - joined.started
    assert grow_s < 50, f"grow took {grow_s:.1f}s"


def test_losing_the_node_at_the_rendezvous_endpoint_with_the_standalone_store_is_survived(
    tmp_path: Path, agents: list[Agent]
) -> None:
    with rendezvous_store(tmp_path) as endpoint:
        agents.append(Agent("a", tmp_path, endpoint, "lose-endpoint", LONG))
        time.sleep(2)
        agents.append(Agent("b", tmp_path, endpoint, "lose-endpoint", LONG))
        wait_for(lambda: 4 in committed_steps(tmp_path), 120, "a checkpoint at step 4")
        killed_at = agents[0].kill_node()  # the first agent: the node users would call the endpoint
        assert agents[1].wait(240) == 0, agents[1].output[-3000:]
    assert any(e["world_size"] == 1 and event_time(e) > killed_at for e in all_events(tmp_path, "first_step"))
    assert "Training completed successfully." in agents[1].output


def test_a_stopped_worker_is_detected_by_the_watchdog_and_the_group_restarts(
    tmp_path: Path, agents: list[Agent]
) -> None:
    # Short: after the restart the run only has to finish (the frozen-node variants are in
    # tests/launch/test_impolite_nodes.py).
    args = [*RUN, "--max-steps-per-epoch", "12", "--epochs", "1", "--hang-timeout", "10", "--collective-timeout", "300"]
    with rendezvous_store(tmp_path) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "sigstop", args) for n in ("a", "b")]
        wait_for(lambda: 4 in committed_steps(tmp_path), 120, "a checkpoint at step 4")
        (victim,) = agents[1].worker_pids()
        stopped_at = time.time()
        os.kill(victim, signal.SIGSTOP)
        codes = [a.wait(240) for a in agents]
    assert codes == [0, 0], agents[0].output[-3000:] + agents[1].output[-3000:]
    hangs = all_events(tmp_path, "hang_detected")
    assert hangs, "no rank reported the hang"
    assert event_time(hangs[0]) - stopped_at < 10 + 10, f"detected after {event_time(hangs[0]) - stopped_at:.1f}s"
    assert all_events(tmp_path, "resumed"), "the group did not restart from a checkpoint"
    assert any(e["cause"] == "hang" for e in all_events(tmp_path, "recovery")), (
        "the restart was not put down to the hang"
    )


def test_sigterm_to_the_agents_commits_a_checkpoint_and_a_relaunch_loses_no_step(
    tmp_path: Path, agents: list[Agent]
) -> None:
    long_run = [*RUN, "--epochs", "30"]
    with rendezvous_store(tmp_path) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "preempt-1", long_run) for n in ("a", "b")]
        wait_for(lambda: 2 in committed_steps(tmp_path), 120, "training to be under way")
        for agent in agents:
            agent.signal(signal.SIGTERM)
        for agent in agents:
            agent.wait(90)
    exits = all_events(tmp_path, "exit")
    assert len(exits) == 2 and {e["code"] for e in exits} == {ExitCode.PREEMPTED}
    assert all(e["committed"] for e in exits)
    marker = read_marker(tmp_path / "ckpt" / PREEMPTED_MARKER)
    assert marker is not None and marker.committed and marker.exit_code is ExitCode.PREEMPTED
    step = marker.step
    assert step in committed_steps(tmp_path)
    # Relaunch (a new job id, as a fresh torchrun launch): it continues at exactly that step.
    relaunch = cli([*long_run, "--epochs", "2", *dirs(tmp_path)]) if step < 12 else None
    if relaunch is not None:
        assert relaunch.returncode == 0, relaunch.output
        assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(step)}" in relaunch.stdout
        assert f"step {step}" in relaunch.stdout
        assert "(preemption: 1)" in relaunch.stdout and "Steps recomputed: 0" in relaunch.stdout


def test_a_fault_on_every_attempt_exhausts_restarts_and_torchrun_names_the_root_cause(
    tmp_path: Path, agents: list[Agent]
) -> None:
    # One restart shows the budget exhausted as well as three (the default) would, at half the attempts.
    faults = {"ELASTIC_TRAIN_FAULTS": "raise:rank=1:step=3:always", "ET_MAX_RESTARTS": "1"}
    with rendezvous_store(tmp_path) as endpoint:
        agents += [Agent(n, tmp_path, endpoint, "always-raise", RUN, env=faults) for n in ("a", "b")]
        codes = [a.wait(240) for a in agents]
    assert all(code != 0 for code in codes)
    output = agents[0].output + agents[1].output
    assert "Root Cause" in output and "InjectedFault: injected fault: raise at step 3" in output, output[-4000:]
    assert "rank      : 1" in output


def test_chaos_kills_workers_every_mtbf_and_the_job_still_finishes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.helpers import ROOT, base_env

    args = [*LONG, *dirs(tmp_path)]
    console = tmp_path / "console.txt"
    with console.open("w") as out_file:
        job = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "torchrun"),
                "--standalone",
                "--nproc_per_node=2",
                "--max-restarts=5",
                "-m",
                "elastic_train",
                *args,
            ],
            env=base_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
            cwd=ROOT,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        # Chaos starts once a checkpoint is committed: on a loaded machine start-up alone can take
        # longer than the first MTBF, and a kill before any commit restarts from scratch, which
        # books no recovery (there is nothing to resume) and tests nothing this test is about.
        # The job trains ~6.5 s past its first commit on an idle machine here (a run measured on
        # Dec 4: an MTBF of 12 s then killed nothing), so the kills come at 4 and 8 s: one or two.
        wait_for(lambda: bool(committed_steps(tmp_path)) or job.poll() is not None, 120, "a first checkpoint")
        chaos = subprocess.run(
            [
                sys.executable,
                str(ROOT / "jobs" / "chaos.py"),
                "--mtbf",
                "4",
                "--duration",
                "10",
                "--match",
                str(tmp_path),
                "--seed",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        job.wait(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    out = console.read_text()
    kills = [json.loads(line) for line in chaos.stdout.splitlines() if "chaos_kill" in line]
    assert 1 <= len(kills) <= 3, chaos.stdout
    assert job.returncode == 0, out[-3000:]
    assert "Training completed successfully." in out
    restarts = [e for e in all_events(tmp_path, "recovery")]
    assert len(restarts) >= 1 and all(e["cause"] == "failure" for e in restarts)
