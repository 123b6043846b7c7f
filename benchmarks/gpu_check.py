"""``make gpu-check``: the CUDA + NCCL + AMP path on a machine with NVIDIA GPUs (~4 min on one).

The CPU machines that build and test elastic-train have no GPU; this script is what a machine
with them runs. Each check prints one row of a pass/fail table.

One process, one GPU:

1. ``nccl-bf16``: torchrun, NCCL backend, ``--amp --amp-dtype bf16``, synthetic data, reaches
   the target accuracy (early stop on target).
2. ``nccl-fp16``: the same with fp16 autocast and the GradScaler (its scale is checkpointed).
3. ``async-save``: a background checkpoint of the live CUDA tensors, taken while training goes on,
   is committed and its files are byte-equal to the tensors as they were at the snapshot (the
   device-to-host copies ran on the writer's stream, bound to the state's device).
4. ``kill-resume``: ``--deterministic``, a worker SIGKILLed mid-epoch and restarted by torchrun:
   the final model and optimizer are bitwise equal to an uninterrupted run.
5. ``throughput``: elastic-train vs the bare DDP loop (benchmarks/bare_ddp.py) on the GPU, same
   model, batch and precision; the ratio of median epoch throughputs (>= 0.90 passes).
6. ``fsdp``: ``--parallel fsdp`` (FSDP2, NCCL, the bf16 mixed-precision policy): check 4's kill +
   resume, bitwise; then that GPU checkpoint resumed by two CPU processes under gloo (a reshard
   1 -> 2 and a change of device).

Two processes on GPUs 0 and 1, what a world of one cannot show:

7. ``nccl-bf16-2gpu``: check 1 at world 2: the gradients are averaged by an NCCL all-reduce.
8. ``async-save-2gpu``: check 3 at world 2. Rank 1 saves its share of the tensors from cuda:1,
   and its writer thread's current device starts as GPU 0 (the current device is per thread), so
   a writer that does not bind to the state's device copies on the wrong stream.
9. ``kill-resume-2gpu``: check 4 at world 2 with rank 1 (cuda:1) killed: rank 0, waiting in an
   NCCL collective, must be torn down and both restarted; bitwise equal to an uninterrupted run.
10. ``fsdp-2gpu``: check 6 at world 2 with rank 1 killed, then its checkpoint resumed by one
    GPU process (a reshard 2 -> 1).

What runs where: with no GPU every row reads ``skipped: no GPU``; with one GPU checks 1-6 run and
7-10 read ``skipped: needs 2 GPUs, 1 visible``; with two or more all run. The exit code is the
number of failed checks; a skipped check is not a failure, so a 0 alone does not say that the GPU
path was checked: the table and the last line (``N passed, N failed, N skipped``) do.

    python benchmarks/gpu_check.py [--device cuda] [--json out.json] [--only CHECK ...]

``--device cpu`` runs every check with gloo and bf16 on the CPU (slow, small, nothing skipped;
the two-process checks run two CPU processes): the test suite does so to keep this script
working where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
# Bounds each trainer, probe and baseline run (a hung NCCL collective ends as a failed row).
RUN_TIMEOUT_S = 240


class Result(str, Enum):
    PASS = "pass"
    FAIL = "FAIL"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Where:
    """Where a check runs: the device kind, one process per GPU, a scratch folder of its own."""

    device: str
    processes: int
    work: Path
    quick: bool  # the CPU smoke run's tiny settings


@dataclass(frozen=True)
class Spec:
    name: str
    processes: int
    run: Callable[[Where], tuple[bool, str]]


@dataclass
class Check:
    name: str
    result: Result
    detail: str
    seconds: float


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # ROOT first, what the caller's PYTHONPATH holds after it (packages installed to a --target
    # folder, as on a machine whose Python environment is not ours to change).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_TRAIN_FAULTS"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def _torchrun(processes: int, restarts: int = 1) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={processes}", f"--max-restarts={restarts}"]


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=_env(env), cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )


def _trainer(
    where: Where, base: Path, args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    folders = ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt"), *_val(where)]
    return _run([*_torchrun(where.processes), "-m", "elastic_train", "--device", where.device, *folders, *args], env)


def _val(where: Where) -> list[str]:
    """The CPU smoke run validates on 64 samples: a full pass of the 1024 cost it more than its
    training steps, and it checks the script's paths, not the model. A GPU run evaluates all."""
    return ["--max-val-samples", "64"] if where.quick else []


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout + done.stderr)[-600:].replace("\n", " | ")


