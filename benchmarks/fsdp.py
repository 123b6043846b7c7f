"""FSDP2 (``--parallel fsdp``) costs at 2 gloo ranks on the CPU, each against stock PyTorch in the same run.

Three measures, each a ratio of paired measurements taken in interleaved rounds (the order of
ours and the baseline alternating from round to round), reported as the median of the paired
ratios with its spread and, from 6 rounds on, its 95% distribution-free interval (order
statistics, binomial coverage: ``overhead.median_interval``):

* training throughput: elastic-train's own ``Trainer`` (built as ``run._train_in_group`` builds it:
  checkpointer, step boundary, watchdog, goodput tracker; ``--parallel fsdp``), each round one
  epoch of its loop (``Trainer.advance``: the steps, then the evaluation round, whose time and
  the epoch-end save's stay outside the epoch's training time, as in the Epoch line), against
  a bare FSDP2 loop of the same ViT, data, global batch, AdamW and
  shard units (``fully_shard`` per encoder block, then the root; DistributedSampler, DataLoader,
  cross-entropy, nothing else), both in one process group. Target >= 0.97.
* sharded save and load of an FSDP2 model + AdamW state (an MLP) against stock
  ``torch.distributed.checkpoint``: ours ``capture`` + ``Checkpointer.save(sync=True)`` (fsync,
  checksums, manifest and ``latest`` included) vs ``get_state_dict`` + ``dcp.save`` (its default
  ``FileSystemWriter``: fsync, one thread); loads into a fresh sharded model and optimizer,
  ours ``Checkpointer.resume`` (every file's size and xxh3 verified) + ``restore`` vs
  ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``; cold (page cache dropped) and warm.
  Targets: save bandwidth >= 1.0x DCP's, load time <= 1.0x DCP's.
* peak host memory per rank during our sharded save of a >= 1 GB state: the rise of each rank's
  resident set (VmHWM after resetting it through /proc/self/clear_refs, else a 2 ms VmRSS
  sampler) over its level before the save (free heap handed back to the OS first:
  ``malloc_trim``), for a synchronous save (written straight from the shard) and an
  asynchronous one (a CPU staging copy of the rank's shard first), against the bound
  (state bytes / ranks) + the writer's fixed 16 MiB buffer. Target <= 1.0.

    python benchmarks/fsdp.py [--quick] [--rounds 12] [--steps 8] [--save-mb 384] [--memory-mb 1152]
                              [--dir PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import CONFIDENCE, median_interval  # noqa: E402
from elastic_train.checkpoint.tensor_io import _CHUNK as WRITE_BUFFER  # noqa: E402
from elastic_train.distributed.env import DistEnv  # noqa: E402
from elastic_train.distributed.process_group import broadcast_json  # noqa: E402

WORLD = 2
WIDTH = 2048  # the MLP of the checkpoint measures: layers of WIDTH x WIDTH fp32 weights
CPU = torch.device("cpu")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CLEAR_REFS = Path("/proc/self/clear_refs")
TARGETS = {"throughput": 0.97, "save": 1.0, "load": 1.0, "memory": 1.0}
FULL = {"rounds": 12, "steps": 8, "batch": 128, "save_mb": 384, "memory_mb": 1152}
QUICK = {"rounds": 2, "steps": 4, "batch": 128, "save_mb": 96, "memory_mb": 192}


# ---------------------------------------------------------------------- helpers (every rank)
def env_of(rank: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD, run_id="bench-fsdp")


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def build_state(megabytes: int, seed: int, step: bool) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    """An MLP sharded by FSDP2 (one unit per layer) and its AdamW; with ``step``, one optimizer
    step on random gradients, so that both moments exist: parameters + moments = 3 x fp32."""
    from torch.distributed.tensor import DTensor

    from elastic_train.distributed.fsdp import mesh_for, shard_model

    layers = max(2, megabytes * (1 << 20) // (3 * 4 * WIDTH * WIDTH))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    shard_model(model, mesh_for(CPU, WORLD), blocks=list(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if step:
        for p in model.parameters():
            assert isinstance(p, DTensor)
            local = torch.randn_like(p.to_local())
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def global_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The whole state's bytes over all ranks (a DTensor's ``numel`` is its global one)."""
    return sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer))


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's share: its pieces of the sharded tensors, and the whole small ones."""
    return sum(_local(t).numel() * _local(t).element_size() for t in state_tensors(model, optimizer))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece; a plain tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def same_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, other: torch.nn.Module, other_opt: Any
) -> None:
    """``other`` holds exactly ``model``'s local pieces and AdamW moments (a load went right)."""
    for (name, want), got in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(_local(want), _local(got)), f"parameter {name} differs"
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = optimizer.state[want][key], other_opt.state[got][key]
            assert torch.equal(_local(a), _local(b)), f"optimizer {key} of {name} differs"


