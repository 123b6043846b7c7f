"""``make bench``: run every benchmark in one go and rewrite docs/benchmarks.md from the results.

    python benchmarks/suite.py [--quick] [--only NAME ...] [--out docs/benchmarks.md] [--results benchmarks/results]
    python benchmarks/suite.py --render-only   # rewrite the page from the results already there

Each benchmark writes its JSON under ``--results``; the document is rendered from those files
and a description of this machine, so the figures in the docs are always those of the last run.
``--quick`` shrinks every benchmark (fewer repeats, a shorter soak) to check the pipeline; its
figures are labelled as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

LARGE_MODEL = "--model torchvision:alexnet --image-size 64"
FULL = {
    # 21 alternated pairs (~40 s each): as many as fit in ~15 minutes on 2 cores; whether their
    # 95% interval is narrower than the 3% it must resolve is reported either way.
    "overhead": ["--repeats", "21", "--epochs", "4", "--steps", "12"],
    "checkpoint": ["--repeats", "5", "--mb", "1152", "--saves", "5", "--every", "12"],  # a 1.2 GB state
    # 6 interleaved rounds a measure (the fewest with a 95% interval of the median): ~12 minutes.
    "fsdp": ["--rounds", "12", "--steps", "8", "--save-mb", "384", "--memory-mb", "1152"],
    # Recovery times only: goodput under failures is goodput.py's, for every mode alike.
    "recovery": ["--repeats", "3", "--soak", "0", "--launcher", "torchrun"],
    "recovery-warm": ["--repeats", "3", "--soak", "0", "--launcher", "warm"],
    # Per mode 3 rounds of a fault-free run and a soak with a kill every 30 s (~35 minutes). 12
    # epochs: ~105 s a run on a quiet machine, so 3 kills a soak; with 6 a soak saw one kill and
    # a run's own noise (~1 s) was the whole per-failure figure.
    "goodput": ["--soaks", "3", "--mtbf", "30", "--epochs", "12", "--node-loss-repeats", "3"],
    # The same job with a sharded model (FSDP2) beside replicated torchrun, in rounds of their own.
    "goodput-fsdp": "--modes torchrun,fsdp --soaks 3 --mtbf 30 --epochs 12 --node-loss-repeats 0".split(),
    # A model whose heal moves real state (issue 20): AlexNet, 57 M parameters, 228 MB of weights and
    # twice that of AdamW moments; ~1.1 s a step on 2 cores, so 3 epochs (~170 s a run) and 2 rounds.
    "goodput-large": [
        *"--modes torchrun,quorum --soaks 2 --mtbf 30 --spacing random --epochs 3 --node-loss-repeats 0".split(),
        "--train-flags",
        LARGE_MODEL,
    ],
}
FULL["heal"] = ["--mb", "685", "--repeats", "3"]  # the heal's transfer alone, for goodput-large's state
# Quorum mode with and without --lighthouse-etcd (the seat and the line record), in rounds of
# their own: what claiming every step in etcd costs (~13 minutes; 6 epochs, ~55 s a run).
FULL["goodput-line"] = "--modes quorum,quorum-etcd --soaks 3 --mtbf 30 --epochs 6 --node-loss-repeats 0".split()
# Replica groups of 2 workers (DDP inside, the quorum across) beside torchrun with the same 4
# workers, in rounds of their own, then a group SIGKILLed, a group frozen and one worker of a group
# frozen (~25 minutes).
FULL["goodput-groups"] = [
    *"--modes torchrun-4,quorum-groups --soaks 3 --mtbf 30 --epochs 6".split(),
    *"--node-loss-repeats 3 --node-loss-size 2".split(),
]
# Rendered when their results exist (a section added after the others were last measured).
OPTIONAL = {"goodput-fsdp", "goodput-large", "heal", "goodput-line", "goodput-groups"}
QUICK = {
    "overhead": ["--repeats", "1", "--epochs", "2", "--steps", "6"],
    "checkpoint": ["--repeats", "1", "--mb", "40", "--saves", "1", "--every", "8"],
    "fsdp": ["--quick"],
    "recovery": ["--repeats", "1", "--soak", "0", "--launcher", "torchrun"],
    "recovery-warm": ["--repeats", "1", "--soak", "0", "--launcher", "warm"],
    "goodput": ["--soaks", "1", "--mtbf", "10", "--epochs", "2", "--node-loss-repeats", "1"],
    "goodput-fsdp": "--modes torchrun,fsdp --soaks 1 --mtbf 10 --epochs 2 --node-loss-repeats 0".split(),
    "goodput-large": [
        *"--modes torchrun,quorum --soaks 1 --mtbf 10 --spacing random --epochs 1 --node-loss-repeats 0".split(),
        "--train-flags",
        LARGE_MODEL + " --max-steps-per-epoch 8",
    ],
    "heal": ["--mb", "50", "--repeats", "1"],
    "goodput-line": "--modes quorum,quorum-etcd --soaks 1 --mtbf 10 --epochs 2 --node-loss-repeats 0".split(),
    "goodput-groups": [
        # mtbf 30, not 10: a restart of 4 workers on 2 cores takes ~20 s, so torchrun would never finish.
        *"--modes torchrun-4,quorum-groups --soaks 1 --mtbf 30 --epochs 2".split(),
        *"--node-loss-repeats 1 --node-loss-size 2".split(),
    ],
}


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{mem_kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        mem = "unknown memory"
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {mem}, {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


def run_benchmark(name: str, args: list[str], results: Path) -> dict[str, Any]:
    out = results / f"{name}.json"
    print(f"== benchmarks/{name}.py {' '.join(args)}", flush=True)
    started = time.monotonic()
    script = ROOT / "benchmarks" / f"{name.split('-')[0]}.py"  # recovery-warm: recovery.py --launcher warm
    subprocess.run([sys.executable, str(script), *args, "--json", str(out)], check=True)
    print(f"== {name}: {time.monotonic() - started:.0f} s", flush=True)
    data: dict[str, Any] = json.loads(out.read_text())
    # Where and when, so that a page rendered later from mixed results says so.
    data["measured_on"] = machine()
    data["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out.write_text(json.dumps(data, indent=2) + "\n")
    return data


def measured_apart(results: dict[str, dict[str, Any]]) -> str:
    """A line per result measured on another machine or run than the page's (``measured_on``)."""
    page = results.get("machine", {}).get("machine")
    lines = [
        f"\n- `{name}` measured {data['measured_at']} on {data['measured_on']}."
        for name, data in results.items()
        if isinstance(data, dict) and data.get("measured_on") and data["measured_on"] != page
    ]
    return "".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def load_note(data: dict[str, Any]) -> str:
    if "load_average" not in data:
        return ""
    one, five, fifteen = data["load_average"]
    return (
        f"Load average when it ended (1, 5, 15 min): {one:.1f}, {five:.1f}, {fifteen:.1f} on 2 cores; the "
        "benchmark alone keeps about 2 busy: well above that, other work shared the machine."
    )