def check_amp(where: Where, dtype: str) -> tuple[bool, str]:
    """To the target accuracy; ``quick`` (the CPU smoke run) only checks that it trains."""
    # Quick: the smallest batch that still has 16 samples a process (bf16 on a CPU is emulated, slow).
    args = ["--amp", "--amp-dtype", dtype, "--batch-size", "32" if where.quick else "128"]
    args += ["--epochs", "1", "--max-steps-per-epoch", "4", "--image-size", "16"] if where.quick else ["--epochs", "20"]
    args += ["--target-accuracy", "1.0" if where.quick else "0.9"]
    done = _trainer(where, where.work, args)
    expected_backend = "nccl" if where.device == "cuda" else "gloo"
    expected_dtype = dtype if where.device == "cuda" else "bf16"
    ok = (
        done.returncode == 0
        and f"Training started with {where.processes} processes" in done.stdout
        and f"Backend: {expected_backend}" in done.stdout
        and f"precision: {expected_dtype}" in done.stdout
        and (where.quick or "Early stopping" in done.stdout)
    )
    lines = done.stdout.splitlines()
    # The early stop's line where there is one, else the last epoch's.
    line = next((ln for ln in lines if ln.startswith("Early stopping")), "")
    line = line or next((ln for ln in reversed(lines) if ln.startswith("Epoch ")), "")
    return ok, line if ok else _tail(done)


def check_async_save(where: Where) -> tuple[bool, str]:
    """The trainer's own snapshot/save path in ``processes`` torchrun workers, then a byte compare.

    Each worker writes what it saw to ``result-rank<r>.json`` (a file, not its console, so the
    ranks' lines cannot interleave); every rank must report a commit and equal bytes, and at
    world 2 rank 1 must have written tensors of its own from its own device."""
    probe = [str(Path(__file__).resolve()), "--async-save-probe", where.device, str(where.work)]
    probe += ["--quick"] if where.quick else []
    done = _run([*_torchrun(where.processes, restarts=0), *probe])
    results = [where.work / f"result-rank{r}.json" for r in range(where.processes)]
    if done.returncode or not all(path.exists() for path in results):
        return False, f"exit code {done.returncode}: {_tail(done)}"
    return judge_probe([json.loads(path.read_text()) for path in results])