class Disk:
    """Between measurements: every rank's dirty pages written (``sync``), optionally the page
    cache dropped (``drop_caches`` where writable, else ``posix_fadvise(DONTNEED)`` per file)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        box = ["posix_fadvise(DONTNEED) on every checkpoint file (drop_caches is not writable here)"]
        if os.access(DROP_CACHES, os.W_OK):
            box = ["`sync; echo 3 > /proc/sys/vm/drop_caches` (this machine's whole page cache)"]
        self.method = str(broadcast_json(box[0], src=0))

    def clean(self, drop: list[Path] | None = None) -> None:
        gc.collect()
        dist.barrier()
        os.sync()
        if drop is not None and self.method.startswith("`sync"):
            if self.rank == 0:
                DROP_CACHES.write_text("3\n")
        elif drop is not None:
            for path in drop:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        dist.barrier()


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------- 1. training throughput
def throughput_phase(rank: int, folder: Path, s: dict[str, Any]) -> dict[str, Any]:
    """Rounds of one epoch of ``Trainer.advance`` and one bare FSDP2 epoch of as many steps."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from benchmarks.bare_ddp import timed_epoch
    from elastic_train.boundary import SavePolicy, StepBoundary
    from elastic_train.checkpoint.manager import Checkpointer
    from elastic_train.cli import parse_config
    from elastic_train.data import open_task_data
    from elastic_train.data.datasets import TensorImages
    from elastic_train.data.synthetic import synthetic
    from elastic_train.distributed.fsdp import default_blocks
    from elastic_train.distributed.process_group import ControlPlane, choose_placement
    from elastic_train.models import build_model
    from elastic_train.resilience.goodput import Accounting, ProgressTracker
    from elastic_train.resilience.watchdog import StepWatchdog
    from elastic_train.run_parts import checkpoint_config, choose_task, run_fingerprint
    from elastic_train.trainer import Trainer

    rounds, steps, batch = s["rounds"], s["steps"], s["batch"]
    cfg = parse_config(
        [
            *("--parallel", "fsdp", "--device", "cpu", "--threads", "1"),
            *("--batch-size", str(batch), "--epochs", str(rounds + 1), "--max-steps-per-epoch", str(steps)),
            *("--target-accuracy", "1.0", "--patience", "0"),
            # The watchdog sees no beat while the bare loop runs a round: well above a round's time.
            *("--hang-timeout", "900"),
            *("--log-dir", str(folder / "logs"), "--checkpoint-dir", str(folder / "ckpt")),
        ]
    )
    env = env_of(rank)
    placement = choose_placement("cpu", env)
    # Ours, built as run._train_in_group builds it (no stop signals: nothing sends any here).
    control = ControlPlane()
    task = choose_task(cfg)
    data = open_task_data(task, cfg, env)
    ck = Checkpointer(checkpoint_config(cfg), env, run_fingerprint(cfg, task, data.identify(), True), control.group)
    ck.start()
    assert ck.resume() is None
    watchdog = StepWatchdog(cfg.hang_timeout, rank, marker_dir=cfg.checkpoint_dir)
    ck.heartbeat = watchdog.alive
    policy = SavePolicy(cfg.checkpoint_every, cfg.checkpoint_every_seconds)
    boundary = StepBoundary(ck, control, policy, async_save=cfg.async_checkpoint, is_main=env.is_main)
    tracker = ProgressTracker(cfg.checkpoint_dir, Accounting(job_start=time.time()), enabled=env.is_main)
    trainer = Trainer(cfg, env, placement, task, data, None, boundary, watchdog, tracker)
    assert trainer.batches_per_epoch == steps
    trainer.strategy.start()
    watchdog.start()

    # The bare FSDP2 loop: the same model, units, data, global batch and optimizer.
    bundle = synthetic()
    assert isinstance(bundle.train, TensorImages)
    torch.manual_seed(cfg.seed)
    model = build_model("vit", bundle.num_classes, bundle.image_size)
    blocks = list(model.encoder.layers)  # type: ignore[union-attr, arg-type]
    assert [id(b) for b in default_blocks(model)] == [id(b) for b in blocks], "other units than shard_model's"
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.base_lr, weight_decay=cfg.weight_decay)
    dataset = TensorDataset(bundle.train.images, bundle.train.labels)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch // WORLD, sampler=sampler, drop_last=True)

    def bare_step(b: list[torch.Tensor]) -> int:
        x, y = b
        x = (x.float() / 255 - 0.5) / 0.5
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return int(x.shape[0]) * WORLD

    def bare(epoch: int) -> float:
        watchdog.beat(trainer.state.step, "bare loop")  # outside the timed window
        sampler.set_epoch(epoch)
        model.train()
        timed = timed_epoch(loader, steps, bare_step, lambda: None)
        return timed.images / slowest(timed.seconds)

    def ours(epoch: int) -> float:
        # The trainer's own loop for one epoch: its steps, then its evaluation round. The epoch
        # record's time is the training phase only (MAX over ranks, as the Epoch line reports it):
        # the clock restarts after evaluation and the epoch-end save.
        assert trainer.state.epoch == epoch
        trainer.restart_clock()
        while trainer.state.epoch == epoch:  # the last epoch's round ends the run (advance: False)
            trainer.advance()
        record = trainer.state.history[-1]
        assert record.samples_seen == steps * batch
        return record.samples_seen / record.epoch_time

    ours(0)  # untimed warm-ups: the first epoch of each allocates and faults in everything
    bare(0)
    out: dict[str, list[float]] = {"ours_img_s": [], "bare_img_s": []}
    for i in range(rounds):
        runs = [("ours_img_s", ours), ("bare_img_s", bare)][:: 1 if i % 2 == 0 else -1]
        for name, run in runs:
            dist.barrier()
            out[name].append(run(i + 1))
        if rank == 0:
            print(
                f"  throughput round {i + 1} ({runs[0][0].split('_')[0]} first): ours {out['ours_img_s'][-1]:.1f} "
                f"img/s, bare {out['bare_img_s'][-1]:.1f} img/s",
                flush=True,
            )
    watchdog.stop()
    trainer.close()
    ck.close()
    return out


