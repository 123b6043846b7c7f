"""``make gpu-check``: the CUDA + NCCL + AMP path on one machine with one NVIDIA GPU, in < 5 minutes.

The CPU machines that build and test elastic-train have no GPU; this script is what a machine
with one runs. Each check prints one row of a pass/fail table; the exit code is the number of
failed checks (0: all passed).

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

    python benchmarks/gpu_check.py [--device cuda] [--json out.json]

``--device cpu`` runs the same checks with gloo and bf16 on the CPU (slow, small): the test
suite does so to keep this script working where no GPU is.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=1"]


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    seconds: float


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_TRAIN_FAULTS"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def _trainer(
    device: str, base: Path, args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [
        *TORCHRUN,
        "--max-restarts=1",
        "-m",
        "elastic_train",
        "--device",
        device,
        "--log-dir",
        str(base / "logs"),
        "--checkpoint-dir",
        str(base / "ckpt"),
        *args,
    ]
    return subprocess.run(cmd, env=_env(env), cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout + done.stderr)[-600:].replace("\n", " | ")


def check_amp(device: str, dtype: str, work: Path, quick: bool) -> tuple[bool, str]:
    """To the target accuracy; ``quick`` (the CPU smoke run) only checks that it trains."""
    args = ["--amp", "--amp-dtype", dtype, "--batch-size", "128"]
    args += ["--epochs", "1", "--max-steps-per-epoch", "4", "--image-size", "16"] if quick else ["--epochs", "20"]
    args += ["--target-accuracy", "1.0" if quick else "0.9"]
    done = _trainer(device, work / f"amp-{dtype}", args)
    expected_backend = "nccl" if device == "cuda" else "gloo"
    expected_dtype = dtype if device == "cuda" else "bf16"
    ok = (
        done.returncode == 0
        and f"Backend: {expected_backend}" in done.stdout
        and f"precision: {expected_dtype}" in done.stdout
        and (quick or "Early stopping" in done.stdout)
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(("Early stopping", "Epoch "))), "")
    return ok, line if ok else _tail(done)


# A world of one with a launcher's variables, so the probe takes the launched code path.
PROBE_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}


def check_async_save(device: str, work: Path, quick: bool) -> tuple[bool, str]:
    """In a subprocess: the trainer's own snapshot/save path on the device, then a byte compare."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--async-save-probe", device, str(work / "probe")],
        env=_env(
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return done.returncode == 0 and last.startswith("equal"), last or _tail(done)


def _async_save_probe(device: str, base: Path) -> int:
    """Runs inside the probe subprocess (a world of one, launched=True)."""
    import torch
    from safetensors.torch import load_file

    from elastic_train.boundary import SavePolicy, StepBoundary
    from elastic_train.checkpoint.format import latest_target
    from elastic_train.checkpoint.manager import Checkpointer
    from elastic_train.cli import parse_config
    from elastic_train.data import open_task_data
    from elastic_train.distributed.env import DistEnv
    from elastic_train.distributed.process_group import ControlPlane, choose_placement, process_group
    from elastic_train.faults import CheckpointFaults, FaultInjector
    from elastic_train.run import checkpoint_config, choose_task, run_fingerprint
    from elastic_train.trainer import Trainer

    cfg = parse_config(["--device", device, "--amp", "--checkpoint-dir", str(base / "ckpt"), "--log-dir", str(base)])
    env = DistEnv.from_environ()
    placement = choose_placement(cfg.device, env)
    with process_group(env, placement, 120):
        # Built as run._train_in_group builds it, minus the watchdog, tracker and stop signals.
        control = ControlPlane()
        task = choose_task(cfg)
        data = open_task_data(task, cfg, env)
        fingerprint = run_fingerprint(cfg, task, data.identify(), builtin=cfg.task is None)
        faults = FaultInjector.from_environ(0, base / ".faults")
        ck = Checkpointer(checkpoint_config(cfg), env, fingerprint, control.group, CheckpointFaults(faults))
        ck.start()
        # The boundary is what makes train_step wait for the staging copies before the optimizer
        # step; the probe starts the save itself, so nothing is due by policy.
        boundary = StepBoundary(ck, control, SavePolicy(), async_save=True, is_main=env.is_main)
        trainer = Trainer(cfg, env, placement, task, data, faults, boundary)
        batches = iter(trainer.train_loader)
        for _ in range(3):
            *batch, _indices = next(batches)
            trainer.train_step(*task.to_device(batch, trainer.device))
        trainer.state.step = 3
        snap = trainer.snapshot()
        expected = {k: v.detach().to("cpu", copy=True) for k, v in snap.replicated.items()}
        ck.save(snap, sync=False)
        for _ in range(3):  # training goes on while the copies and the write run
            *batch, _indices = next(batches)
            trainer.train_step(*task.to_device(batch, trainer.device))
        committed = ck.commit_pending() if ck.pending else ck.last_committed_step == 3
        trainer.close()
        ck.close()
        del trainer
    folder = latest_target(base / "ckpt")
    if not committed or folder is None:
        print("not committed")
        return 1
    written: dict[str, torch.Tensor] = {}
    for shard in folder.glob("shard-*.safetensors"):
        written.update(load_file(shard))
    differ = [k for k, v in expected.items() if not torch.equal(written[k], v)]
    print(f"equal: {len(expected)} tensors" if not differ else f"differ: {differ[:3]}")
    return 1 if differ else 0


def _final_tensors(base: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    from elastic_train.checkpoint.format import latest_target

    folder = latest_target(base / "ckpt")
    tensors: dict[str, object] = {}
    for shard in sorted(folder.glob("shard-*.safetensors")) if folder else []:
        tensors.update({k: v for k, v in load_file(shard).items() if k.startswith(("model.", "optim."))})
    return tensors


def check_kill_resume(device: str, work: Path, quick: bool) -> tuple[bool, str]:
    import torch

    steps = "4" if quick else "8"
    args = ["--deterministic", "--epochs", "2", "--max-steps-per-epoch", steps, "--target-accuracy", "1.0"]
    args += ["--patience", "0", "--checkpoint-every", "2", "--batch-size", "64"]
    args += ["--image-size", "16"] if quick else []
    reference = _trainer(device, work / "reference", args)
    killed = _trainer(device, work / "killed", args, {"ELASTIC_TRAIN_FAULTS": f"kill:rank=0:step={int(steps) + 3}"})
    if reference.returncode or killed.returncode:
        return False, f"exit codes {reference.returncode}/{killed.returncode}: {_tail(killed)}"
    if "Resumed from" not in killed.stdout:
        return False, "the killed run did not resume from a checkpoint"
    a, b = _final_tensors(work / "reference"), _final_tensors(work / "killed")
    differ = [k for k in a if not isinstance(a[k], torch.Tensor) or not torch.equal(a[k], b.get(k))]  # type: ignore[arg-type]
    ok = bool(a) and a.keys() == b.keys() and not differ
    return ok, f"{len(a)} tensors bitwise equal" if ok else f"differ: {differ[:3]}"


def _throughputs(lines: str) -> list[float]:
    return [float(ln.split("throughput=")[1].split()[0]) for ln in lines.splitlines() if "throughput=" in ln]


def check_throughput(device: str, work: Path, quick: bool) -> tuple[bool, str]:
    epochs, steps = ("3", "3") if quick else ("5", "40")
    bare = subprocess.run(
        [
            *TORCHRUN,
            str(ROOT / "benchmarks" / "bare_ddp.py"),
            "--device",
            device,
            "--epochs",
            epochs,
            "--steps",
            steps,
            "--batch-size",
            "256",
        ],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    ours = _trainer(
        device,
        work / "throughput",
        ["--epochs", epochs, "--max-steps-per-epoch", steps, "--batch-size", "256", "--target-accuracy", "1.0"],
    )
    bare_tp = [json.loads(ln)["throughput"] for ln in bare.stdout.splitlines() if ln.startswith("{")]
    ours_tp = _throughputs(ours.stdout)
    if len(bare_tp) < 2 or len(ours_tp) < 2:
        return False, f"no throughput: {_tail(bare)} {_tail(ours)}"
    ours_median, bare_median = statistics.median(ours_tp[1:]), statistics.median(bare_tp[1:])
    ratio = ours_median / bare_median
    return ratio >= 0.90, f"ratio {ratio:.3f} (ours {ours_median:.0f} img/s, bare {bare_median:.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small runs (the CPU smoke test uses it)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", action="append", default=None, help="run just this check (repeatable)")
    parser.add_argument("--async-save-probe", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.async_save_probe:
        return _async_save_probe(args.async_save_probe[0], Path(args.async_save_probe[1]))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device visible (use --device cpu for the CPU smoke run)", file=sys.stderr)
            return 2
    checks: list[tuple[str, Callable[[str, Path, bool], tuple[bool, str]]]] = [
        ("nccl-bf16", lambda d, w, q: check_amp(d, "bf16", w, q)),
        ("nccl-fp16", lambda d, w, q: check_amp(d, "fp16", w, q)),
        ("async-save", check_async_save),
        ("kill-resume", check_kill_resume),
        ("throughput", check_throughput),
    ]
    if args.only:
        unknown = set(args.only) - {name for name, _ in checks}
        if unknown:
            parser.error(f"unknown check(s) {sorted(unknown)}")
        checks = [(name, run) for name, run in checks if name in args.only]
    results: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name, run in checks:
            start = time.monotonic()
            try:
                ok, detail = run(args.device, Path(tmp), args.quick)
            except Exception as exc:  # a check that crashes is a failed row, the others still run
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            results.append(Check(name, ok, detail, time.monotonic() - start))
            print(f"{name:12s} {'PASS' if ok else 'FAIL'}  {results[-1].seconds:6.1f}s  {detail}", flush=True)
    print("\n| check | result | seconds | detail |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {'pass' if r.passed else 'FAIL'} | {r.seconds:.1f} | {r.detail} |")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return sum(not r.passed for r in results)


if __name__ == "__main__":
    sys.exit(main())