def failed_note(data: dict[str, Any]) -> str:
    """Runs that crashed and were launched again (overhead.py), each with its last stderr lines."""
    failed = data.get("failed_runs") or []
    if not failed:
        return ""
    return f"{len(failed)} run(s) exited non-zero and were run again: " + "; ".join(f"`{f}`" for f in failed) + "."


def overhead_section(o: dict[str, Any]) -> str:
    """The training-overhead section, from overhead.py's JSON."""
    pairs = ", ".join(f"{x:.3f}" for x in o["pair_ratios"])
    interval = o.get("interval")
    if interval:
        low, high = interval
        shown = f"[{low:.3f}, {high:.3f}], width **{high - low:.3f}**"
        how = f"order statistics of the {o['repeats']} paired ratios, coverage {o['interval_coverage']:.3f}"
        resolved = verdict(bool(o["resolved"]))
        side = "above" if low >= 0.97 else "below"
        meaning = f"The interval's lower end, {low:.3f}, is {side} the 0.97 target. " + (
            "The interval is narrower than the 3% it must resolve."
            if o["resolved"]
            else "The interval is wider than the 3% it must resolve (**not met**): with this machine's "
            f"run-to-run noise, {o['repeats']} pairs cannot tell an overhead of 3% from none; more pairs "
            "or a quieter machine would."
        )
    else:
        shown, how, resolved = "none", "fewer than 6 pairs: no 95% interval exists", "**not met**"
        meaning = "Too few pairs for an interval: these figures do not resolve 3%."
    rows = "\n".join(
        [
            row(
                "training throughput, median of the paired ratios",
                f"{o['elastic_train_img_s']:.0f} img/s",
                f"{o['bare_img_s']:.0f} img/s",
                f"**{o['ratio']:.3f}**",
                ">= 0.97",
                verdict(o["ratio"] >= 0.97),
            ),
            row(f"95% confidence interval of that median ({how})", "", "", shown, "width < 0.03", resolved),
        ]
    )
    return f"""## Training overhead: `benchmarks/overhead.py`

elastic-train vs the guide's bare DDP loop (`benchmarks/bare_ddp.py`: DistributedSampler,
DataLoader, DDP, AdamW, nothing else), same ViT (0.55 M parameters), data, global batch 128 and
world size 2 under `torchrun --standalone`; elastic-train with checkpointing on (async epoch-end
saves). Method: {o.get("method", "median of alternated pairs")}.

| measure | elastic-train | bare DDP | ratio | target | |
| --- | --- | --- | --- | --- | --- |
{rows}

The paired ratios, in run order: {pairs}. {meaning} {load_note(o)} {failed_note(o)}

The per-step extras are a few device-side sums (no host sync), an index digest on the CPU, and
the step-boundary agreement (stop requested? save due? shards durable?): a MAX all-reduce of
three integers on a gloo group of its own, posted without waiting and collected at the next
boundary, so it overlaps the step; it is synchronous only while an async save is in flight."""


def checkpoint_section(c: dict[str, Any]) -> str:
    """The checkpoint section, from checkpoint.py's JSON: each figure beside its method."""
    save, load, stall = c["save"], c["load"], c["stall"]
    cold, warm = load["cold"], load["warm"]
    rows = "\n".join(
        [
            row(
                f"save bandwidth: {save['method']}",
                f"{save['ours_mb_s']:.0f} MB/s",
                f"{save['dd_mb_s']:.0f} MB/s",
                f"**{save['ratio']:.2f}**",
                ">= 0.7",
                verdict(save["ratio"] >= 0.7),
            ),
            row(
                f"load, cold page cache: {load['method']}",
                f"{cold['ours_s']:.3f} s",
                f"{cold['baseline_s']:.3f} s",
                f"**{cold['ratio']:.2f}**",
                "<= 1.2",
                verdict(cold["ratio"] <= 1.2),
            ),
            row(
                "load, warm page cache: the same, each timed load after an untimed one of its kind",
                f"{warm['ours_s']:.3f} s",
                f"{warm['baseline_s']:.3f} s",
                f"**{warm['ratio']:.2f}**",
                "<= 1.2",
                verdict(warm["ratio"] <= 1.2),
            ),
            row(
                f"checkpoint stall, training time lost per async save / a synchronous save: {stall['method']}",
                f"{stall['lost_s']:.3f} s lost",
                f"{stall['sync_save_s']:.3f} s sync save",
                f"**{stall['ratio']:.3f}**",
                "<= 0.10",
                verdict(stall["ratio"] <= 0.10),
            ),
        ]
    )
    lost = ", ".join(f"{x:.3f}" for x in stall["lost_per_save_s"])
    quartiles = stall.get("step_quartiles_s")
    spread = f" (quartiles {', '.join(f'{q:.3f}' for q in quartiles)} s)" if quartiles else ""
    return f"""## Checkpoints: `benchmarks/checkpoint.py`

A {c["state_mb"]:.0f} MB training state (an MLP plus AdamW moments: parameters + 2 moments, fp32),
{c["ranks"]} gloo ranks on this machine's one disk; save and load figures are medians of
{c["repeats"]} repeats (ratios: the median of the paired ratios), the stall the median of
{stall["saves"]} saves.

| measure | elastic-train | baseline | ratio | target | |
| --- | --- | --- | --- | --- | --- |
{rows}

What stands behind the numbers:

- Stall: a training step takes {stall["step_s"]:.3f} s with no save in flight{spread} and
  {stall["window_step_s"]:.3f} s on average inside a save's window (median window
  {stall["window_steps"]:.0f} steps, {stall["window_s"]:.2f} s). Lost per save: {lost} s; of the
  median, {stall["blocked_s"]:.3f} s is waiting (the optimizer step's wait for the staging copy, the
  save's start and commit at the boundary), the rest is slower steps: the writer thread's copy,
  hashing and writes run on the cores training uses. A synchronous `torch.save` + fsync
  of the whole state on one rank takes {stall["torch_save_s"]:.3f} s.
- Load: safetensors' `load_file` maps the files: the optimizer's moments, which
  `load_state_dict` does not copy, are read from disk at their first use, after its timer stops,
  while our load reads and hashes every byte before trusting it. Against
  `load_file(backend="pread")`, which reads every byte too: {cold["eager_s"]:.3f} s cold (ratio
  {cold["eager_ratio"]:.2f}), {warm["eager_s"]:.3f} s warm (ratio {warm["eager_ratio"]:.2f}).
  sha256 is in the manifest too and checked by `python -m elastic_train.ckpt verify`, not on every load.
- Cold cache: {load["cache_drop"]} empties this (virtual) machine's page cache; the host under
  its virtual disk may still cache, so a cold read here can be faster than on a real cold disk.
- {load_note(c)}"""