# ---------------------------------------------------------------------- 2. save and load vs DCP
def checkpoint_phase(rank: int, folder: Path, s: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from elastic_train.checkpoint.format import latest_target
    from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
    from elastic_train.checkpoint.snapshot import Position, capture, restore

    env, rounds, megabytes = env_of(rank), s["rounds"], s["save_mb"]
    model, optimizer = build_state(megabytes, seed=0, step=True)
    disk = Disk(rank)
    fingerprint = {"bench": "fsdp"}
    ours_root = folder / "ours"

    def checkpointer() -> Checkpointer:
        ck = Checkpointer(CheckpointConfig(root=ours_root, keep_last=2), env, fingerprint)
        ck.start()
        return ck

    # ---- save: ours and DCP alternated, each after a sync of the other's dirty pages
    ck = checkpointer()

    def save_ours(step: int) -> float:
        start = time.perf_counter()
        assert ck.save(capture(Position(step), model, optimizer, device=CPU), sync=True)
        return slowest(time.perf_counter() - start)

    def save_dcp(name: str) -> float:
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / name)
        return slowest(time.perf_counter() - start)

    save_ours(1)  # untimed warm-ups (first-call costs, DCP's planning caches)
    save_dcp("dcp-0")
    saves: dict[str, list[float]] = {"ours_s": [], "dcp_s": []}
    for i in range(rounds):
        runs = [("ours_s", partial(save_ours, i + 2)), ("dcp_s", partial(save_dcp, f"dcp-{i + 1}"))]
        for name, run in runs[:: 1 if i % 2 == 0 else -1]:
            disk.clean()
            saves[name].append(run())
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder / f"dcp-{i}")
            print(f"  save round {i + 1}: ours {saves['ours_s'][-1]:.3f} s, DCP {saves['dcp_s'][-1]:.3f} s", flush=True)
    ck.close()
    newest = latest_target(ours_root)
    assert newest is not None
    dcp_dir = folder / f"dcp-{rounds}"
    ours_files, dcp_files = files_under(newest), files_under(dcp_dir)

    # ---- load into a fresh sharded model and optimizer (other weights, no optimizer state)
    def load_ours(cold: bool) -> tuple[float, float]:
        fresh, fresh_opt = build_state(megabytes, seed=1, step=False)
        lck = checkpointer()
        disk.clean(drop=ours_files if cold else None)
        start = time.perf_counter()
        loaded = lck.resume()
        assert loaded is not None and loaded.folder.resolve() == newest.resolve()
        restore(loaded, fresh, fresh_opt, rank=rank, world_size=WORLD, device=CPU)
        seconds = slowest(time.perf_counter() - start)
        del loaded
        lck.close()
        same_state(model, optimizer, fresh, fresh_opt)
        return seconds, 0.0

    def load_dcp(cold: bool) -> tuple[float, float]:
        fresh, fresh_opt = build_state(megabytes, seed=1, step=False)
        disk.clean(drop=dcp_files if cold else None)
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)  # builds the optimizer's state to load into
        prepared = time.perf_counter()
        dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_dir)  # into those tensors, in place
        set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        end = time.perf_counter()
        seconds, prepare = slowest(end - start), slowest(prepared - start)
        same_state(model, optimizer, fresh, fresh_opt)
        return seconds, prepare

    load_ours(cold=False)  # untimed warm-ups
    load_dcp(cold=False)
    loads: dict[str, list[float]] = {f"{c}_{w}": [] for c in ("cold", "warm") for w in ("ours_s", "dcp_s")}
    loads["cold_dcp_prepare_s"], loads["warm_dcp_prepare_s"] = [], []
    for i in range(rounds):
        contenders = [("ours_s", load_ours), ("dcp_s", load_dcp)]
        for name, load in contenders[:: 1 if i % 2 == 0 else -1]:
            for cache in ("cold", "warm"):  # warm: right after the cold load of the same files
                seconds, prepare = load(cache == "cold")
                loads[f"{cache}_{name}"].append(seconds)
                if name == "dcp_s":
                    loads[f"{cache}_dcp_prepare_s"].append(prepare)
        if rank == 0:
            shown = ", ".join(f"{k} {v[-1]:.3f}" for k, v in loads.items() if not k.endswith("prepare_s"))
            print(f"  load round {i + 1}: {shown}", flush=True)
    return {
        "state_bytes": global_bytes(model, optimizer),
        "ours_disk_bytes": sum(p.stat().st_size for p in ours_files),
        "dcp_disk_bytes": sum(p.stat().st_size for p in dcp_files),
        "save": saves,
        "load": loads,
        "cache_drop": disk.method,
    }


