"""Goodput under worker failures, the way a user sees it: torchrun restarts (DDP, FSDP2) vs the warm launcher vs quorum.

The same training job (synthetic data, the ViT, global batch 128, 2 CPU workers on one node,
checkpoints every 2 steps) is launched these ways:

* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 --max-restarts 100 -m elastic_train``
  (a failure restarts both workers from the last checkpoint);
* ``warm``: ``python -m elastic_train.launch`` with the same flags (the same, workers forked warm);
* ``quorum``: ``python -m elastic_train.quorum.launch --nproc-per-node 2 --max-restarts 100``
  (``--ft quorum``: the survivor keeps training, the killed worker is forked again and heals);
* ``fsdp``: ``torchrun`` as above with ``--parallel fsdp`` (FSDP2: parameters, gradients and
  optimizer state sharded over the 2 workers; each checkpoint rank writes its own pieces);
* ``torchrun-4`` and ``quorum-groups`` (suite: goodput-groups): 4 workers on the node, as one
  DDP group under ``torchrun --nproc-per-node 4`` or as 2 replica groups of 2 (DDP inside each,
  the quorum across: ``--nproc-per-node 2 --procs-per-replica 2``), a failure taking its whole
  group out until it restarts and heals;
* ``quorum-etcd``: ``quorum`` with ``--lighthouse-etcd`` (three etcd members on loopback, started
  for the benchmark): the Lighthouse's seat and the line record, each step claimed in etcd
  before it commits (``quorum.line``): what that costs, fault-free and under kills.

For each mode ``--soaks`` rounds of one run without failures and one in which ``jobs/chaos.py``
SIGKILLs a random worker every ``--mtbf`` seconds (seeded), the modes interleaved; a mode's
fault-free wall is the median of its fault-free runs.
Every run trains the same samples, so

    goodput = (trained samples / fault-free throughput) / wall time = fault-free wall / soak wall

with walls from the launch command to the process's exit (start-up, the first and last
checkpoint included), each soak against the fault-free run of its own round (``paired``): the
headline figure, what failures cost a mode. A second figure takes the FASTEST mode's median
fault-free wall as the reference, so that a mode's own overhead counts as lost too. Time lost
per failure = (soak wall - the round's fault-free wall) / kills, medians over the rounds, split
from the trainer's event logs (see ``split_restart`` and ``split_quorum``). Quorum mode's node
loss (one of two agents and its worker SIGKILLed, or SIGSTOPped: a frozen node; with groups of
several workers also one worker alone SIGSTOPped, whose group's rank 0 keeps heartbeating) ->
first step at the smaller size is timed too. Targets (issue 11): quorum goodput >= 0.95, <= 1 s
lost per worker failure, node loss -> first step <= 3 s.

    python benchmarks/goodput.py [--soaks 3] [--mtbf 30] [--spacing fixed|random] [--epochs 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_train.logs import parse_timestamp  # noqa: E402
from elastic_train.quorum.names import SECRET_VAR  # noqa: E402
from elastic_train.testing.processes import TOKEN_VAR, base_env, free_port, kill_tagged, read_jsonl  # noqa: E402

BIN = Path(sys.executable).parent
MODES = ("torchrun", "warm", "quorum")  # the default --modes; "fsdp" runs beside torchrun (suite: goodput-fsdp)
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=100"]
LAUNCH = {
    "torchrun": TORCHRUN,
    # Restart mode with a sharded model: the same job with --parallel fsdp (MODE_FLAGS).
    "fsdp": TORCHRUN,
    "warm": [
        str(BIN / "python"),
        "-m",
        "elastic_train.launch",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=100",
    ],
    "quorum": [
        str(BIN / "python"),
        "-m",
        "elastic_train.quorum.launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "100",
    ],
}
LAUNCH["quorum-etcd"] = list(LAUNCH["quorum"])  # + --lighthouse-etcd, once its members run (main)
# Replica groups (issue 20): 4 workers either way, so that the groups' baseline is like for like.
LAUNCH["torchrun-4"] = [*TORCHRUN[:2], "--nproc-per-node=4", *TORCHRUN[3:]]
GROUP_SIZE = 2
LAUNCH["quorum-groups"] = [*LAUNCH["quorum"], "--procs-per-replica", str(GROUP_SIZE)]
MODE_FLAGS = {"fsdp": ["--parallel", "fsdp"]}
WORKER = re.compile(r"replica group (\d+): worker pid (\d+)")


# --train-flags: more trainer flags for every run, e.g. a model whose heal moves real state
# ("--model torchvision:alexnet --image-size 64": 57 M parameters, 228 MB of weights).
EXTRA_FLAGS: list[str] = []


def train_flags(epochs: int, base: Path) -> list[str]:
    return [
        "--batch-size", "128", "--epochs", str(epochs), "--target-accuracy", "1.0", "--patience", "0",
        "--checkpoint-every", "2", "--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt"),
        *EXTRA_FLAGS,
    ]  # fmt: skip


def state_mb(base: Path) -> float:
    """The newest checkpoint's size: the model and optimizer state that a heal moves too."""
    folder = (base / "ckpt" / "latest").resolve()
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def events(base: Path, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in sorted((base / "logs").glob("*.jsonl")):
        if path.name != "metrics.jsonl":
            found += [dict(e, _file=path.name) for e in read_jsonl(path) if e.get("event") == name]
    for e in found:
        e["_t"] = parse_timestamp(e.get("timestamp")) or 0.0
    return sorted(found, key=lambda e: e["_t"])


def run(mode: str, base: Path, epochs: int, mtbf: float | None, seed: int, spacing: str = "fixed") -> dict[str, Any]:
    """One launch, optionally with chaos; returns its wall time, kills and output."""
    env = base_env()
    run_id = ["--run-id", f"bench-{base.name}"] if mode == "quorum-etcd" else []  # the seat's key is the job's
    command = [*LAUNCH[mode], *run_id, "-m", "elastic_train", *train_flags(epochs, base), *MODE_FLAGS.get(mode, [])]
    out = base / "launch.out"
    chaos = None
    started = time.monotonic()
    try:
        with out.open("wb") as sink:
            proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
            if mtbf:
                chaos = subprocess.Popen(
                    [sys.executable, str(ROOT / "jobs" / "chaos.py"), "--mtbf", str(mtbf), "--match", str(base),
                     "--seed", str(seed), "--duration", "3600", "--idle-exit", "20", "--spacing", spacing],
                    stdout=subprocess.PIPE, text=True, env=env,
                )  # fmt: skip
            code = proc.wait(timeout=epochs * 120 + 600)
        wall = time.monotonic() - started
    finally:
        if chaos is not None:
            chaos.kill()
        kill_tagged(env[TOKEN_VAR])
    kills = []
    if chaos is not None and chaos.stdout is not None:
        kills = [json.loads(line) for line in chaos.stdout.read().splitlines() if "chaos_kill" in line]
    if code != 0:
        raise RuntimeError(f"{mode} run ended with {code}; see {out}:\n{out.read_text()[-3000:]}")
    digests, weights = final_state(base)
    # Each epoch's training time (the trainer's own clock): the rest of the wall is start-up,
    # what runs between epochs outside their clocks, and the exit.
    epochs_s = [float(m["epoch_time"]) for m in read_jsonl(base / "logs" / "metrics.jsonl")]
    # The 1-minute load when the run ended: this run alone keeps ~2 of the 2 cores busy; far
    # more means other work shared the machine and its walls measure that too.
    load = os.getloadavg()[0]
    return {
        "wall_s": wall, "kills": kills, "base": base, "digests": digests, "weights": weights, "load_1min": load,
        "state_mb": state_mb(base), "epochs_s": epochs_s,
    }  # fmt: skip


def final_state(base: Path) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """The final checkpoint's per-epoch (samples, digest) and model tensors."""
    from elastic_train.checkpoint.manager import load

    done = load((base / "ckpt" / "latest").resolve())
    digests = [(int(r["samples_seen"]), str(r["sample_digest"])) for r in done.payload.app["history"]]
    return digests, done.whole("model.")


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def split_restart(base: Path, kills: list[dict[str, Any]], step_s: float) -> dict[str, float]:
    """torchrun / warm launcher, per failure (medians over the kills): detection, teardown and
    re-forming the group (the agent noticing, stopping the survivor, the rendezvous round: until
    the new workers start, one figure, not separable from the trainer's logs), process start
    (interpreter, imports, process group, data, model), state transfer (reading the checkpoint)
    and recomputation (steps since the last checkpoint, at the fault-free step time)."""
    starts = events(base, "start")
    relaunch, startup, load = [], [], []
    for kill in kills:
        new = [e for e in starts if e.get("process_started", 0) > kill["time"]]
        if not new:
            continue
        first = min(e["process_started"] for e in new)
        batch = [e for e in new if e["process_started"] - first < 5]
        relaunch.append(first - kill["time"])
        phases = [e["startup_s"] for e in batch]
        startup.append(max(sum(v for k, v in p.items() if k != "checkpoint_load") for p in phases))
        load.append(max(p.get("checkpoint_load", 0.0) for p in phases))
    done = events(base, "done")
    recomputed = float(done[-1]["recomputed_steps"]) / max(len(kills), 1) if done else 0.0
    return {
        "detection_teardown_reform_s": statistics.median(relaunch) if relaunch else float("nan"),
        "process_start_s": statistics.median(startup) if startup else float("nan"),
        "state_transfer_s": statistics.median(load) if load else float("nan"),
        "recomputation_s": recomputed * step_s,
    }


def replica_log(group: int, size: int) -> str:
    """A replica's event log: one per replica, or one per worker of a group (its rank 0's here)."""
    return f"replica_{group}.jsonl" if size == 1 else f"replica_{group}.rank0.jsonl"


def split_quorum(base: Path, kills: list[dict[str, Any]], pids: dict[int, int], size: int = 1) -> dict[str, float]:
    """Quorum mode, per failure, from the survivor's log: detection (kill -> its attempt
    discarded: a dead peer's closed socket fails the collective at once), teardown (none: no
    process stops), re-forming (the survivor's first commit after the kill: that quorum's own
    time), state transfer (the restarted replica healing from the survivor: the survivor's wait
    for it, in the quorum it joined) and recomputation (the discarded attempt's work).

    Two shapes of recovery: the survivor goes on alone first (the Lighthouse drops the dead
    worker after its heartbeat timeout, 400 ms) and the replacement joins a later quorum; or the
    replacement asks before that (a warm fork: ~0.15 s after the kill here) and is already in
    the redo's quorum, whose time then includes its heal: re-forming and state transfer are one
    quorum, booked as re-forming (state transfer 0). ``in_redo_share``: how many kills took the
    second shape. ``size``: workers per replica group (a quorum's world counts workers: one group
    alone is ``size``, both ``2 * size``)."""
    detect, reform, redo, transfer, heal, in_redo = [], [], [], [], [], []
    discarded, changed, healed = events(base, "discarded"), events(base, "quorum_changed"), events(base, "healed")
    for kill in kills:
        victim = pids.get(kill["pid"])
        if victim is None:
            continue
        survivor_file = replica_log(1 - victim, size)
        alone, both = size, 2 * size
        lost = [e for e in discarded if e["_file"] == survivor_file and e["_t"] > kill["time"] - 5]
        after = [e for e in changed if e["_file"] == survivor_file and e["_t"] > kill["time"]]
        if lost:
            detect.append(max(0.0, lost[0]["_t"] - kill["time"]))
            redo.append(lost[0].get("attempt_s", 0.0))
        if after:
            first = after[0]
            reform.append(first.get("quorum_s", 0.0))
            joined_at_once = first["world"] == both
            in_redo.append(1.0 if joined_at_once else 0.0)
            if joined_at_once:
                transfer.append(0.0)
            else:
                rejoin = [e for e in after[1:] if e["world"] == both and e.get("previous_world") == alone]
                if rejoin:
                    transfer.append(rejoin[0].get("quorum_s", 0.0))
        # The replacement's own time for the fetch and load of the peer's state.
        fetched = [e for e in healed if e["_file"] == replica_log(victim, size) and e["_t"] > kill["time"]]
        if fetched:
            heal.append(float(fetched[0].get("seconds", 0.0)))
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {
        "detection_s": med(detect),
        "teardown_s": 0.0,
        "reform_s": med(reform),
        "state_transfer_s": med(transfer),
        "recomputation_s": med(redo),
        "heal_s": med(heal),
        "in_redo_share": statistics.mean(in_redo) if in_redo else float("nan"),
    }


def fault_free_step_s(epochs_s: list[float]) -> float:
    """A step's time: the median epoch after the first (warm-up), over the epoch's steps."""
    times = epochs_s[1:] or epochs_s
    steps = 4096 // 128
    return statistics.median(times) / steps


NODE_FAULTS = ("kill", "stop", "stop-worker")
GROUP_RANK_1 = re.compile(r"replica group \d+: worker pid (\d+) \(restart 0\), group rank 1")


def node_loss(fault: str, size: int = 1) -> float:
    """Quorum mode, two agents (one replica of ``size`` workers each); node 1's whole session
    SIGKILLed (``kill``) or SIGSTOPped (``stop``: a frozen node, or a frozen group), or only its
    group rank 1 SIGSTOPped (``stop-worker``: its group's watch must take the group out) ->
    node 0's first commit alone, seconds (from node 0's log: its group's rank 0)."""
    assert fault in NODE_FAULTS and (size > 1 or fault != "stop-worker"), (fault, size)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        env = base_env({SECRET_VAR: secrets.token_hex(16)})  # several agents: one job secret for all
        port = free_port()
        nodes = []
        worker: list[str] = []  # the frozen worker's pid (stop-worker), thawed on every way out
        try:
            for rank in (0, 1):
                where = ["--lighthouse-port", str(port)] if rank == 0 else ["--lighthouse", f"http://127.0.0.1:{port}"]
                command = [
                    *LAUNCH["quorum"][:3], "--nnodes", "2", "--node-rank", str(rank), "--run-id", f"bench-{port}",
                    "--nproc-per-node", "1", "--procs-per-replica", str(size), *where,
                    "-m", "elastic_train", *train_flags(6, base),
                ]  # fmt: skip
                with (base / f"node{rank}.out").open("wb") as sink:
                    nodes.append(
                        subprocess.Popen(
                            command, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
                time.sleep(0 if rank else 3)
            deadline = time.monotonic() + 180
            mine = replica_log(0, size)
            while not [e for e in events(base, "committed") if e["world"] == 2 * size and e["_file"] == mine]:
                ended = [(i, n.returncode) for i, n in enumerate(nodes) if n.poll() is not None]
                if ended or time.monotonic() > deadline:
                    tail = (base / f"node{ended[0][0] if ended else 0}.out").read_text()[-2000:]
                    raise RuntimeError(f"no commit at world 2 in {base} (agents ended: {ended}):\n{tail}")
                time.sleep(0.1)
            time.sleep(2)
            worker = GROUP_RANK_1.findall((base / "node1.out").read_text()) if fault == "stop-worker" else []
            lost_at = time.time()
            if worker:
                os.kill(int(worker[0]), signal.SIGSTOP)
            elif fault == "stop-worker":
                raise RuntimeError(f"node 1 printed no group rank 1's pid:\n{(base / 'node1.out').read_text()[-2000:]}")
            else:
                os.killpg(nodes[1].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            while True:
                shrink = [
                    e
                    for e in events(base, "quorum_changed")
                    if e["_t"] > lost_at and e["world"] == size and e["_file"] == mine
                ]
                if shrink:
                    return float(shrink[0]["_t"] - lost_at)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node 0 never went on alone in {base}")
                time.sleep(0.1)
        finally:
            for node in nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGCONT)
            for pid in worker:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGCONT)
            kill_tagged(env[TOKEN_VAR])


def paired(ff_walls: list[float], soak_walls: list[float], kills: list[int], best_ff: float) -> dict[str, Any]:
    """Each soak against the fault-free run of its own round (run just before it): the machine's
    drift between rounds (fault-free walls here varied by 20% in one loaded hour) cancels. A
    mode's goodput against the fastest mode's fault-free wall also charges its own overhead:
    the round's goodput times fastest median fault-free / own median fault-free. A round whose
    soak saw no kill has no time lost per failure (it is left out of that median)."""
    own = statistics.median(ff_walls)
    vs_own = [f / w for f, w in zip(ff_walls, soak_walls, strict=True)]
    lost = [(w - f) / k for f, w, k in zip(ff_walls, soak_walls, kills, strict=True) if k > 0]
    runs = [g * best_ff / own for g in vs_own]
    return {
        "fault_free_wall_s": own,  # the median of the fault-free runs
        "fault_free_walls_s": ff_walls,  # round by round, paired with soak_walls_s
        "soak_walls_s": soak_walls,
        "kills": kills,
        "goodput": statistics.median(runs),
        "goodput_runs": runs,
        "goodput_vs_own": statistics.median(vs_own),
        "lost_per_failure_s": statistics.median(lost) if lost else float("nan"),
        "lost_per_failure_runs_s": lost,
        # A soak faster than its own round's fault-free run: noise exceeded what the kills cost.
        "noisy_rounds": sum(w < f for f, w in zip(ff_walls, soak_walls, strict=True)),
    }


def summarise(
    mode: str,
    ff: dict[str, Any],
    ff_runs: list[dict[str, Any]],
    soaks: list[dict[str, Any]],
    best_ff: float,
) -> dict[str, Any]:
    ff_walls = [r["wall_s"] for r in ff_runs]
    step_s = fault_free_step_s(ff["epochs_s"])
    splits = []
    for s in soaks:
        if mode.startswith("quorum"):
            pids = {int(pid): int(g) for g, pid in WORKER.findall((s["base"] / "launch.out").read_text())}
            size = GROUP_SIZE if mode == "quorum-groups" else 1
            splits.append(split_quorum(s["base"], s["kills"], pids, size))
        else:
            splits.append(split_restart(s["base"], s["kills"], step_s))
    # A share, not seconds: kept out of the split (whose values are all seconds), over every kill.
    shares = [x for x in (sp.pop("in_redo_share") for sp in splits if "in_redo_share" in sp) if x == x]  # not NaN
    split = {k: statistics.median(sp[k] for sp in splits) for k in splits[0]} if splits else {}
    extra = {"replacement_in_redo_share": statistics.mean(shares)} if shares else {}
    return {
        **paired(ff_walls, [s["wall_s"] for s in soaks], [len(s["kills"]) for s in soaks], best_ff),
        "split_s": split,
        **extra,
        "fault_free_step_s": step_s,
        # Where a fault-free wall goes: the epochs' training time, and the rest (start-up, exit).
        "fault_free_epoch_s": statistics.median(e for r in ff_runs for e in r["epochs_s"]),
        "fault_free_outside_s": statistics.median(r["wall_s"] - sum(r["epochs_s"]) for r in ff_runs),
        "state_mb": ff.get("state_mb"),
        # Against the same mode's fault-free run: the same samples every epoch (digests), and
        # how far the final weights are (0.0: bitwise equal).
        "exactly_once": all(sk["digests"] == ff["digests"] for sk in soaks),
        "max_weight_diff": max(max_abs_diff(sk["weights"], ff["weights"]) for sk in soaks),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soaks", type=int, default=3)
    parser.add_argument("--mtbf", type=float, default=30.0)
    parser.add_argument(
        "--spacing", choices=("fixed", "random"), default="fixed", help="jobs/chaos.py: every MTBF, or exponential gaps"
    )
    parser.add_argument("--epochs", type=int, default=12, help="~9 s each on 2 CPU workers")
    parser.add_argument("--node-loss-repeats", type=int, default=3)
    parser.add_argument(
        "--node-loss-size", type=int, default=1, help="workers per replica group in the node-loss runs (2: groups)"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--train-flags", default="", help="more trainer flags for every run (one string)")
    args = parser.parse_args(argv)
    EXTRA_FLAGS[:] = shlex.split(args.train_flags)
    modes = [m for m in args.modes.split(",") if m]
    keep: list[tempfile.TemporaryDirectory[str]] = []

    def fresh() -> Path:
        keep.append(tempfile.TemporaryDirectory())
        return Path(keep[-1].name)

    try:
        with contextlib.ExitStack() as stack:
            if "quorum-etcd" in modes:
                from elastic_train.testing.etcd import etcd_cluster

                members = stack.enter_context(etcd_cluster(fresh()))
                LAUNCH["quorum-etcd"] += ["--lighthouse-etcd", ",".join(m.client for m in members)]
            result = measure(args, modes, fresh)
    finally:
        for tmp in keep:
            tmp.cleanup()
    report(result, args.json)


def measure(args: argparse.Namespace, modes: list[str], fresh: Any) -> dict[str, Any]:
    """The rounds (fault-free run and soak of each mode), and quorum mode's node loss."""
    # Each round runs every mode once without and once with failures, the order rotating: a
    # fault-free reference from one quiet moment and soaks from a busier one would measure
    # the machine, not the recovery (a first version did: soaks "faster" than fault-free).
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    soaks: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i in range(args.soaks):
        for m in modes[i % len(modes) :] + modes[: i % len(modes)]:
            runs[m].append(run(m, fresh(), args.epochs, None, 0))
            soaks[m].append(run(m, fresh(), args.epochs, args.mtbf, seed=100 + i, spacing=args.spacing))
            f, s = runs[m][-1], soaks[m][-1]
            print(f"{m}: round {i + 1}: fault-free {f['wall_s']:.1f} s, soak {s['wall_s']:.1f} s, "
                  f"{len(s['kills'])} kills", flush=True)  # fmt: skip
    ff = {m: {**runs[m][0], "wall_s": statistics.median(r["wall_s"] for r in runs[m])} for m in modes}
    best = min(ff[m]["wall_s"] for m in modes)
    result: dict[str, Any] = {
        "modes": {m: summarise(m, ff[m], runs[m], soaks[m], best) for m in modes},
        "soaks": args.soaks,
        "mtbf_s": args.mtbf,
        "spacing": args.spacing,
        "epochs": args.epochs,
        "train_flags": EXTRA_FLAGS,
        "reference": min(modes, key=lambda m: ff[m]["wall_s"]),
        "load_1min_max": max(r["load_1min"] for m in modes for r in runs[m] + soaks[m]),
    }
    if ("quorum" in modes or "quorum-groups" in modes) and args.node_loss_repeats:
        size = args.node_loss_size
        faults = NODE_FAULTS if size > 1 else NODE_FAULTS[:2]
        timed = {f.replace("-", "_"): [node_loss(f, size) for _ in range(args.node_loss_repeats)] for f in faults}
        result["quorum_node_loss_s"] = {**timed, "size": size}
    return result


def report(result: dict[str, Any], out: Path | None) -> None:
    for m, r in result["modes"].items():
        split = ", ".join(f"{k} {v:.2f}" for k, v in r["split_s"].items())
        print(
            f"{m}: goodput {r['goodput']:.3f} (vs its own fault-free run {r['goodput_vs_own']:.3f}), "
            f"lost per failure {r['lost_per_failure_s']:.2f} s [{split}]; exactly once: {r['exactly_once']}, "
            f"max weight difference from the fault-free run {r['max_weight_diff']:.2e}"
        )
    if "quorum_node_loss_s" in result:
        nl = result["quorum_node_loss_s"]
        killed, frozen = statistics.median(nl["kill"]), statistics.median(nl["stop"])
        worker = nl.get("stop_worker")
        alone = f", one worker of the group frozen {statistics.median(worker):.2f} s" if worker else ""
        print(f"quorum node loss -> first step: killed {killed:.2f} s, frozen {frozen:.2f} s{alone}")
    result["load_average"] = list(os.getloadavg())
    if out:
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
