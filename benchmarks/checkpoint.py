"""Checkpoint costs on a ~200 MB training state (model + AdamW), 2 gloo ranks, one run.

Prints three ratios, each against a baseline measured in the same run on the same disk:

* stall: training time blocked per async save (snapshot + hand-off + the later commit)
  / a synchronous ``torch.save`` + fsync of the same state. Target <= 0.10.
* save bandwidth: bytes of a synchronous sharded save (both ranks writing in parallel, commit
  included) / its wall time, over ``dd ... conv=fsync`` bandwidth. Target >= 0.7.
* load: ``elastic_train`` load (read, verify size and xxh3-128 of every shard, set the state)
  / ``torch.load(weights_only=True)`` of the same state, both with a warm page cache. Target <= 1.2.

    python benchmarks/checkpoint.py [--mb 200] [--repeats 5] [--dir /path/on/the/disk] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_state(megabytes: int) -> tuple[Any, Any]:
    import torch

    # AdamW keeps two moments per parameter: parameters + state = 3 x fp32 per parameter.
    params = megabytes * (1 << 20) // (3 * 4)
    width = 2048
    layers = max(1, params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def train_step(model: Any, optimizer: Any, checkpointer: Any) -> float:
    """One real training step; returns how long its optimizer step waited for staging."""
    import torch

    x = torch.randn(32, model[0].in_features)
    model(x).square().mean().backward()
    start = time.perf_counter()
    checkpointer.wait_staged()
    waited = time.perf_counter() - start
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return waited


def dd_seconds(folder: Path, megabytes: int) -> float:
    target = folder / "dd.bin"
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={max(1, megabytes // 4)}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - start
    target.unlink()
    return seconds


def worker(rank: int, world: int, init_file: str, folder: str, megabytes: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from elastic_train.checkpoint.format import latest_target
    from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer, load
    from elastic_train.checkpoint.snapshot import Position, Snapshot, capture, restore
    from elastic_train.distributed.env import DistEnv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, optimizer = build_state(megabytes)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, run_id="bench", launched=True)
    ratios: dict[str, list[float]] = {"stall": [], "save_bw": [], "load": []}
    raw: dict[str, list[float]] = {
        "dd_mb_s": [],
        "save_mb_s": [],
        "torch_save_s": [],
        "stall_s": [],
        "load_s": [],
        "torch_load_s": [],
    }

    cpu = torch.device("cpu")

    def snapshot(step: int) -> Snapshot:
        # What the trainer hands to a save: the public ``capture`` (tensors by flat key, RNG streams).
        return capture(Position(step, 0, step), model, optimizer, device=cpu)

    def clean() -> None:
        dist.barrier()
        os.sync()  # every measurement starts with no dirty pages from the previous one
        dist.barrier()

    def timed_save(ck: Checkpointer, step: int) -> float:
        start = time.perf_counter()
        assert ck.save(snapshot(step), sync=True)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for i in range(repeats):
        root = Path(folder) / f"run{i}"
        ck = Checkpointer(CheckpointConfig(root=root, keep_last=2), env, {"bench": 1})
        ck.start()
        # 1. Save bandwidth: a synchronous sharded save, both ranks writing their halves in parallel,
        #    against dd with fsync writing the same number of bytes, each from a clean page cache.
        clean()
        seconds = timed_save(ck, 10 * i + 1)
        newest = latest_target(root)
        assert newest is not None
        size = sum(p.stat().st_size for p in newest.iterdir())
        clean()
        dd = dd_seconds(Path(folder), size >> 20) if rank == 0 else 0.0
        # 2. The baseline an async save is compared with: torch.save + fsync of the whole state.
        clean()
        torch_save = 0.0
        if rank == 0:
            start = time.perf_counter()
            with (Path(folder) / "torch.pt").open("wb") as fh:
                torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            torch_save = time.perf_counter() - start
        # 3. Async: training waits for the snapshot + hand-off, then for the commit at a later step.
        #    Measured on the second async save: a run's first save also allocates the staging
        #    buffers that every later save reuses.
        for step in (10 * i + 2, 10 * i + 3):
            clean()
            start = time.perf_counter()
            ck.save(snapshot(step), sync=False)
            stall = time.perf_counter() - start
            # Training goes on: the next step's forward and backward overlap the staging copy;
            # the optimizer step waits for it (counted), then steps run until the shard is durable.
            while True:
                stall += train_step(model, optimizer, ck)
                if ck.local_done():
                    break
            dist.barrier()  # the step boundary at which every rank reports its shard durable
            start = time.perf_counter()
            ck.commit_pending()
            stall += time.perf_counter() - start
        ck.close()
        # 4. Load until the state is inside the model and optimizer, warm page cache, both ways.
        newest = latest_target(root)
        assert newest is not None
        state = torch.load(Path(folder) / "torch.pt", weights_only=True) if rank == 0 else None
        del state
        start = time.perf_counter()
        if rank == 0:
            state = torch.load(Path(folder) / "torch.pt", weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
        torch_load = time.perf_counter() - start
        load(newest)
        start = time.perf_counter()
        loaded = load(newest)
        restore(loaded, model, optimizer, rank=rank, world_size=world, device=cpu)
        ours_load = time.perf_counter() - start
        if rank == 0:
            raw["dd_mb_s"].append(size / dd / 1e6)
            raw["save_mb_s"].append(size / seconds / 1e6)
            raw["torch_save_s"].append(torch_save)
            raw["stall_s"].append(stall)
            raw["load_s"].append(ours_load)
            raw["torch_load_s"].append(torch_load)
            ratios["save_bw"].append(dd / seconds)
            ratios["stall"].append(stall / torch_save)
            ratios["load"].append(ours_load / torch_load)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"ratios": ratios, "raw": raw, "bytes": size}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="training state size in MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        out = folder / "results.json"
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=worker, args=(r, 2, str(folder / "store"), str(folder), args.mb, args.repeats, str(out)))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"benchmark workers failed: {[p.exitcode for p in procs]}")
        data = json.loads(out.read_text())
    ratio = {k: statistics.median(v) for k, v in data["ratios"].items()}
    raw = {k: statistics.median(v) for k, v in data["raw"].items()}
    summary = {
        "state_mb": data["bytes"] / 1e6,
        "repeats": args.repeats,
        **{f"{k}_ratio": v for k, v in ratio.items()},
        **raw,
    }
    print(f"state: {data['bytes'] / 1e6:.0f} MB (model + AdamW) on 2 gloo ranks; medians of {args.repeats} paired runs")
    print(
        f"stall per async save: {raw['stall_s']:.3f} s vs sync torch.save+fsync {raw['torch_save_s']:.3f} s "
        f"-> ratio {ratio['stall']:.3f} (target <= 0.10)"
    )
    print(
        f"save bandwidth: {raw['save_mb_s']:.0f} MB/s vs dd with fsync {raw['dd_mb_s']:.0f} MB/s "
        f"-> ratio {ratio['save_bw']:.3f} (target >= 0.7)"
    )
    print(
        f"load into model+optimizer: {raw['load_s']:.3f} s vs torch.load {raw['torch_load_s']:.3f} s "
        f"-> ratio {ratio['load']:.3f} (target <= 1.2)"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