# ---------------------------------------------------------------------- 3. peak host memory of a save
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def release_free_memory() -> None:
    """Collect garbage and hand the allocator's free heap back to the OS (glibc ``malloc_trim``):
    freed buffers of an earlier save stay resident otherwise, and a later save reusing them would
    show no rise at all."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _can_reset_peak() -> bool:
    try:
        CLEAR_REFS.write_text("5")  # resets VmHWM (the peak resident set) to the current VmRSS
    except OSError:
        return False
    return True


@contextmanager
def peak_rss(reset: bool) -> Iterator[Callable[[], int]]:
    """The peak resident set while the block runs: VmHWM after a reset, else a 2 ms sampler."""
    if reset:
        CLEAR_REFS.write_text("5")
        yield lambda: _status_kb("VmHWM") * 1024
        return
    peak = [rss_bytes()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], rss_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield lambda: peak[0]
    finally:
        stop.set()
        thread.join()


def memory_phase(rank: int, folder: Path, s: dict[str, Any]) -> dict[str, Any]:
    from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
    from elastic_train.checkpoint.snapshot import Position, capture

    env, rounds = env_of(rank), s["rounds"]
    model, optimizer = build_state(s["memory_mb"], seed=0, step=True)
    disk = Disk(rank)
    reset = _can_reset_peak()
    steps = iter(range(1, 10**6))

    def measure(sync: bool) -> dict[str, float]:
        # A fresh checkpointer: an async save allocates its staging buffers (the first save's cost).
        ck = Checkpointer(CheckpointConfig(root=folder / "memory", keep_last=1), env, {"bench": "fsdp"})
        ck.start()
        disk.clean()
        release_free_memory()
        before = rss_bytes()
        start = time.perf_counter()
        with peak_rss(reset) as peak:
            snap = capture(Position(next(steps)), model, optimizer, device=CPU)
            ok = ck.save(snap, sync=sync)
            if not sync:
                ck.wait_staged()
                ok = ck.commit_pending()
            assert ok
            top = peak()
        seconds = slowest(time.perf_counter() - start)
        held = rss_bytes() - before  # still resident after the commit (async: the staging buffers)
        del snap
        ck.close()
        del ck
        gc.collect()
        return {"rise": float(top - before), "held": float(held), "seconds": seconds}

    out: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for i in range(rounds):
        for mode in ("sync", "async")[:: 1 if i % 2 == 0 else -1]:
            out[mode].append(measure(sync=mode == "sync"))
        if rank == 0:
            print(
                f"  memory round {i + 1}: rank 0 peak rise sync {out['sync'][-1]['rise'] / 2**20:.0f} MiB, "
                f"async {out['async'][-1]['rise'] / 2**20:.0f} MiB",
                flush=True,
            )
    return {
        "state_bytes": global_bytes(model, optimizer),
        "local_bytes": local_bytes(model, optimizer),
        "peak_method": "VmHWM reset through /proc/self/clear_refs" if reset else "VmRSS sampled every 2 ms",
        **out,
    }


# ---------------------------------------------------------------------- the process group
PHASES: dict[str, Callable[[int, Path, dict[str, Any]], dict[str, Any]]] = {
    "throughput": throughput_phase,
    "checkpoint": checkpoint_phase,
    "memory": memory_phase,
}


def worker(rank: int, phase: str, folder: str, settings: dict[str, Any]) -> None:
    import structlog

    # One compute thread per rank (2 ranks, 2 cores); the library's warnings and errors only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    work = Path(folder) / phase
    work.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store-{phase}", rank=rank, world_size=WORLD, timeout=timedelta(minutes=10)
    )
    try:
        result = PHASES[phase](rank, work, settings)
        (Path(folder) / f"{phase}-{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_group(phase: str, folder: Path, settings: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Both ranks of ``phase`` in fresh spawned processes; every one is ended before this returns:
    a failed rank's peer (waiting in a collective) and anything past ``timeout`` are terminated."""
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(rank, phase, str(folder), settings), name=f"fsdp-{phase}-{rank}")
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(15)
    codes = [p.exitcode for p in procs]
    if timed_out:
        raise SystemExit(f"{phase}: still running after {timeout:.0f} s; stopped (exit codes {codes})")
    if any(codes):
        raise SystemExit(f"{phase}: the ranks failed (exit codes {codes}); see the lines above")
    return [json.loads((folder / f"{phase}-{rank}.json").read_text()) for rank in range(WORLD)]