def judge_probe(results: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    """Pass when every rank committed and read back its snapshot byte for byte, and every rank
    wrote a share of its own (at world 2: rank 1 from its device, not GPU 0)."""
    for r in results:
        if not r["committed"]:
            return False, f"rank {r['rank']}: the async save was not committed"
        if r["differ"]:
            return False, f"rank {r['rank']}: written tensors differ from the snapshot: {r['differ'][:3]}"
        if r["wrote"] == 0:
            return False, f"rank {r['rank']} on {r['device']} wrote no tensors: its writer thread was not tested"
    shares = ", ".join(f"rank {r['rank']} wrote {r['wrote']} from {r['device']}" for r in results)
    return True, f"equal: {results[0]['tensors']} tensors ({shares})"


def _async_save_probe(device: str, base: Path, quick: bool) -> int:
    """Runs in each torchrun worker of ``check_async_save``."""
    import torch
    from safetensors.torch import load_file

    from elastic_train.boundary import SavePolicy, StepBoundary
    from elastic_train.checkpoint.format import latest_target, shard_name
    from elastic_train.checkpoint.manager import Checkpointer
    from elastic_train.cli import parse_config
    from elastic_train.data import open_task_data
    from elastic_train.distributed.env import DistEnv
    from elastic_train.distributed.process_group import ControlPlane, choose_placement, process_group
    from elastic_train.faults import CheckpointFaults, FaultInjector
    from elastic_train.run import checkpoint_config, choose_task, run_fingerprint
    from elastic_train.trainer import Trainer

    args = ["--device", device, "--amp", "--checkpoint-dir", str(base / "ckpt"), "--log-dir", str(base)]
    cfg = parse_config([*args, "--image-size", "16", "--batch-size", "32"] if quick else args)
    env = DistEnv.from_environ()
    placement = choose_placement(cfg.device, env)
    with process_group(env, placement, 120):
        # Built as run._train_in_group builds it, minus the watchdog, tracker and stop signals.
        control = ControlPlane()
        task = choose_task(cfg)
        data = open_task_data(task, cfg, env)
        fingerprint = run_fingerprint(cfg, task, data.identify(), builtin=cfg.task is None)
        faults = FaultInjector.from_environ(env.rank, base / ".faults")
        ck = Checkpointer(checkpoint_config(cfg), env, fingerprint, control.group, CheckpointFaults(faults))
        ck.start()
        # The loop's optimizer step waits for a save's staging copies (the checkpointer's guard);
        # the probe starts the save itself, so nothing is due by the boundary's policy.
        boundary = StepBoundary(ck, control, SavePolicy(), async_save=True, is_main=env.is_main)
        trainer = Trainer(cfg, env, placement, task, data, faults, boundary)
        device_name = str(trainer.device)
        assert trainer.batches_per_epoch > 6, "the probe's six steps fit in its first epoch"
        trainer.strategy.start()
        trainer.restart_clock()
        while trainer.state.step < 3:  # the one loop's own steps
            trainer.advance()
        snap = trainer.snapshot()
        expected = {k: v.detach().to("cpu", copy=True) for k, v in snap.replicated.items()}
        ck.save(snap, sync=False)
        while trainer.state.step < 6:  # training goes on while the copies and the write run
            trainer.advance()
        committed = ck.commit_pending() if ck.pending else ck.last_committed_step == 3
        trainer.close()
        ck.close()
        del trainer
    folder = latest_target(base / "ckpt")
    written: dict[str, torch.Tensor] = {}
    own: list[str] = []
    if committed and folder is not None:
        for shard in folder.glob("shard-*.safetensors"):
            written.update(load_file(shard))
        own = [k for k in load_file(folder / shard_name(env.rank, env.world_size)) if k in expected]
    differ = [k for k, v in expected.items() if k not in written or not torch.equal(written[k], v)]
    result = {
        "rank": env.rank,
        "device": device_name,
        "committed": bool(committed and folder is not None),
        "tensors": len(expected),
        "wrote": len(own),
        "differ": differ,
    }
    (base / f"result-rank{env.rank}.json").write_text(json.dumps(result))
    return 0 if result["committed"] and not differ else 1


def _final_tensors(base: Path) -> dict[str, Any]:
    """The newest checkpoint's model and optimizer tensors, pieces of a sharded one assembled."""
    from elastic_train.checkpoint.format import latest_target
    from elastic_train.checkpoint.manager import load

    folder = latest_target(base / "ckpt")
    if folder is None:
        return {}
    return {k: v for k, v in load(folder).whole().items() if k.startswith(("model.", "optim."))}


def check_kill_resume(where: Where, extra: Sequence[str] = ()) -> tuple[bool, str]:
    """The last rank (rank 1, on cuda:1, at world 2) is SIGKILLed mid-epoch 2; torchrun restarts
    the workers from the last checkpoint; the end state must equal an uninterrupted run's."""
    import torch

    steps = "4" if where.quick else "8"
    args = [*extra, "--deterministic", "--epochs", "2", "--max-steps-per-epoch", steps, "--target-accuracy", "1.0"]
    args += ["--patience", "0", "--checkpoint-every", "2", "--batch-size", "32" if where.quick else "64"]
    args += ["--image-size", "16"] if where.quick else []
    victim = where.processes - 1
    fault = {"ELASTIC_TRAIN_FAULTS": f"kill:rank={victim}:step={int(steps) + 3}"}
    reference = _trainer(where, where.work / "reference", args)
    killed = _trainer(where, where.work / "killed", args, fault)
    if reference.returncode or killed.returncode:
        return False, f"exit codes {reference.returncode}/{killed.returncode}: {_tail(killed)}"
    if "Resumed from" not in killed.stdout:
        return False, f"the run with rank {victim} killed did not resume from a checkpoint"
    a, b = _final_tensors(where.work / "reference"), _final_tensors(where.work / "killed")
    differ = [k for k in a if not isinstance(b.get(k), torch.Tensor) or not torch.equal(a[k], b[k])]
    ok = bool(a) and a.keys() == b.keys() and not differ
    return ok, f"rank {victim} killed; {len(a)} tensors bitwise equal" if ok else f"differ: {differ[:3]}"


def check_fsdp(where: Where) -> tuple[bool, str]:
    """FSDP2 under NCCL with the bf16 mixed-precision policy: the kill + resume above, bitwise
    (each rank saves and reloads only its own pieces); then the finished run extended by one
    epoch at another world size, every piece read back resharded. Two GPUs: the 2-process
    checkpoint resumed by 1 process (2 -> 1). One GPU: the GPU's checkpoint resumed by 2 CPU
    processes under gloo (1 -> 2, and cuda -> cpu: nothing in the files names a device)."""
    fsdp = ["--parallel", "fsdp"]
    # bf16 on a CPU is emulated and slow (~10x here): the CPU smoke run checks this script's
    # path in fp32; the bf16 policy itself is what a GPU run shows.
    fsdp += [] if where.device == "cpu" else ["--amp", "--amp-dtype", "bf16"]
    ok, detail = check_kill_resume(where, fsdp)
    if not ok:
        return False, f"kill + resume: {detail}"
    processes, device, resume_flags, label = fsdp_resume_plan(where, fsdp)
    base = where.work / "killed"
    steps = "4" if where.quick else "8"
    args = [*resume_flags, "--epochs", "3", "--max-steps-per-epoch", steps, "--target-accuracy", "1.0"]
    batch = "32" if where.quick else "64"  # as check_kill_resume's run it extends
    args += ["--patience", "0", "--batch-size", batch, "--log-dir", str(base / "logs")]
    args += ["--checkpoint-dir", str(base / "ckpt"), *(["--image-size", "16"] if where.quick else [])]
    more = _run([*_torchrun(processes), "-m", "elastic_train", "--device", device, *args, *_val(where)])
    # A run that found no checkpoint would train epochs 1-3 from scratch and print the same end.
    resumed = "Extending the finished run" in more.stdout and "Epoch 3/3" in more.stdout
    resumed = resumed and "Epoch 1/3" not in more.stdout
    if more.returncode or not resumed or f"started with {processes} processes" not in more.stdout:
        return False, f"not {label}: {_tail(more)}"
    return True, f"{detail}; {label} to epoch 3"


def fsdp_resume_plan(where: Where, fsdp: list[str]) -> tuple[int, str, list[str], str]:
    """Who extends ``check_fsdp``'s finished run: (processes, device, flags, the row's words).
    From two GPUs, one process on the GPU; from one, two CPU processes (in fp32: the precision
    is not fingerprinted)."""
    if where.processes > 1:
        return 1, where.device, fsdp, f"resumed by 1 process ({where.processes} -> 1 pieces)"
    return 2, "cpu", ["--parallel", "fsdp"], f"resumed by 2 CPU processes (1 -> 2 pieces, {where.device} -> cpu)"


def _throughputs(lines: str) -> list[float]:
    return [float(ln.split("throughput=")[1].split()[0]) for ln in lines.splitlines() if "throughput=" in ln]


def check_throughput(where: Where) -> tuple[bool, str]:
    # The synthetic set's 4096 samples make an epoch 16 steps of 256 (--max-steps-per-epoch only
    # caps): an epoch is ~0.25 s on an H200, so 12 epochs give 11 timed ones to take the median of
    # (5 gave 0.83-1.01 over three runs of the same code; 12 not yet run on a GPU).
    epochs, steps = ("3", "3") if where.quick else ("12", "40")
    shape = ["--epochs", epochs, "--batch-size", "256"]
    bare_script = [str(ROOT / "benchmarks" / "bare_ddp.py"), "--device", where.device, "--steps", steps]
    bare = _run([*_torchrun(where.processes, restarts=0), *bare_script, *shape])
    until_the_end = ["--target-accuracy", "1.0", "--patience", "0"]  # no early stop: every epoch timed
    ours = _trainer(where, where.work, [*shape, "--max-steps-per-epoch", steps, *until_the_end])
    bare_tp = [json.loads(ln)["throughput"] for ln in bare.stdout.splitlines() if ln.startswith("{")]
    ours_tp = _throughputs(ours.stdout)
    if len(bare_tp) < 2 or len(ours_tp) < 2:
        return False, f"no throughput: {_tail(bare)} {_tail(ours)}"
    ours_median, bare_median = statistics.median(ours_tp[1:]), statistics.median(bare_tp[1:])
    ratio = ours_median / bare_median
    return ratio >= 0.90, f"ratio {ratio:.3f} (ours {ours_median:.0f} img/s, bare {bare_median:.0f})"


CHECKS = [
    Spec("nccl-bf16", 1, lambda w: check_amp(w, "bf16")),
    Spec("nccl-fp16", 1, lambda w: check_amp(w, "fp16")),
    Spec("async-save", 1, check_async_save),
    Spec("kill-resume", 1, check_kill_resume),
    Spec("throughput", 1, check_throughput),
    Spec("fsdp", 1, check_fsdp),
    Spec("nccl-bf16-2gpu", 2, lambda w: check_amp(w, "bf16")),
    Spec("async-save-2gpu", 2, check_async_save),
    Spec("kill-resume-2gpu", 2, check_kill_resume),
    Spec("fsdp-2gpu", 2, check_fsdp),
]


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def where_it_ran(device: str) -> str:
    """The GPU, torch, CUDA and NCCL versions of this run, for the results file."""
    import torch

    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = done.stdout.strip() or "unknown"
    except OSError:  # no git on the GPU machine: the results must still be written
        commit = "unknown"
    when = f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}, commit {commit}"
    if device != "cuda" or not torch.cuda.is_available():
        return f"{device}, torch {torch.__version__}, {when}"
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return f"{gpus} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {when}"