def _rounds_cells(x: dict[str, Any]) -> tuple[str, str]:
    """The spread (min, max) of a measure's paired ratios and the 95% interval of their median."""
    low, high = x["spread"]
    interval = x.get("interval")
    shown = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "none (< 6 rounds)"
    return f"{low:.3f} to {high:.3f}", shown


def fsdp_section(f: dict[str, Any] | None) -> str:
    """The FSDP2 section, from fsdp.py's JSON: throughput, sharded save and load against stock
    ``torch.distributed.checkpoint``, and the peak host memory of a sharded save."""
    title = "## FSDP2: `benchmarks/fsdp.py`"
    if not f:
        return f"{title}\n\nNot run yet: `python benchmarks/fsdp.py --json benchmarks/results/fsdp.json`."
    t, sv, ld, m = f["throughput"], f["save"], f["load"], f["memory"]
    mib = 2**20

    def measure(name: str, ours: str, base: str, x: dict[str, Any], target: str) -> str:
        spread, interval = _rounds_cells(x)
        return row(name, ours, base, f"**{x['ratio']:.3f}**", spread, interval, target, verdict(bool(x["met"])))

    rows = [
        measure(
            "training throughput, `Trainer` / bare FSDP2 loop",
            f"{t['ours_img_s']:.1f} img/s",
            f"{t['bare_img_s']:.1f} img/s",
            t,
            ">= 0.97",
        ),
        measure(
            f"save bandwidth ({sv['state_bytes'] / 1e6:.0f} MB state), ours / `dcp.save`",
            f"{sv['ours_mb_s']:.0f} MB/s",
            f"{sv['dcp_mb_s']:.0f} MB/s",
            sv,
            ">= 1.0",
        ),
    ]
    for cache in ("cold", "warm"):
        x = ld[cache]
        rows.append(
            measure(
                f"load time, {cache} page cache, ours / DCP",
                f"{x['ours_s']:.3f} s",
                f"{x['dcp_s']:.3f} s",
                x,
                "<= 1.0",
            )
        )
    for mode in ("sync", "async"):
        x = m[mode]
        rows.append(
            measure(
                f"peak host memory rise per rank, {mode} save of {m['state_bytes'] / 1e9:.2f} GB, "
                "/ (state / ranks + 16 MiB)",
                f"{x['rise_bytes'] / mib:.0f} MiB",
                f"{m['bound_bytes'] / mib:.0f} MiB bound",
                x,
                "<= 1.0",
            )
        )
    cold, warm = ld["cold"], ld["warm"]
    measures = {
        "throughput": t,
        "save bandwidth": sv,
        "cold load": cold,
        "warm load": warm,
        "sync-save memory": m["sync"],
        "async-save memory": m["async"],
    }
    open_ = [
        f"{name} [{x['interval'][0]:.3f}, {x['interval'][1]:.3f}]"
        for name, x in measures.items()
        if x.get("interval") and x["interval"][0] <= x["target"] <= x["interval"][1]
    ]
    resolved = (
        "Every 95% interval lies on one side of its target: each verdict holds at that confidence."
        if not open_
        else "These 95% intervals contain their target, so their verdicts are not resolved at that confidence "
        f"(the run-to-run noise is larger than the distance to the target): {'; '.join(open_)}."
    )
    if not any(x.get("interval") for x in measures.values()):
        resolved = "Too few rounds for 95% intervals: no verdict here is resolved."
    label = " QUICK sizes: a pipeline check, not figures to quote." if f.get("quick") else ""
    where = f" Measured on {f['machine']}." if f.get("machine") else ""
    return f"""{title}

FSDP2 (`--parallel fsdp`) at {f["ranks"]} gloo ranks on the CPU, each figure against stock PyTorch
measured in the same run: {f["rounds"]} rounds a measure, ours and the baseline alternating in
order from round to round; the ratio is the median of the paired ratios, with their spread and
the 95% distribution-free interval of that median (order statistics, binomial coverage; none
below 6 rounds).{where}{label}

| measure | elastic-train | stock PyTorch | ratio | spread | 95% interval | target | |
| --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

{resolved}

How each was measured, and what stands behind it:

- Throughput: {t["method"]}. Per round, elastic-train / bare: {", ".join(f"{x:.3f}" for x in t["ratios"])}.
- Save: {sv["method"]}. On disk: ours {sv["ours_disk_bytes"] / 1e6:.0f} MB, DCP
  {sv["dcp_disk_bytes"] / 1e6:.0f} MB. Ours computes two checksums over every byte it writes (sha256 for
  `ckpt verify`, xxh3-128 for every load), on the same core as the write; DCP's default writer computes none.
- Load: {ld["method"]}. DCP's `get_state_dict` of a fresh optimizer runs one optimizer step to create
  the state it loads into ({cold["dcp_prepare_s"]:.3f} s cold, {warm["dcp_prepare_s"]:.3f} s warm): a resume
  into a fresh optimizer needs it, so the table counts it. Against `dcp.load` + `set_state_dict` alone
  the ratio is {cold["ratio_without_prepare"]:.3f} cold and {warm["ratio_without_prepare"]:.3f} warm
  ({verdict(max(cold["ratio_without_prepare"], warm["ratio_without_prepare"]) <= 1.0)} against 1.0). Ours
  also verifies every file's size and xxh3 before using it; DCP reads without a check.
- Peak memory: {m["method"]}. A synchronous save writes each rank's pieces straight from the
  parameters and moments (no copy); an asynchronous one first stages a CPU copy of the rank's
  shard (`Checkpointer._stage`), which it keeps for the next save ({m["async"]["held_bytes"] / mib:.0f} MiB
  still resident after the commit). Page-cache pages of the written files are not in a process's
  resident set.
- {load_note(f)}"""


