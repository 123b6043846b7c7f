"""Throughput of elastic-train vs the seed's bare DDP loop (benchmarks/bare_ddp.py).

Same model (small ViT), data (synthetic), global batch, optimizer and world size (2 CPU
processes under torchrun). The two are run alternately, REPEATS times, in this one invocation;
each run's throughput is the median over its epochs after the first (warm-up), and the ratio
reported is the median of the paired ratios. Target: >= 0.97.

    python benchmarks/overhead.py [--repeats 3] [--steps 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2"]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_TRAIN_FAULTS"):
        env.pop(key, None)
    return env


def _median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def bare(epochs: int, steps: int, batch: int) -> float:
    cmd = [
        *TORCHRUN,
        str(ROOT / "benchmarks" / "bare_ddp.py"),
        "--epochs",
        str(epochs),
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
    ]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=True, timeout=600).stdout
    return _median_after_warmup([json.loads(line)["throughput"] for line in out.splitlines() if line.startswith("{")])


def ours(epochs: int, steps: int, batch: int) -> float:
    with tempfile.TemporaryDirectory() as logs:
        cmd = [
            *TORCHRUN,
            "-m",
            "elastic_train",
            "--epochs",
            str(epochs),
            "--max-steps-per-epoch",
            str(steps),
            "--batch-size",
            str(batch),
            "--target-accuracy",
            "1.0",
            "--patience",
            "0",
            "--log-dir",
            logs,
            "--checkpoint-dir",
            str(Path(logs, "ckpt")),
        ]
        subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=True, timeout=600)
        lines = Path(logs, "metrics.jsonl").read_text().splitlines()
        return _median_after_warmup([json.loads(line)["throughput"] for line in lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    pairs = []
    for i in range(args.repeats):
        b = bare(args.epochs, args.steps, args.batch_size)
        o = ours(args.epochs, args.steps, args.batch_size)
        pairs.append((b, o))
        print(f"run {i + 1}: bare DDP {b:.1f} img/s, elastic-train {o:.1f} img/s, ratio {o / b:.3f}", flush=True)
    ratio = statistics.median(o / b for b, o in pairs)
    result = {
        "bare_img_s": statistics.median(b for b, _ in pairs),
        "elastic_train_img_s": statistics.median(o for _, o in pairs),
        "ratio": ratio,
        "pair_ratios": [o / b for b, o in pairs],
        "repeats": args.repeats,
        "target": 0.97,
    }
    print(
        f"overhead ratio (elastic-train / bare DDP throughput): {ratio:.3f} (median of {args.repeats}; target >= 0.97)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