def skip_reason(spec: Spec, device: str, gpus: int) -> str | None:
    """Why ``spec`` cannot run here (one process per GPU), or None when it can. The CPU smoke
    run starts its processes on the CPU, so it skips nothing."""
    if device == "cpu":
        return None
    if gpus == 0:
        return "no GPU"
    if spec.processes > gpus:
        return f"needs {spec.processes} GPUs, {gpus} visible"
    return None


def run_checks(specs: Sequence[Spec], device: str, gpus: int, work: Path, quick: bool) -> list[Check]:
    """Each check in order, printed as it ends; a check that crashes is a failed row and the
    others still run."""
    results: list[Check] = []
    for spec in specs:
        start = time.monotonic()
        reason = skip_reason(spec, device, gpus)
        if reason is not None:
            result, detail = Result.SKIPPED, f"skipped: {reason}"
        else:
            where = Where(device, spec.processes, work / spec.name, quick)
            where.work.mkdir(parents=True, exist_ok=True)
            try:
                ok, detail = spec.run(where)
            except Exception as exc:
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            result = Result.PASS if ok else Result.FAIL
        results.append(Check(spec.name, result, detail, time.monotonic() - start))
        print(f"{spec.name:18s} {result.value:7s}  {results[-1].seconds:6.1f}s  {detail}", flush=True)
    return results