def render(results: dict[str, dict[str, Any]], quick: bool, when: str) -> str:
    o, c, r = results["overhead"], results["checkpoint"], results["recovery"]
    w = results["recovery-warm"]
    recovery_rows = "\n".join(
        [
            row(
                "worker SIGKILL -> first step after resume",
                f"{r['kill_to_step_s']:.1f} s",
                f"{w['kill_to_step_s']:.1f} s",
                "",
                "",
            ),
            row(
                "node (agent + worker) SIGKILL -> first step at world size 1",
                f"{r['node_loss_to_step_s']:.1f} s",
                f"{w['node_loss_to_step_s']:.1f} s",
                "< 20 s",
                verdict(max(r["node_loss_to_step_s"], w["node_loss_to_step_s"]) < 20),
            ),
            row(
                "new node started -> first step at world size 2",
                f"{r['join_to_step_s']:.1f} s",
                f"{w['join_to_step_s']:.1f} s",
                "< 20 s",
                verdict(max(r["join_to_step_s"], w["join_to_step_s"]) < 20),
            ),
        ]
    )
    breakdown_rows = "\n".join(
        row(
            name.replace("_", " "),
            f"{r['kill_breakdown_s'][name]:.2f} s",
            f"{w['kill_breakdown_s'].get(name, 0):.2f} s",
        )
        for name in r["kill_breakdown_s"]
    )
    label = "QUICK sizes: a pipeline check, not figures to quote" if quick else "full sizes"
    gpu_result = gpu_table(results.get("gpu_check"))
    goodput = goodput_section(results["goodput"])
    if "goodput-fsdp" in results:
        goodput += "\n\n" + goodput_fsdp_section(results["goodput-fsdp"])
    if "goodput-large" in results:
        goodput += "\n\n" + goodput_large_section(results["goodput-large"], results.get("heal"))
    if "goodput-line" in results:
        goodput += "\n\n" + goodput_line_section(results["goodput-line"])
    if "goodput-groups" in results:
        goodput += "\n\n" + goodput_groups_section(results["goodput-groups"])
    if "heal" in results:
        goodput += "\n\n" + heal_section(results["heal"])
    return f"""# Benchmarks

Each benchmark is a script that measures elastic-train and its baseline in the same run, on the
same machine, and prints ratios (medians of several paired runs, because these machines are
noisy). This page is rewritten from their JSON results (`benchmarks/results/`) by

```bash
make bench
```

(`benchmarks/suite.py`, about 145 minutes on 2 cores; run it on a quiet machine); nothing below
is typed by hand but the GPU check's notes (what was measured beside its run, by whoever ran it).

- Written {when} from each benchmark's latest results ({label}).
- Machine: {results.get("machine", {}).get("machine") or machine()}.{measured_apart(results)}

{overhead_section(o)}

{checkpoint_section(c)}

{fsdp_section(results.get("fsdp"))}

## Recovery: `benchmarks/recovery.py`

Two agents on loopback (one worker each, 2 CPU processes in all), the standalone rendezvous
store, the settings of `jobs/elastic-agent.sh`; times from the trainer's own event logs;
medians of {r["repeats"]} runs. Two launchers: `torchrun`, and the warm launcher
(`python -m elastic_train.launch`, `ET_LAUNCHER=warm`: torchrun's agent, workers forked from a
process that has imported torch, torchvision and the trainer already).

| measure | torchrun | warm launcher | target | |
| --- | --- | --- | --- | --- |
{recovery_rows}

Where the time of one worker restart goes (worker SIGKILL, medians), from the `start` event of
each restarted worker:

| phase | torchrun | warm launcher |
| --- | --- | --- |
{breakdown_rows}

"until relaunch" is the agent noticing the dead worker, stopping the survivor and the new
rendezvous round; "interpreter and imports" is a fresh Python importing torch and torchvision
(two processes at once on two cores) for torchrun, a `fork` for the warm launcher; "data"
builds the in-memory dataset; "until first step" builds the model, wraps it in DDP and runs the
first step. A torchrun restart spends most of a failure's cost on process start-up, which is
what the warm launcher removes; what remains is the agent's detection and rendezvous, the data
and model set-up and the steps since the last checkpoint. Quorum mode does not restart the
survivors at all: the next section compares the three like for like.

{goodput}

## GPU check: `benchmarks/gpu_check.py`

The CUDA + NCCL + AMP path, on a machine with NVIDIA GPUs (about 4 minutes on one H200; the
two-GPU checks add theirs):

```bash
make gpu-check
```

It prints a pass/fail table: NCCL with bf16 and with fp16 autocast (GradScaler) training to the
target accuracy on synthetic data; an async checkpoint of live CUDA tensors, taken while training
goes on, committed and byte-equal to the tensors at the snapshot; a SIGKILLed worker restarted by
torchrun with `--deterministic`, ending bitwise equal to an uninterrupted run; throughput against
the bare DDP loop on the GPU (>= 0.90); FSDP2 with the bf16 policy killed and resumed bitwise,
then its checkpoint resumed by two CPU processes (a reshard 1 -> 2 and a change of device). With
two GPUs also: the same at two processes, rank 1 on cuda:1 saving and killed.

{gpu_result}
"""


def kill_spacing(g: dict[str, Any]) -> str:
    """How the soak's kills were spaced (results before ``--spacing`` existed were fixed)."""
    if g.get("spacing", "fixed") == "random":
        return f"at exponentially distributed gaps of mean {g['mtbf_s']:.0f} s"
    return f"every {g['mtbf_s']:.0f} s"


def goodput_load(g: dict[str, Any], workers: int = 2) -> str:
    """How busy the machine was: the highest 1-minute load average seen after a run."""
    if "load_1min_max" not in g:
        return ""
    return (
        f"The 1-minute load average after each run was at most {g['load_1min_max']:.1f} on 2 cores (the "
        f"benchmark alone keeps about {workers} busy: well above that, other work shared the machine)."
    )


def quorum_overhead(g: dict[str, Any]) -> str:
    """What quorum mode's own work costs without failures, against the fastest other mode: in
    each step (the epochs' time) and around them (start-up and exit)."""
    modes = g["modes"]
    others = [m for m in modes if m != "quorum"]
    if "quorum" not in modes or not others:
        return ""
    base = g["reference"] if g["reference"] != "quorum" else min(others, key=lambda m: modes[m]["fault_free_wall_s"])
    q, b = modes["quorum"], modes[base]
    own, ref = q["fault_free_wall_s"], b["fault_free_wall_s"]
    how = f"{own / ref - 1:.1%} slower" if own >= ref else f"{1 - own / ref:.1%} faster"
    text = f"Without failures quorum mode ran {how} than {base} ({own:.1f} s against {ref:.1f} s, medians)."
    if "fault_free_epoch_s" in q and "fault_free_epoch_s" in b:
        epoch = q["fault_free_epoch_s"] / b["fault_free_epoch_s"] - 1
        text += (
            f" Its epochs took {epoch:+.1%} against {base}'s ({q['fault_free_epoch_s']:.2f} s against "
            f"{b['fault_free_epoch_s']:.2f} s): every step also forms a quorum (a round trip to the Lighthouse), "
            "sums the exact metrics with every participant's position in a collective of its own, averages the "
            "gradients after the backward pass rather than during it, and votes on its commit. Outside the epochs "
            f"(start-up and exit) it spent {q['fault_free_outside_s']:.1f} s against {b['fault_free_outside_s']:.1f} s:"
            " its agent starts the Lighthouse without importing torch and forks warm workers."
        )
    else:  # results from before goodput.py recorded the epochs' times
        text += (
            " Every step also forms a quorum (a round trip to the Lighthouse), votes on its commit and sums the "
            "exact metrics in a collective of its own; these results predate the start-up and exit measured in "
            'docs/fault-tolerance.md ("Its start and exit").'
        )
    return text + " The second goodput row charges a mode's own overhead as lost time."


