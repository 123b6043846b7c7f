"""Checkpoint costs on a >= 1 GB training state (an MLP + AdamW moments), 2 gloo ranks under DDP.

Each against a baseline measured in the same run, on the same disk, printed beside its method:

* save bandwidth: a synchronous sharded save (each rank writes its shard in parallel; fsync,
  manifest and ``latest`` included; the slowest rank's time) against as many parallel
  ``dd if=/dev/zero ... conv=fsync`` streams as writing ranks, each writing its rank's shard size
  (the same total bytes, the same disk), each measurement from a clean page cache (``sync``),
  the two alternated. Target >= 0.7.
* load until the state is inside the model and optimizer: ``elastic_train`` (manifest, read and
  verify size + xxh3-128 of every shard, ``restore``) against ``safetensors.torch.load_file`` of
  the same shard files + ``load_state_dict`` of model and optimizer, with a cold page cache
  (dropped before each measurement) and a warm one; the ranks start together after a barrier
  and the slowest rank's time counts. Target <= 1.2, both caches.
* stall: DDP training with an async save every ``--every`` steps; the time lost over the whole
  window a save overlaps (from the step boundary that starts it to one step after its commit):
  the window's wall time - its steps x the median time of a step with no save in flight,
  divided by the time a synchronous save of the same state blocks training. Target <= 0.10.

    python benchmarks/checkpoint.py [--mb 1152] [--repeats 5] [--saves 5] [--every 12] [--dir PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_train.boundary import SavePolicy, StepBoundary  # noqa: E402
from elastic_train.checkpoint.format import latest_target, read_manifest, shard_name, step_folders  # noqa: E402
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer, load  # noqa: E402
from elastic_train.checkpoint.snapshot import Position, Snapshot, capture, restore  # noqa: E402
from elastic_train.checkpoint.state import load_state_dicts, unflatten  # noqa: E402
from elastic_train.distributed.env import DistEnv  # noqa: E402
from elastic_train.distributed.process_group import ControlPlane, broadcast_json  # noqa: E402

WORLD = 2
WIDTH = 2048
BATCH = 32  # per rank
CPU = torch.device("cpu")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
TAIL_STEPS = 1  # steps after a commit still counted in its window (the purge of old checkpoints)

METHODS = {
    "save": (
        "synchronous sharded save, {ranks} ranks each writing its shard in parallel (fsync, manifest and "
        "`latest` included; slowest rank) vs {ranks} parallel `dd if=/dev/zero bs=4M conv=fsync` streams, "
        "one per rank, each of its rank's shard size (same total bytes, same disk); each from a clean "
        "page cache (`sync`), alternated, after one untimed save"
    ),
    "load": (
        "until the state is in the model and optimizer, every rank loading the whole state: ours (manifest, "
        "read + verify size and xxh3-128 of every shard, `restore`) vs `safetensors.torch.load_file` of the "
        "same shards + `load_state_dict` of model and optimizer (no verification); barrier, then the slowest "
        "rank's time; cold = page cache dropped before each measurement ({cache_drop}), warm = after an "
        "untimed load of the same kind"
    ),
    "stall": (
        "DDP training ({ranks} ranks, AdamW, batch {batch}/rank) with an async save every {every} steps "
        "through the trainer's step boundary; per save, over the whole window it overlaps (the step that "
        "starts it to {tail} step after its commit): window wall time - its steps x the median step time with "
        "no save in flight (rank 0's clock; DDP keeps the ranks in step), / the median synchronous save time "
        "of the same state (the save-bandwidth measurement); first save not counted (it allocates the staging "
        "buffers)"
    ),
}


def build_state(megabytes: int) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    # AdamW keeps two moments per parameter: parameters + state = 3 x fp32 per parameter.
    layers = max(1, megabytes * (1 << 20) // (3 * 4) // (WIDTH * WIDTH))
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    for p in module.parameters():  # one step, so that the moments exist and hold random bytes
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return module, optimizer


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


@dataclass
class Cycle:
    """One training step and the step boundary after it, on rank 0's clock."""

    total_s: float
    blocked_s: float  # the optimizer step's wait for staging + the boundary (save start, commit, votes)
    saved: bool  # an async save started at this boundary
    committed: bool  # the save in flight committed at this boundary