def summary(results: Sequence[Check]) -> str:
    counts = {kind: sum(r.result is kind for r in results) for kind in Result}
    reasons = {r.detail for r in results}
    if results and counts[Result.SKIPPED] == len(results) and len(reasons) == 1:
        return f"gpu-check {reasons.pop()} ({len(results)} of {len(results)} checks skipped: nothing was checked)"
    return f"gpu-check: {counts[Result.PASS]} passed, {counts[Result.FAIL]} failed, {counts[Result.SKIPPED]} skipped"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small runs (the CPU smoke test uses it)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", action="append", default=None, help="run just this check (repeatable)")
    parser.add_argument("--async-save-probe", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.async_save_probe:
        return _async_save_probe(args.async_save_probe[0], Path(args.async_save_probe[1]), args.quick)
    specs = CHECKS
    if args.only:
        unknown = set(args.only) - {spec.name for spec in CHECKS}
        if unknown:
            parser.error(f"unknown check(s) {sorted(unknown)}; the checks are {[s.name for s in CHECKS]}")
        specs = [spec for spec in CHECKS if spec.name in args.only]
    gpus = visible_gpus() if args.device == "cuda" else 0
    if args.device == "cuda":
        print(f"gpu-check: {gpus} GPU(s) visible" + ("; --device cpu runs the CPU smoke mode" if not gpus else ""))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        results = run_checks(specs, args.device, gpus, Path(tmp), args.quick)
    print("\n| check | result | seconds | detail |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.result.value} | {r.seconds:.1f} | {r.detail} |")
    print(summary(results))
    if args.json:
        rows = [{**r.__dict__, "result": r.result.value} for r in results]
        args.json.write_text(json.dumps({"where": where_it_ran(args.device), "checks": rows}, indent=2))
    return sum(r.result is Result.FAIL for r in results)


if __name__ == "__main__":
    sys.exit(main())