def pair_rows(g: dict[str, Any], modes: tuple[str, str]) -> list[str]:
    """The rows of a two-mode goodput table (each soak against its own round's fault-free run)."""
    r = [g["modes"][m] for m in modes]

    def cells(fmt: Any) -> list[str]:
        return [fmt(x) for x in r]

    def joined(x: dict[str, Any], fmt: Any, *keys: str) -> str:
        return ", ".join(fmt(*values) for values in zip(*(x[k] for k in keys), strict=True))

    return [
        row(
            f"**goodput**: the round's fault-free wall / soak wall, median of {g['soaks']} rounds",
            *cells(lambda x: f"**{x['goodput_vs_own']:.3f}**"),
        ),
        row(
            "the rounds' goodputs against their own fault-free runs",
            *cells(lambda x: joined(x, lambda f, w: f"{f / w:.3f}", "fault_free_walls_s", "soak_walls_s")),
        ),
        row(
            "fault-free walls, launch to exit, by round",
            *cells(lambda x: joined(x, lambda w: f"{w:.0f} s", "fault_free_walls_s")),
        ),
        row(
            "soak walls (kills)", *cells(lambda x: joined(x, lambda w, k: f"{w:.0f} s ({k})", "soak_walls_s", "kills"))
        ),
        row("**time lost per worker failure**, median", *cells(lambda x: f"**{x['lost_per_failure_s']:.2f} s**")),
        row(
            "every epoch's samples exactly once (sample digests equal the fault-free run's)",
            *cells(lambda x: "yes" if x["exactly_once"] else "**NO**"),
        ),
        row(
            "final weights: max abs difference from the fault-free run", *cells(lambda x: f"{x['max_weight_diff']:.1e}")
        ),
    ]


def goodput_fsdp_section(g: dict[str, Any]) -> str:
    """benchmarks/goodput.py --modes torchrun,fsdp: the restart-mode goodput of a sharded model."""
    rows = pair_rows(g, ("torchrun", "fsdp"))
    return f"""### The same with a sharded model: `goodput.py --modes torchrun,fsdp`

Restart mode with `--parallel fsdp` (FSDP2 over the 2 workers: parameters, gradients and optimizer
state sharded; each rank writes its own pieces of every checkpoint) beside the replicated
`torchrun` job, in {g["soaks"]} rounds of their own (a fault-free run and a soak of each, kills
{kill_spacing(g)}, {g["epochs"]} epochs). Same definitions as above. {goodput_load(g)}

| measure | torchrun (DDP) | torchrun, FSDP2 (`--parallel fsdp`) |
| --- | --- | --- |
{chr(10).join(rows)}"""


def goodput_line_section(g: dict[str, Any]) -> str:
    """benchmarks/goodput.py --modes quorum,quorum-etcd: what the seat and the line record cost."""
    q, e = (g["modes"][m] for m in ("quorum", "quorum-etcd"))
    slower = e["fault_free_wall_s"] / q["fault_free_wall_s"] - 1
    rows = [
        *pair_rows(g, ("quorum", "quorum-etcd")),
        row(
            "fault-free wall with the line record / without, medians",
            "",
            f"**{1 + slower:.3f}**",
        ),
    ]
    noisy = sum(x.get("noisy_rounds", 0) for x in (q, e))

    def spread(x: dict[str, Any]) -> str:
        return f"{min(x['fault_free_walls_s']):.0f}-{max(x['fault_free_walls_s']):.0f} s"

    noise = (
        f" In {noisy} of the {2 * g['soaks']} rounds a soak ran faster than its own fault-free run: the"
        " machine's noise exceeded what its kills cost, so the per-failure figures here do not resolve"
        " a difference between the two (the quorum section above has more kills a run)."
        if noisy
        else ""
    )
    return f"""### Quorum mode with its coordinator in etcd: `goodput.py --modes quorum,quorum-etcd`

Quorum mode as above, and the same job with `--lighthouse-etcd` (three etcd members on loopback,
started by the benchmark): the Lighthouse's seat is a lease there, and each step is claimed in
the line record before it commits (docs/fault-tolerance.md, "The line record"), in
{g["soaks"]} rounds of their own (a fault-free run and a soak of each, kills {kill_spacing(g)},
{g["epochs"]} epochs). Same definitions as above. {goodput_load(g)} Without failures the job with
the record ran {100 * slower:+.1f}% against the one without (fault-free medians; their walls
ranged {spread(q)} without the record and {spread(e)} with it).{noise}

| measure | quorum | quorum, `--lighthouse-etcd` |
| --- | --- | --- |
{chr(10).join(rows)}"""