class Worker:
    def __init__(self, rank: int, folder: Path, megabytes: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.rank, self.folder = rank, folder
        self.module, self.optimizer = build_state(megabytes)
        self.model = DistributedDataParallel(self.module, gradient_as_bucket_view=True)
        self.env = DistEnv(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD, run_id="bench")
        self.cache_drop = self._cache_drop_method()

    def snapshot(self, step: int) -> Snapshot:
        # What the trainer hands to a save: the public ``capture`` (tensors by flat key, RNG streams).
        return capture(Position(step, 0, step), self.module, self.optimizer, device=CPU)

    def checkpointer(self, name: str, keep_last: int) -> Checkpointer:
        ck = Checkpointer(CheckpointConfig(root=self.folder / name, keep_last=keep_last), self.env, {"bench": 1})
        ck.start()
        return ck

    def _cache_drop_method(self) -> str:
        """``drop_caches`` where this process may write it (root here), else per-file fadvise."""
        box = ["posix_fadvise(DONTNEED) on the shard files (drop_caches is not writable)"]
        if self.rank == 0 and os.access(DROP_CACHES, os.W_OK):
            box = ["`sync; echo 3 > /proc/sys/vm/drop_caches`"]
        return str(broadcast_json(box[0], src=0))

    def clean(self, drop: list[Path] | None = None) -> None:
        """Between measurements: no dirty pages left; with ``drop``, those files out of the page cache."""
        dist.barrier()
        os.sync()
        if drop is not None and self.cache_drop.startswith("`sync"):
            if self.rank == 0:
                DROP_CACHES.write_text("3\n")
        elif drop is not None:
            for path in drop:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        dist.barrier()

    def save_phase(self, repeats: int) -> dict[str, list[float]]:
        ck = self.checkpointer("save", keep_last=repeats + 2)  # old ones removed below, untimed
        assert ck.save(self.snapshot(0), sync=True)  # untimed: every rank's shard size, a warm writer
        newest = latest_target(ck.cfg.root)
        assert newest is not None
        shard = (newest / shard_name(self.rank, WORLD)).stat().st_size
        out: dict[str, list[float]] = {"ours_s": [], "dd_s": [], "torch_save_s": [], "bytes": []}
        for i in range(repeats):
            ours = partial(self.timed_save, ck, i + 1)
            dd = partial(self.timed_dd, shard)
            for name, measure in [("ours_s", ours), ("dd_s", dd)][:: 1 if i % 2 == 0 else -1]:
                self.clean()
                out[name].append(measure())
            newest = latest_target(ck.cfg.root)
            assert newest is not None
            out["bytes"].append(sum(p.stat().st_size for p in newest.iterdir()))
            self.clean()
            out["torch_save_s"].append(self.timed_torch_save())
            if self.rank == 0:  # keep the newest checkpoint only (the load phase reads it)
                for old in step_folders(ck.cfg.root)[1:]:
                    shutil.rmtree(old)
        ck.close()
        return out

    def timed_save(self, ck: Checkpointer, step: int) -> float:
        start = time.perf_counter()
        assert ck.save(self.snapshot(step), sync=True)
        return slowest(time.perf_counter() - start)

    def timed_dd(self, size: int) -> float:
        target = self.folder / f"dd-{self.rank}.bin"
        cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={size}", "iflag=count_bytes", "conv=fsync"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        seconds = slowest(time.perf_counter() - start)
        target.unlink()
        return seconds

    def timed_torch_save(self) -> float:
        """Context for the stall: one rank writing the whole state with ``torch.save`` + fsync."""
        seconds = 0.0
        if self.rank == 0:
            target = self.folder / "torch.pt"
            start = time.perf_counter()
            with target.open("wb") as fh:
                torch.save({"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            seconds = time.perf_counter() - start
            target.unlink()
        dist.barrier()
        return seconds

    def load_phase(self, repeats: int) -> dict[str, list[float]]:
        folder = latest_target(self.folder / "save")
        assert folder is not None
        manifest = read_manifest(folder)
        files = [folder / name for name in manifest.files]
        saved = next(self.module.parameters()).detach().clone()
        contenders = [
            ("ours", partial(self.load_ours, folder)),
            ("baseline", partial(self.load_baseline, files, manifest.payload.optimizer, "mmap")),
            ("eager", partial(self.load_baseline, files, manifest.payload.optimizer, "pread")),
        ]
        out: dict[str, list[float]] = {f"{c}_{w}_s": [] for c in ("cold", "warm") for w, _ in contenders}
        for i in range(repeats):
            for cache in ("cold", "warm"):
                for who, fn in contenders[i % 3 :] + contenders[: i % 3]:  # each goes first in turn
                    if cache == "warm":
                        fn()  # untimed: the files are in the page cache afterwards
                        self.own_memory()
                    self.clean(drop=files if cache == "cold" else None)
                    start = time.perf_counter()
                    fn()
                    out[f"{cache}_{who}_s"].append(slowest(time.perf_counter() - start))
                    assert torch.equal(next(self.module.parameters()), saved), f"{who} loaded other weights"
                    self.own_memory()
        return out

    def own_memory(self) -> None:
        """Copy the optimizer's loaded tensors out of the file mappings both loaders leave them
        in: a mapped page survives drop_caches, and the next cold measurement would find it."""
        for per_param in self.optimizer.state.values():
            for name, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    per_param[name] = value.clone()

    def load_ours(self, folder: Path) -> None:
        restore(load(folder), self.module, self.optimizer, rank=self.rank, world_size=WORLD, device=CPU)

    def load_baseline(self, files: list[Path], optimizer_meta: dict[str, Any], backend: str) -> None:
        """safetensors' own loader. Its default ``mmap`` backend maps the files: what
        ``load_state_dict`` does not copy (the optimizer's moments) is read at first use, after
        the timer; ``pread`` reads every byte now, as our verification does."""
        import safetensors.torch

        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            tensors.update(safetensors.torch.load_file(path, backend=backend))
        model_sd, optim_sd = unflatten(tensors, optimizer_meta)
        load_state_dicts(self.module, self.optimizer, model_sd, optim_sd)

    def stall_phase(self, saves: int, every: int) -> list[Cycle]:
        """Train with an async save every ``every`` steps, through the trainer's own boundary."""
        ck = self.checkpointer("stall", keep_last=2)
        boundary = StepBoundary(ck, ControlPlane(), SavePolicy(every_steps=every))
        cycles = []
        for step in range(1, (saves + 2) * every):  # saves + 1 saves, the first a warm-up
            start = time.perf_counter()
            x = torch.randn(BATCH, WIDTH)
            self.model(x).square().mean().backward()
            wait = time.perf_counter()
            ck.wait_staged()
            waited = time.perf_counter() - wait
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            edge = time.perf_counter()
            decision = boundary.after_step(step, partial(self.snapshot, step))
            end = time.perf_counter()
            cycles.append(Cycle(end - start, waited + end - edge, decision.saved, decision.committed))
        if ck.pending:
            ck.commit_pending()
        ck.close()
        return cycles


def worker(rank: int, folder: str, args: dict[str, int], out: str) -> None:
    import structlog

    # One compute thread per rank (2 ranks, 2 cores); the checkpointer's warnings and errors only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    w = Worker(rank, Path(folder), args["mb"])
    save = w.save_phase(args["repeats"])
    loads = w.load_phase(args["repeats"])
    cycles = w.stall_phase(args["saves"], args["every"])
    if rank == 0:
        raw = {"save": save, "load": loads, "cycles": [asdict(c) for c in cycles], "cache_drop": w.cache_drop}
        Path(out).write_text(json.dumps(raw))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- analysis (rank 0's results)
@dataclass(frozen=True)
class Window:
    steps: int
    wall_s: float
    lost_s: float  # wall - steps x the median quiet step
    blocked_s: float  # the part of ``lost_s`` spent waiting (staging, save start, commit, votes)


def stall_windows(cycles: list[Cycle]) -> tuple[list[Window], list[Cycle]]:
    """Each counted save's window, and the steps with no save in flight (the reference)."""
    spans: list[range] = []
    for start, cycle in enumerate(cycles):
        if cycle.saved:
            end = next((j for j in range(start + 1, len(cycles)) if cycles[j].committed), None)
            if end is None or (spans and spans[-1].stop > start):
                raise SystemExit("a save was still in flight when the next one began: raise --every")
            spans.append(range(start, min(len(cycles), end + 1 + TAIL_STEPS)))
    busy = {i for span in spans for i in span}
    quiet = [c for i, c in enumerate(cycles) if i >= spans[0].stop and i not in busy]
    if len(quiet) < 5:
        raise SystemExit(f"only {len(quiet)} steps ran with no save in flight: raise --every")
    step = statistics.median(c.total_s for c in quiet)
    waits = statistics.median(c.blocked_s for c in quiet)
    windows = []
    for span in spans[1:]:  # the first save allocates the staging buffers: a warm-up
        wall = sum(cycles[i].total_s for i in span)
        blocked = sum(cycles[i].blocked_s for i in span)
        windows.append(Window(len(span), wall, wall - len(span) * step, blocked - len(span) * waits))
    return windows, quiet


def paired(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def summarise(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    save, loads = raw["save"], raw["load"]
    size = statistics.median(save["bytes"])
    fmt = {"ranks": WORLD, "batch": BATCH, "every": args.every, "tail": TAIL_STEPS, "cache_drop": raw["cache_drop"]}
    caches = {
        cache: {
            "ours_s": statistics.median(loads[f"{cache}_ours_s"]),
            "baseline_s": statistics.median(loads[f"{cache}_baseline_s"]),
            "eager_s": statistics.median(loads[f"{cache}_eager_s"]),
            "ratio": paired(loads[f"{cache}_ours_s"], loads[f"{cache}_baseline_s"]),
            "eager_ratio": paired(loads[f"{cache}_ours_s"], loads[f"{cache}_eager_s"]),
        }
        for cache in ("cold", "warm")
    }
    windows, quiet = stall_windows([Cycle(**c) for c in raw["cycles"]])
    step_s = statistics.median(c.total_s for c in quiet)
    sync_s = statistics.median(save["ours_s"])
    lost_s = statistics.median(w.lost_s for w in windows)
    return {
        "state_bytes": size,
        "state_mb": size / 1e6,
        "ranks": WORLD,
        "repeats": args.repeats,
        "save": {
            "ours_s": sync_s,
            "dd_s": statistics.median(save["dd_s"]),
            "ours_mb_s": size / sync_s / 1e6,
            "dd_mb_s": size / statistics.median(save["dd_s"]) / 1e6,
            "ratio": paired(save["dd_s"], save["ours_s"]),  # bandwidth ratio: ours / dd
            "target": 0.7,
            "method": METHODS["save"].format(**fmt),
        },
        "load": {**caches, "target": 1.2, "cache_drop": raw["cache_drop"], "method": METHODS["load"].format(**fmt)},
        "stall": {
            "saves": len(windows),
            "every_steps": args.every,
            "step_s": step_s,
            "step_quartiles_s": statistics.quantiles([c.total_s for c in quiet], n=4),  # the noise in step_s
            "window_steps": statistics.median(w.steps for w in windows),
            "window_s": statistics.median(w.wall_s for w in windows),
            "window_step_s": sum(w.wall_s for w in windows) / sum(w.steps for w in windows),
            "lost_s": lost_s,
            "lost_per_save_s": [w.lost_s for w in windows],
            "blocked_s": statistics.median(w.blocked_s for w in windows),
            "sync_save_s": sync_s,
            "torch_save_s": statistics.median(save["torch_save_s"]),
            "ratio": lost_s / sync_s,
            "target": 0.10,
            "method": METHODS["stall"].format(**fmt),
        },
    }


VERDICT = {True: "met", False: "NOT MET"}


def report(s: dict[str, Any]) -> None:
    save, load_, stall = s["save"], s["load"], s["stall"]
    print(f"state: {s['state_mb']:.0f} MB (model + AdamW moments) on {s['ranks']} gloo ranks; {s['repeats']} repeats")
    print(f"\nsave bandwidth: {save['method']}")
    print(
        f"  ours {save['ours_mb_s']:.0f} MB/s ({save['ours_s']:.2f} s) vs dd {save['dd_mb_s']:.0f} MB/s "
        f"({save['dd_s']:.2f} s) -> median paired ratio {save['ratio']:.2f} (target >= 0.7: "
        f"{VERDICT[save['ratio'] >= save['target']]})"
    )
    print(f"\nload: {load_['method']}")
    for cache in ("cold", "warm"):
        c = load_[cache]
        print(
            f"  {cache}: ours {c['ours_s']:.3f} s vs load_file {c['baseline_s']:.3f} s -> median paired ratio "
            f"{c['ratio']:.2f} (target <= 1.2: {VERDICT[c['ratio'] <= load_['target']]}); "
            f"vs load_file(backend='pread') {c['eager_s']:.3f} s -> {c['eager_ratio']:.2f}"
        )
    print(f"\nstall: {stall['method']}")
    print(
        f"  a step: {stall['step_s']:.3f} s with no save in flight (quartiles "
        f"{', '.join(f'{q:.3f}' for q in stall['step_quartiles_s'])}), {stall['window_step_s']:.3f} s inside a window "
        f"(median window {stall['window_steps']:.0f} steps, {stall['window_s']:.2f} s)\n"
        f"  lost per save {stall['lost_s']:.3f} s (of which waiting {stall['blocked_s']:.3f} s; per save: "
        f"{', '.join(f'{x:.3f}' for x in stall['lost_per_save_s'])}) vs a synchronous save "
        f"{stall['sync_save_s']:.3f} s -> ratio {stall['ratio']:.3f} (target <= 0.10: "
        f"{VERDICT[stall['ratio'] <= stall['target']]}); torch.save + fsync on one rank: {stall['torch_save_s']:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1152, help="training state size in MiB (default: 1.2 GB)")
    parser.add_argument("--repeats", type=int, default=5, help="paired save and load measurements")
    parser.add_argument("--saves", type=int, default=5, help="async saves measured in the stall phase")
    parser.add_argument("--every", type=int, default=12, help="steps between async saves in the stall phase")
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = Path(tmp) / "results.json"
        settings = {"mb": args.mb, "repeats": args.repeats, "saves": args.saves, "every": args.every}
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, tmp, settings, str(out))) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"benchmark workers failed: exit codes {[p.exitcode for p in procs]}")
        summary = summarise(json.loads(out.read_text()), args)
    summary["load_average"] = list(os.getloadavg())  # other work shows here (this run alone: ~2)
    report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
