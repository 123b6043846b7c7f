#!/usr/bin/env python3
"""Chaos for soak runs: SIGKILL a random elastic-train worker every MTBF seconds.

    python jobs/chaos.py --mtbf 30 --duration 600 [--match checkpoints/soak] [--seed 1] [--spacing random]

Workers are the processes torchrun starts for ``-m elastic_train`` (not the agents), or those the
warm launcher (``python -m elastic_train.launch``) or the quorum agent
(``python -m elastic_train.quorum.launch``) forks; ``--match`` narrows them to those whose
launch command contains a string (e.g. their --log-dir), so a chaos run never touches other jobs
on the machine. Each kill is printed as one JSON line. The script stops
after ``--duration`` seconds, or once no worker has been seen for ``--idle-exit`` seconds (the job
ended). Only this machine's processes are touched; run one per node for a multi-node soak.

``--spacing fixed`` (the default) kills every MTBF seconds from the start; ``--spacing random``
draws each gap from an exponential distribution of mean MTBF (failures as a Poisson process, as
real ones arrive), so kills also land early in start-up, in saves and back to back, not only at
one phase of a job whose step time divides the MTBF.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _is_forkserver(args: list[str]) -> bool:
    return any("multiprocessing.forkserver" in a for a in args)


def workers(match: str) -> list[int]:
    """torchrun's workers (``python -u -m elastic_train``) and the warm launcher's (processes
    forked by the forkserver of a ``python -m elastic_train.launch`` agent)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        args = _cmdline(int(entry))
        if "-m" in args and "elastic_train" in args and "-u" in args and not any("torchrun" in a for a in args):
            launcher = args  # a torchrun worker: its own command line carries the --log-dir
        elif _is_forkserver(args) and _is_forkserver(_cmdline(_parent(int(entry)))):
            launcher = _cmdline(_parent(_parent(int(entry))))  # forked: the agent's command line
            if not any(a in ("elastic_train.launch", "elastic_train.quorum.launch") for a in launcher):
                continue
        else:
            continue
        if not match or any(match in a for a in launcher):
            found.append(int(entry))
    return sorted(found)


def next_gap(rng: random.Random, mtbf: float, spacing: str) -> float:
    """Seconds until the next kill: ``mtbf`` (fixed) or an exponential draw of mean ``mtbf``."""
    if spacing == "fixed":
        return mtbf
    if spacing == "random":
        return rng.expovariate(1.0 / mtbf)
    raise ValueError(f"spacing {spacing!r} is neither 'fixed' nor 'random'")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mtbf", type=float, required=True, help="seconds between kills")
    parser.add_argument("--duration", type=float, default=600.0, help="stop after this many seconds")
    parser.add_argument("--match", default="", help="only workers whose command line contains this")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--spacing", choices=("fixed", "random"), default="fixed", help="gaps between kills: MTBF, or exponential"
    )
    parser.add_argument("--idle-exit", type=float, default=30.0, help="stop when no worker was seen this long")
    args = parser.parse_args()
    if args.mtbf <= 0:
        parser.error("--mtbf must be > 0 seconds")
    rng = random.Random(args.seed)
    start = last_seen = time.monotonic()
    next_kill = start + next_gap(rng, args.mtbf, args.spacing)
    kills = 0
    while time.monotonic() - start < args.duration:
        time.sleep(0.2)
        found = workers(args.match)
        now = time.monotonic()
        if found:
            last_seen = now
        elif now - last_seen > args.idle_exit:
            break
        if now >= next_kill and found:
            victim = rng.choice(found)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills += 1
            print(json.dumps({"event": "chaos_kill", "pid": victim, "time": time.time(), "kills": kills}), flush=True)
            next_kill = now + next_gap(rng, args.mtbf, args.spacing)
    print(
        json.dumps({"event": "chaos_done", "kills": kills, "seconds": round(time.monotonic() - start, 1)}), flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