def goodput_groups_section(g: dict[str, Any]) -> str:
    """benchmarks/goodput.py --modes torchrun-4,quorum-groups: replica groups of 2 workers (issue 20)."""
    t, q = (g["modes"][m] for m in ("torchrun-4", "quorum-groups"))
    split = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f} s" for k, v in q["split_s"].items())
    # A soak faster than its own round's fault-free run: the noise exceeded what the kills cost,
    # and neither a goodput nor a loss per kill is resolved, whichever side of its target it lands.
    noisy = q.get("noisy_rounds", 0)
    unresolved = "**inconclusive**" if noisy else ""
    # What the surviving group itself loses per kill, from the logs: a floor under the wall's figure.
    survivor_s = sum(q["split_s"].get(k, 0.0) for k in ("detection_s", "teardown_s", "reform_s", "recomputation_s"))
    lost_verdict = verdict(q["lost_per_failure_s"] <= 0.5)
    if noisy:
        floor = f"**not met** (the survivor's split alone: {survivor_s:.2f} s)"
        lost_verdict = floor if survivor_s > 0.5 else unresolved
    walls = q.get("fault_free_walls_s") or [q["fault_free_wall_s"]]
    noise = (
        f" In {noisy} of {g['soaks']} rounds a groups' soak ran faster than its own fault-free run (their"
        f" fault-free walls ranged {min(walls):.0f}-{max(walls):.0f} s): the machine's noise exceeded what"
        " the kills cost, so the walls resolve neither the goodput nor the loss per kill below: the goodput"
        " is **inconclusive**, and the loss per kill is judged by the split per failure further down"
        " (from the logs: detection, reform and the discarded step, what the surviving group loses)."
        if noisy
        else ""
    )
    targets = [
        row(
            "goodput against the fastest mode's median fault-free wall (own overhead charged)",
            f"**{q['goodput']:.3f}** ({', '.join(f'{v:.3f}' for v in q['goodput_runs'])})",
            ">= 0.95",
            unresolved or verdict(q["goodput"] >= 0.95),
        ),
        row(
            "fault-free wall / torchrun's with the same 4 workers, medians",
            f"{q['fault_free_wall_s'] / t['fault_free_wall_s']:.3f}",
            "",
            "",
        ),
        row(
            "time lost per worker failure (its group out until it heals), median",
            f"**{q['lost_per_failure_s']:.2f} s** ({', '.join(f'{v:.2f}' for v in q['lost_per_failure_runs_s'])})",
            "<= 0.5 s",
            lost_verdict,
        ),
    ]
    node = g.get("quorum_node_loss_s")
    if node:
        faults = (
            ("kill", "a group's agent session SIGKILLed", 3.0),
            ("stop", "a group's agent session frozen (SIGSTOP)", 2.0),
            ("stop_worker", "one worker of a group frozen (SIGSTOP; its group's rank 0 beats on)", 2.0),
        )
        for key, what, bound in faults:
            if key not in node:  # results from before the one-worker row
                continue
            median = statistics.median(node[key])
            targets.append(
                row(
                    f"{what} -> the other group's first commit alone",
                    f"**{median:.2f} s** ({', '.join(f'{v:.2f}' for v in node[key])})",
                    f"<= {bound:g} s",
                    verdict(median <= bound),
                )
            )
    return f"""### Replica groups of 2 workers: `goodput.py --modes torchrun-4,quorum-groups`

The same job with 4 workers on the node (one thread each on the 2 cores), {g["epochs"]} epochs:
`torchrun --nproc-per-node=4` (one DDP group, restart mode) beside quorum mode with 2 replica
groups of 2 workers (`--nproc-per-node 2 --procs-per-replica 2`: DDP inside each group, the
quorum across them), in {g["soaks"]} rounds of their own (a fault-free run and a soak of each,
kills {kill_spacing(g)}). A killed worker takes its group out: its agent stops the group's
other worker and restarts both, which heal worker by worker from the other group while that
group trains on alone. The node-loss rows run two agents of one group each and SIGKILL or
SIGSTOP one agent's whole session, or SIGSTOP its group rank 1 alone (its group's watch must
notice: `--peer-timeout` of silence). Same definitions as above. {goodput_load(g, workers=4)}{noise}
{g.get("caveat", "")}

| measure | torchrun, 4 workers | quorum, 2 groups of 2 |
| --- | --- | --- |
{chr(10).join(pair_rows(g, ("torchrun-4", "quorum-groups")))}

| quorum mode, groups of 2: targets | measured (rounds) | target | |
| --- | --- | --- | --- |
{chr(10).join(targets)}

Where a failure of quorum mode's groups goes (medians over the kills, from the surviving group's
rank 0): {split}."""


def goodput_large_section(g: dict[str, Any], heal: dict[str, Any] | None) -> str:
    """benchmarks/goodput.py with --train-flags: a model whose heal moves real state (issue 20)."""
    modes = [m for m in ("torchrun", "quorum") if m in g["modes"]]
    r = [g["modes"][m] for m in modes]
    q = g["modes"].get("quorum")

    def cells(fmt: Any) -> list[str]:
        return [fmt(x) for x in r]

    def joined(x: dict[str, Any], fmt: Any, *keys: str) -> str:
        return ", ".join(fmt(*values) for values in zip(*(x[k] for k in keys), strict=True))

    def split(x: dict[str, Any]) -> str:
        return ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f} s" for k, v in x["split_s"].items())

    header = "| measure | " + " | ".join(modes) + " | target (quorum) | |"
    rule = "| --- " * (len(modes) + 3) + "|"
    rows = [
        row(
            "checkpoint size (model + AdamW moments: what a restart loads, and a heal moves)",
            *cells(lambda x: f"{x['state_mb']:.0f} MB" if x.get("state_mb") else "?"),
            ">= 100 MB",
            verdict(q is not None and (q.get("state_mb") or 0) >= 100),
        ),
        row(
            "goodput against the fastest mode's median fault-free wall (own overhead charged)",
            *cells(lambda x: f"**{x['goodput']:.3f}**"),
            ">= 0.97",
            verdict(q is not None and q["goodput"] >= 0.97),
        ),
        row(
            "the rounds' goodputs, fastest reference",
            *cells(lambda x: ", ".join(f"{v:.3f}" for v in x["goodput_runs"])),
            "",
            "",
        ),
        row("goodput against its own fault-free run, median", *cells(lambda x: f"{x['goodput_vs_own']:.3f}"), "", ""),
        row(
            "fault-free walls, launch to exit, by round",
            *cells(lambda x: joined(x, lambda w: f"{w:.0f} s", "fault_free_walls_s")),
            "",
            "",
        ),
        row(
            "soak walls (kills)",
            *cells(lambda x: joined(x, lambda w, k: f"{w:.0f} s ({k})", "soak_walls_s", "kills")),
            "",
            "",
        ),
        row(
            "**time lost per worker failure**, median",
            *cells(lambda x: f"**{x['lost_per_failure_s']:.2f} s**"),
            "<= 0.5 s",
            verdict(q is not None and q["lost_per_failure_s"] <= 0.5),
        ),
        row(
            "the rounds' time lost per failure",
            *cells(lambda x: ", ".join(f"{v:.2f} s" for v in x.get("lost_per_failure_runs_s", []))),
            "",
            "",
        ),
        row("split per failure (medians)", *cells(split), "", ""),
        row(
            "every epoch's samples exactly once",
            *cells(lambda x: "yes" if x["exactly_once"] else "**NO**"),
            "yes",
            verdict(all(x["exactly_once"] for x in r)),
        ),
        row(
            "final weights: max abs difference from the fault-free run",
            *cells(lambda x: f"{x['max_weight_diff']:.1e}"),
            "",
            "",
        ),
    ]
    flags = " ".join(g.get("train_flags", []))
    return f"""### The same with a large model: `goodput.py --train-flags "{flags}"`

Issue 20 asks for a model whose heal moves real state. The same job, with `{flags}` added. That is
torchvision's AlexNet at 64 px: 57 M parameters, so 228 MB of weights. Restart mode loads them, and
the AdamW moments, from the newest checkpoint after every kill. Quorum mode's replacement fetches
them from the survivor ("heal" in the split).

{g["soaks"]} rounds, each a fault-free run and a soak of each mode, kills
{kill_spacing(g)}, {g["epochs"]} epochs, checkpoints every 2 steps. {goodput_load(g)}

{header}
{rule}
{chr(10).join(rows)}

{large_model_notes(g, heal)}"""