# ---------------------------------------------------------------------- analysis
def summary(ratios: list[float], target: float, higher_is_better: bool) -> dict[str, Any]:
    """The median of the paired ratios, their spread, the 95% interval of the median, the verdict."""
    ratio = statistics.median(ratios)
    interval = median_interval(ratios)
    return {
        "ratio": ratio,
        "ratios": ratios,
        "spread": [min(ratios), max(ratios)],
        "interval": [interval[0], interval[1]] if interval else None,
        "interval_coverage": interval[2] if interval else None,
        "target": target,
        "met": ratio >= target if higher_is_better else ratio <= target,
    }


def method_texts(s: dict[str, Any], cache_drop: str, peak_method: str) -> dict[str, str]:
    rounds = f"{s['rounds']} interleaved rounds (the order alternating)"
    return {
        "throughput": (
            f"{rounds} in one process group of {WORLD} gloo ranks (1 thread each): one epoch of "
            f"{s['steps']} steps of elastic-train's one loop (`Trainer.advance`; `--parallel fsdp`, built as a run "
            "builds it: checkpointer, step boundary, watchdog, goodput tracker; no save due) vs "
            f"{s['steps']} steps of a bare FSDP2 loop (`fully_shard` per encoder block + root, AdamW, "
            "cross-entropy, DistributedSampler + DataLoader), same ViT, synthetic data and global batch "
            f"{s['batch']}; each epoch's time MAX-reduced over ranks; after one untimed epoch of each"
        ),
        "save": (
            f"{rounds}, {WORLD} ranks each writing its pieces: ours `capture` + `Checkpointer.save(sync=True)` "
            "(fsync, sha256 + xxh3, manifest and `latest`) vs `get_state_dict` + `dcp.save` (default "
            "`FileSystemWriter`: fsync, 1 thread), same state, same disk; `sync` before each, slowest rank; "
            "bandwidth ratio = DCP's time / ours; after one untimed save of each"
        ),
        "load": (
            f"{rounds}, into a fresh FSDP2 model + AdamW (other weights, no optimizer state): ours "
            "`Checkpointer.resume` (rank 0 verifies every file's size and xxh3, each rank reads its "
            "pieces) + `restore` vs `get_state_dict` (builds the optimizer state to load into) + `dcp.load` "
            f"+ `set_state_dict`; slowest rank; cold = page cache dropped before ({cache_drop}), warm = "
            "right after the cold load of the same files; both results checked equal to the saved state"
        ),
        "memory": (
            f"{rounds}, sync and async alternated: each rank's resident-set rise during one save "
            f"(`capture` to commit, a fresh `Checkpointer` each time) over its level just before, free heap "
            f"handed back to the OS first (`malloc_trim`) ({peak_method}); "
            "the worst rank / ((state bytes / ranks) + the writer's 16 MiB buffer)"
        ),
    }


