"""Recovery times and goodput under failures, with two torchrun agents on loopback.

Medians of ``--repeats`` runs of:

* kill -> first step after resume: a worker SIGKILLed (fault injection), until the restarted
  group's first step;
* node loss -> first step at the smaller size: one agent and its worker SIGKILLed;
* node join -> first step at the larger size: a new agent started after that shrink;

and the goodput of a ``--soak`` seconds run with one worker killed every ``--mtbf`` seconds
(jobs/chaos.py), as the trainer reports it (productive step time / wall time since job start).
Target: goodput >= 0.85.

    python benchmarks/recovery.py [--repeats 3] [--soak 180] [--mtbf 30] [--launcher torchrun|warm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_train.testing.agents import Agent, all_events, event_time, rendezvous_store, wait_for  # noqa: E402

LAUNCHER: dict[str, str] = {}  # ET_LAUNCHER for jobs/elastic-agent.sh, from --launcher

RUN = [
    "--batch-size",
    "32",
    "--max-steps-per-epoch",
    "40",
    "--epochs",
    "3",
    "--target-accuracy",
    "1.0",
    "--patience",
    "0",
    "--checkpoint-every",
    "5",
    "--hang-timeout",
    "60",
]


def first_step_after(base: Path, since: float, world_size: int | None = None) -> float:
    steps = [
        event_time(e)
        for e in all_events(base, "first_step")
        if event_time(e) > since and (world_size is None or e["world_size"] == world_size)
    ]
    if not steps:
        raise RuntimeError(f"no first step after {since} in {base}")
    return min(steps) - since


def committed(base: Path, step: int) -> bool:
    return any(e["step"] >= step for e in all_events(base, "checkpoint_committed"))


def kill_recovery(base: Path) -> dict[str, float]:
    """Seconds from the kill to the first step after resume, and where they went."""
    with rendezvous_store(base) as endpoint:
        env = {**LAUNCHER, "ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=12"}
        agents = [Agent(n, base, endpoint, "bench-kill", RUN, env=env) for n in ("a", "b")]
        try:
            wait_for(lambda: bool(all_events(base, "fault_injected")), 180, "the injected kill")
            killed = event_time(all_events(base, "fault_injected")[0])
            wait_for(lambda: bool(all_events(base, "resumed")), 120, "the restart")
            time.sleep(3)
            total = first_step_after(base, killed)
        finally:
            for agent in agents:
                agent.cleanup()
    # The restarted workers' `start` events: when each process began, and its startup phases.
    starts = [e for e in all_events(base, "start") if e["process_started"] > killed]
    phases: dict[str, float] = {"until_relaunch": min(e["process_started"] for e in starts) - killed}
    for name in starts[0]["startup_s"]:
        phases[name] = max(e["startup_s"][name] for e in starts)  # the slowest rank sets the pace
    phases["until_first_step"] = total - sum(phases.values())
    return {"total": total, **phases}


def loss_and_join(base: Path) -> tuple[float, float]:
    with rendezvous_store(base) as endpoint:
        agents = [Agent(n, base, endpoint, "bench-node", RUN, env=LAUNCHER) for n in ("a", "b")]
        try:
            wait_for(lambda: committed(base, 5), 180, "a first checkpoint")
            killed = agents[1].kill_node()
            wait_for(
                lambda: any(e["world_size"] == 1 and event_time(e) > killed for e in all_events(base, "first_step")),
                120,
                "the shrink",
            )
            shrink = first_step_after(base, killed, world_size=1)
            joined = Agent("c", base, endpoint, "bench-node", RUN, env=LAUNCHER)
            agents.append(joined)
            wait_for(
                lambda: any(
                    e["world_size"] == 2 and event_time(e) > joined.started for e in all_events(base, "first_step")
                ),
                120,
                "the grow",
            )
            return shrink, first_step_after(base, joined.started, world_size=2)
        finally:
            for agent in agents:
                agent.cleanup()


def soak_goodput(base: Path, seconds: float, mtbf: float) -> dict[str, object]:
    # Sized to last about `seconds` without failures on 2 CPU processes: an epoch of the synthetic
    # set is 32 steps of 128 images, ~12 s of training plus ~1.5 s of validation here.
    epochs = max(3, round(seconds / 14))
    args = [
        "--batch-size",
        "128",
        "--epochs",
        str(epochs),
        "--target-accuracy",
        "1.0",
        "--patience",
        "0",
        "--checkpoint-every",
        "2",
    ]
    started = time.monotonic()
    with rendezvous_store(base) as endpoint:
        agents = [
            Agent(n, base, endpoint, "bench-soak", args, env={**LAUNCHER, "ET_MAX_RESTARTS": "100"}) for n in ("a", "b")
        ]
        chaos = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "jobs" / "chaos.py"),
                "--mtbf",
                str(mtbf),
                "--duration",
                str(seconds * 3),
                "--match",
                str(base),
                "--seed",
                "7",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            for agent in agents:
                agent.wait(seconds * 4)
        finally:
            chaos.kill()
            for agent in agents:
                agent.cleanup()
    wall = time.monotonic() - started
    kills = sum(1 for line in (chaos.stdout.read() if chaos.stdout else "").splitlines() if "chaos_kill" in line)
    done = all_events(base, "done")
    if not done:
        raise RuntimeError("the soak run did not finish")
    return {
        "goodput": done[-1]["goodput"],
        "wall_s": wall,
        "kills": kills,
        "restarts": done[-1]["restarts"],
        "lost_s": done[-1]["lost_s"],
        "recomputed_steps": done[-1]["recomputed_steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--soak", type=float, default=180.0, help="seconds of the goodput run (0: none)")
    parser.add_argument("--mtbf", type=float, default=30.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--launcher",
        choices=["torchrun", "warm"],
        default="torchrun",
        help="torchrun, or python -m elastic_train.launch (workers forked from a preloaded process)",
    )
    args = parser.parse_args()
    LAUNCHER["ET_LAUNCHER"] = args.launcher
    kill_runs: list[dict[str, float]] = []
    shrinks, grows = [], []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            kill_runs.append(kill_recovery(Path(a)))
            shrink, grow = loss_and_join(Path(b))
            shrinks.append(shrink)
            grows.append(grow)
        print(
            f"run {i + 1}: kill -> step {kill_runs[-1]['total']:.1f} s, node loss -> step {shrink:.1f} s, "
            f"join -> step {grow:.1f} s",
            flush=True,
        )
    kills = [run["total"] for run in kill_runs]
    breakdown = {name: statistics.median(run[name] for run in kill_runs) for name in kill_runs[0] if name != "total"}
    soak: dict[str, object] = {}
    if args.soak > 0:  # 0: skip (benchmarks/goodput.py measures goodput for every mode, like for like)
        with tempfile.TemporaryDirectory() as s:
            soak = soak_goodput(Path(s), args.soak, args.mtbf)
    result = {
        "kill_to_step_s": statistics.median(kills),
        "kill_breakdown_s": breakdown,
        "node_loss_to_step_s": statistics.median(shrinks),
        "join_to_step_s": statistics.median(grows),
        "launcher": args.launcher,
        "repeats": args.repeats,
        "soak_s": args.soak,
        "mtbf_s": args.mtbf,
        **soak,
    }
    print(f"kill -> first step after resume: {result['kill_to_step_s']:.1f} s (median of {args.repeats})")
    print("  of which: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in breakdown.items()))
    print(f"node loss -> first step at world size 1: {result['node_loss_to_step_s']:.1f} s")
    print(f"node join -> first step at world size 2: {result['join_to_step_s']:.1f} s")
    if soak:
        print(
            f"goodput of a {args.soak:.0f} s run, a worker killed every {args.mtbf:.0f} s ({soak['kills']} kills): "
            f"{soak['goodput']:.2f} (target >= 0.85)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