def large_model_notes(g: dict[str, Any], heal: dict[str, Any] | None) -> str:
    """Where quorum mode's time goes with the large model."""
    modes = g["modes"]
    if "quorum" not in modes or "torchrun" not in modes:
        return ""
    own, ref = modes["quorum"]["fault_free_wall_s"], modes["torchrun"]["fault_free_wall_s"]
    text = (
        f"Without failures quorum mode ran {own / ref - 1:.0%} slower than torchrun here ({own:.0f} s against "
        f"{ref:.0f} s). Its gradient average runs after the backward pass: every gradient concatenated into "
        "one buffer, one allreduce, the average copied back. DDP allreduces its buckets while the backward "
        "pass still runs, and concatenates nothing. With 228 MB of gradients a step, that is the likely "
        "source of the gap; its parts were not timed inside the job."
    )
    if heal:
        text += (
            f" The heal's transfer alone (`benchmarks/heal.py`, {heal['state_mb']} MB, medians of "
            f"{heal['repeats']}, below) takes {heal['stage_s']:.2f} s for the survivor to stage the state and "
            f"{heal['fetch_verify_decode_s']:.2f} s for the healer to fetch, verify and decode it. The rest of "
            "a heal was not timed apart: the load into the model and the optimizer, and the replacement's "
            "start, which shares the two cores with the survivor."
        )
    return text + " Both are the work left for the 0.5 s and 0.97 targets on large models."


def heal_section(h: dict[str, Any]) -> str:
    """benchmarks/heal.py: the signed state transfer alone."""
    return f"""### The heal's transfer alone: `benchmarks/heal.py`

A {h["state_mb"]} MB state (three tensors, as a model's weights and AdamW's two moments) staged on
one signed transport and fetched by another over loopback, in one process, medians of {h["repeats"]}.
The survivor waits while it stages the state. SHA-256 ran at {h["sha256_mb_s"]} MB/s on one core here.

| part | seconds |
| --- | --- |
| the survivor: copy the tensors into the blob | {h["encode_s"]:.2f} |
| the survivor: sign the body (16 MB chunks hashed on a thread pool) | {h["sign_s"]:.2f} |
| the survivor stages the state (both, as `send_checkpoint` does) | {h["stage_s"]:.2f} |
| the healer fetches, verifies and decodes it | {h["fetch_verify_decode_s"]:.2f} |
| **the transfer, both halves** | **{h["heal_transfer_s"]:.2f}** |"""


def goodput_section(g: dict[str, Any]) -> str:
    """benchmarks/goodput.py: torchrun restarts vs the warm launcher vs quorum mode."""
    modes = [m for m in ("torchrun", "warm", "quorum") if m in g["modes"]]
    names = {"torchrun": "torchrun", "warm": "warm launcher", "quorum": "quorum (`--ft quorum`)"}
    r = {m: g["modes"][m] for m in modes}
    q = r.get("quorum")
    ref_wall = g["modes"][g["reference"]]["fault_free_wall_s"]

    def cells(fmt: Any) -> list[str]:
        return [fmt(r[m]) for m in modes]

    # A quorum soak faster than its own round's fault-free run: noise exceeds what failures cost.
    noisy = (
        "**inconclusive**: a soak ran faster than its round's fault-free run (noise larger than the effect)"
        if q is not None and q.get("noisy_rounds", 0)
        else ""
    )

    def walls(x: dict[str, Any]) -> str:
        ff = x.get("fault_free_walls_s") or [x["fault_free_wall_s"]]
        return ", ".join(f"{w:.0f} s" for w in ff)

    header = "| measure | " + " | ".join(names[m] for m in modes) + " | target | |"
    rule = "| --- " * (len(modes) + 3) + "|"
    rows = [
        row(
            f"**goodput**: the round's fault-free wall / soak wall, median of {g['soaks']} rounds",
            *cells(lambda x: f"**{x['goodput_vs_own']:.3f}**"),
            ">= 0.95 (quorum)",
            noisy or verdict(q is not None and q["goodput_vs_own"] >= 0.95),
        ),
        row(
            "goodput with the fastest mode's median fault-free wall as reference (own overhead charged)",
            *cells(lambda x: f"{x['goodput']:.3f}"),
            ">= 0.97 (quorum)",
            noisy or verdict(q is not None and q["goodput"] >= 0.97),
        ),
        row(
            "the rounds' goodputs, fastest reference",
            *cells(lambda x: ", ".join(f"{v:.3f}" for v in x["goodput_runs"])),
            "",
            "",
        ),
        row("fault-free walls, launch to exit, by round", *cells(walls), "", ""),
        row(
            "**fault-free wall / the fastest mode's**, medians",
            *cells(lambda x: f"**{x['fault_free_wall_s'] / ref_wall:.3f}**"),
            "<= 1.02 (quorum)",
            verdict(q is not None and q["fault_free_wall_s"] / ref_wall <= 1.02),
        ),
        *(  # results from before goodput.py recorded each run's epoch times have no split
            [
                row(
                    "fault-free: an epoch's training time (the trainer's clock), median",
                    *cells(lambda x: f"{x['fault_free_epoch_s']:.2f} s"),
                    "",
                    "",
                ),
                row(
                    "fault-free: the wall outside the epochs (start-up, exit), median",
                    *cells(lambda x: f"{x['fault_free_outside_s']:.1f} s"),
                    "",
                    "",
                ),
            ]
            if all("fault_free_epoch_s" in x for x in r.values())
            else []
        ),
        row(
            "soak walls (kills)",
            *cells(lambda x: ", ".join(f"{w:.0f} s ({k})" for w, k in zip(x["soak_walls_s"], x["kills"], strict=True))),
            "",
            "",
        ),
        row(
            "**time lost per worker failure**: (soak wall - the round's fault-free wall) / kills, median",
            *cells(lambda x: f"**{x['lost_per_failure_s']:.2f} s**"),
            "<= 0.5 s (quorum)",
            noisy or verdict(q is not None and q["lost_per_failure_s"] <= 0.5),
        ),
        row(
            "the rounds' time lost per failure",
            *cells(lambda x: ", ".join(f"{v:.2f} s" for v in x.get("lost_per_failure_runs_s", []))),
            "",
            "",
        ),
        row(
            "every epoch's samples exactly once (sample digests equal the fault-free run's)",
            *cells(lambda x: "yes" if x["exactly_once"] else "**NO**"),
            "yes",
            verdict(all(x["exactly_once"] for x in r.values())),
        ),
        row(
            "final weights: max abs difference from the fault-free run (AdamW)",
            *cells(lambda x: f"{x['max_weight_diff']:.1e}"),
            "0 (restart), reduction order (quorum)",
            "",
        ),
    ]
    node = g.get("quorum_node_loss_s")
    node_rows = ""
    if node:
        kill, stop = statistics.median(node["kill"]), statistics.median(node["stop"])
        node_rows = "\n".join(
            [
                "",
                "| quorum mode, two agents of one worker | seconds (median) | runs | target | |",
                "| --- | --- | --- | --- | --- |",
                row(
                    "node SIGKILLed (agent, forkserver, worker) -> first commit at size 1",
                    f"{kill:.2f} s",
                    ", ".join(f"{v:.2f}" for v in node["kill"]),
                    "<= 3 s",
                    verdict(kill <= 3.0),
                ),
                row(
                    "node frozen (SIGSTOP of its whole session) -> first commit at size 1",
                    f"{stop:.2f} s",
                    ", ".join(f"{v:.2f}" for v in node["stop"]),
                    "<= 2 s",
                    verdict(stop <= 2.0),
                ),
            ]
        )
    split_names = sorted(
        {k for x in r.values() for k in x["split_s"]}, key=lambda k: SPLIT_ORDER.index(k) if k in SPLIT_ORDER else 99
    )
    split_rows = "\n".join(
        row(
            k.removesuffix("_s").replace("_", " "),
            *cells(lambda x, k=k: f"{x['split_s'][k]:.2f} s" if k in x["split_s"] else ""),
        )
        for k in split_names
    )
    return f"""## Goodput under failures: `benchmarks/goodput.py`

The same job launched three ways on one node (2 CPU workers, the ViT, global batch 128,
{g["epochs"]} epochs, a checkpoint every 2 steps): `torchrun --max-restarts=100`, the warm launcher
(`python -m elastic_train.launch`, same flags) and quorum mode (`python -m elastic_train.quorum.launch`).
Per mode {g["soaks"]} runs without failures and {g["soaks"]} soaks in which `jobs/chaos.py` SIGKILLs a
random worker {kill_spacing(g)} (seeded), in rounds that interleave the modes. {g.get("caveat", "")}
Every run trains the same
samples, so goodput = (trained samples / fault-free throughput) / wall = fault-free wall / soak
wall, walls from the launch command to the process's exit (start-up and the final checkpoint
included). Each soak is compared with the fault-free run of the same mode just before it (its
round): fault-free walls drift by more than the effect between rounds. The second goodput row
charges a mode's own overhead too: the reference is the fastest mode's ({g["reference"]}) median
fault-free wall, itself within the noise. {g.get("note", "")} {goodput_load(g)} {quorum_overhead(g)}

{header}
{rule}
{chr(10).join(rows)}
{node_rows}

Where a failure's time goes (medians over the kills of the soaks, from the trainer's event logs).
For torchrun and the warm launcher: detection, teardown and re-forming are one figure (the agent
noticing the dead worker, stopping the survivor, the rendezvous round, until the new workers
start), then the new processes' start (interpreter or fork, imports, process group, data, model),
the checkpoint read (state transfer) and the steps since the last checkpoint redone at the
fault-free step time (recomputation). For quorum mode: detection is the kill to the survivor's
discarded attempt (a dead peer's closed socket fails its allreduce at once, but only when the
survivor reaches it), teardown is none (no process stops), re-forming is the quorum of the
survivor's first commit after the kill, state transfer is the survivor's wait while the
restarted worker heals from it in a later quorum, recomputation the discarded attempt's work
(its share's gradients are kept: the redo trains only what the new quorum adds to it). The
replacement is forked warm with the data already open and asks for a quorum ~0.15 s after the
kill: when that is before the Lighthouse drops the dead worker (400 ms heartbeat timeout), the
redo's quorum already holds it, healing, and the survivor redoes nothing; re-forming then
includes the heal and state transfer is 0.{in_redo(q)}

| phase | {" | ".join(names[m] for m in modes)} |
| {" | ".join(["---"] * (len(modes) + 1))} |
{split_rows}
"""