def summarise(results: dict[str, list[dict[str, Any]]], s: dict[str, Any]) -> dict[str, Any]:
    t, c = results["throughput"][0], results["checkpoint"][0]
    mem = results["memory"]
    save, load = c["save"], c["load"]
    texts = method_texts(s, c["cache_drop"], mem[0]["peak_method"])
    state = c["state_bytes"]
    out: dict[str, Any] = {
        "ranks": WORLD,
        "rounds": s["rounds"],
        "confidence": CONFIDENCE,
        "throughput": {
            "ours_img_s": statistics.median(t["ours_img_s"]),
            "bare_img_s": statistics.median(t["bare_img_s"]),
            "ours_runs": t["ours_img_s"],
            "bare_runs": t["bare_img_s"],
            "steps": s["steps"],
            "batch": s["batch"],
            **summary(
                [o / b for o, b in zip(t["ours_img_s"], t["bare_img_s"], strict=True)], TARGETS["throughput"], True
            ),
            "method": texts["throughput"],
        },
        "save": {
            "state_bytes": state,
            "ours_disk_bytes": c["ours_disk_bytes"],
            "dcp_disk_bytes": c["dcp_disk_bytes"],
            "ours_s": statistics.median(save["ours_s"]),
            "dcp_s": statistics.median(save["dcp_s"]),
            "ours_mb_s": state / statistics.median(save["ours_s"]) / 1e6,
            "dcp_mb_s": state / statistics.median(save["dcp_s"]) / 1e6,
            "ours_runs_s": save["ours_s"],
            "dcp_runs_s": save["dcp_s"],
            **summary([d / o for o, d in zip(save["ours_s"], save["dcp_s"], strict=True)], TARGETS["save"], True),
            "method": texts["save"],
        },
        "load": {"state_bytes": state, "cache_drop": c["cache_drop"], "method": texts["load"]},
    }
    for cache in ("cold", "warm"):
        ours, base, prep = load[f"{cache}_ours_s"], load[f"{cache}_dcp_s"], load[f"{cache}_dcp_prepare_s"]
        out["load"][cache] = {
            "ours_s": statistics.median(ours),
            "dcp_s": statistics.median(base),
            "dcp_prepare_s": statistics.median(prep),
            "ours_runs_s": ours,
            "dcp_runs_s": base,
            **summary([o / d for o, d in zip(ours, base, strict=True)], TARGETS["load"], False),
            # Against dcp.load + set_state_dict alone (the optimizer state to load into built untimed).
            "ratio_without_prepare": statistics.median(o / (d - p) for o, d, p in zip(ours, base, prep, strict=True)),
        }
    mem_state = mem[0]["state_bytes"]
    bound = mem_state / WORLD + WRITE_BUFFER
    out["memory"] = {
        "state_bytes": mem_state,
        "local_bytes": [r["local_bytes"] for r in mem],
        "buffer_bytes": WRITE_BUFFER,
        "bound_bytes": bound,
        "peak_method": mem[0]["peak_method"],
        "method": texts["memory"],
    }
    for mode in ("sync", "async"):
        worst = [max(r[mode][i]["rise"] for r in mem) for i in range(s["rounds"])]
        out["memory"][mode] = {
            "rise_bytes": statistics.median(worst),
            "rise_runs_bytes": worst,
            "rise_by_rank_bytes": [statistics.median(x["rise"] for x in r[mode]) for r in mem],
            "held_bytes": statistics.median(max(r[mode][i]["held"] for r in mem) for i in range(s["rounds"])),
            "save_s": statistics.median(r[mode][i]["seconds"] for r in mem[:1] for i in range(s["rounds"])),
            **summary([w / bound for w in worst], TARGETS["memory"], False),
        }
    return out