def in_redo(q: dict[str, Any] | None) -> str:
    """How often quorum mode's replacement was already in the redo's quorum (goodput.py)."""
    if q is None or "replacement_in_redo_share" not in q:
        return ""
    return f" Here that held for {100 * q['replacement_in_redo_share']:.0f}% of the kills (mean over the soaks)."


SPLIT_ORDER = [
    "detection_teardown_reform_s",
    "detection_s",
    "teardown_s",
    "reform_s",
    "process_start_s",
    "state_transfer_s",
    "recomputation_s",
]


# Where a GPU check was run (`python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json`
# on the GPU machine), its table replaces this sentence.
GPU_NOT_RUN = (
    "Not run yet: the machines this page was measured on have no GPU, and no GPU machine was lent "
    "to the session that wrote the script. Its CPU smoke mode (`--device cpu --quick`: gloo, bf16 on "
    "the CPU, tiny runs; the bf16, async-save, fsdp and fsdp-2gpu checks) runs in `make test` "
    "(`tests/launch/test_gpu_check.py`), so the script itself stays working."
)


def gpu_table(run: Any) -> str:
    """``gpu_check.py --json``'s file: ``{"where", "checks": [{name, result, seconds, detail}],
    "notes"?: [...]}`` (``notes``: what was measured beside the run, added by whoever ran it)."""
    if not run:
        return GPU_NOT_RUN
    if not isinstance(run, dict) or "checks" not in run:
        raise SystemExit("benchmarks/results/gpu_check.json is of an older format: run gpu_check.py --json again")
    lines = [f"Run on {run['where']}:", "", "| check | result | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {c['name']} | {c['result']} | {c['seconds']:.1f} | {c['detail']} |" for c in run["checks"]]
    for note in run.get("notes", []):
        lines += ["", note]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes, to check the pipeline")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(FULL),
        help="rerun just this benchmark (repeatable); the others are read from --results",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite --out from the results already in --results (add --quick if they are quick ones)",
    )
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    plan = QUICK if args.quick else FULL
    results = {}
    for name, extra in plan.items():
        if not args.render_only and (not args.only or name in args.only):
            results[name] = run_benchmark(name, extra, args.results)
        elif (args.results / f"{name}.json").exists() or name not in OPTIONAL:
            results[name] = json.loads((args.results / f"{name}.json").read_text())
    ran = not args.render_only
    if ran and (not args.only or set(args.only) == set(plan)):  # every benchmark: this machine's page
        (args.results / "machine.json").write_text(json.dumps({"machine": machine()}))
    if (args.results / "machine.json").exists():
        results["machine"] = json.loads((args.results / "machine.json").read_text())
    gpu = args.results / "gpu_check.json"
    if gpu.exists():  # written on a GPU machine, never by this suite
        results["gpu_check"] = json.loads(gpu.read_text())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.out.write_text(render(results, args.quick, when))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