VERDICT = {True: "met", False: "NOT MET"}


def shown(x: dict[str, Any]) -> str:
    spread = f"spread [{x['spread'][0]:.3f}, {x['spread'][1]:.3f}]"
    if x["interval"]:
        low, high = x["interval"]
        return f"{spread}, 95% interval [{low:.3f}, {high:.3f}] (coverage {x['interval_coverage']:.3f})"
    return f"{spread}, no 95% interval (< 6 rounds)"


def report(r: dict[str, Any]) -> None:
    t, sv, ld, m = r["throughput"], r["save"], r["load"], r["memory"]
    print(f"\nthroughput: {t['method']}")
    print(
        f"  ours {t['ours_img_s']:.1f} img/s vs bare FSDP2 {t['bare_img_s']:.1f} img/s -> median paired ratio "
        f"{t['ratio']:.3f}, {shown(t)}; target >= {t['target']}: {VERDICT[t['met']]}"
    )
    print(f"\nsave ({sv['state_bytes'] / 1e6:.0f} MB state): {sv['method']}")
    print(
        f"  ours {sv['ours_mb_s']:.0f} MB/s ({sv['ours_s']:.3f} s) vs DCP {sv['dcp_mb_s']:.0f} MB/s "
        f"({sv['dcp_s']:.3f} s) -> bandwidth ratio {sv['ratio']:.3f}, {shown(sv)}; "
        f"target >= {sv['target']}: {VERDICT[sv['met']]}"
    )
    print(f"\nload: {ld['method']}")
    for cache in ("cold", "warm"):
        x = ld[cache]
        print(
            f"  {cache}: ours {x['ours_s']:.3f} s vs DCP {x['dcp_s']:.3f} s (of which get_state_dict "
            f"{x['dcp_prepare_s']:.3f} s) -> time ratio {x['ratio']:.3f}, {shown(x)}; target <= {x['target']}: "
            f"{VERDICT[x['met']]}; without get_state_dict: {x['ratio_without_prepare']:.3f}"
        )
    print(f"\npeak memory ({m['state_bytes'] / 1e9:.2f} GB state): {m['method']}")
    for mode in ("sync", "async"):
        x = m[mode]
        print(
            f"  {mode}: peak rise {x['rise_bytes'] / 2**20:.0f} MiB (worst rank) vs bound "
            f"{m['bound_bytes'] / 2**20:.0f} MiB -> ratio {x['ratio']:.3f}, {shown(x)}; "
            f"target <= {x['target']}: {VERDICT[x['met']]}; "
            f"held after the commit {x['held_bytes'] / 2**20:.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and 2 rounds: a pipeline check")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per measure (12; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per throughput epoch (8; quick 4)")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch of the throughput measure (128)")
    parser.add_argument("--save-mb", type=int, default=None, help="state of the save/load measure, MiB (384; quick 96)")
    parser.add_argument(
        "--memory-mb", type=int, default=None, help="state of the memory measure, MiB (1152; quick 192)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per phase before its ranks are stopped")
    parser.add_argument("--json", "--out", dest="json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    for key, value in (
        ("rounds", args.rounds),
        ("steps", args.steps),
        ("batch", args.batch_size),
        ("save_mb", args.save_mb),
        ("memory_mb", args.memory_mb),
    ):
        if value is not None:
            settings[key] = value
    timeout = args.timeout or (600.0 if args.quick else 1500.0)
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned ranks inherit it
    started = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-fsdp-") as tmp:
        for phase in PHASES:
            print(f"== {phase}", flush=True)
            began = time.monotonic()
            results[phase] = run_group(phase, Path(tmp), settings, timeout)
            print(f"== {phase}: {time.monotonic() - began:.0f} s", flush=True)
    out = summarise(results, settings)
    out.update(
        quick=args.quick,
        settings=settings,
        seconds=time.monotonic() - started,
        load_average=list(os.getloadavg()),  # other work on the machine shows here (this run alone: ~2)
        machine=machine(),
    )
    report(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


def machine() -> str:
    from benchmarks.suite import machine as describe

    return describe()


if __name__ == "__main__":
    main()
