"""What the tests share: the trainer launched as a test runs it, and what a finished run left.

The process primitives (run and reap in a session of its own, the child's environment) live in
``elastic_train.testing.processes`` because the benchmarks and the two-agent harness use them
too; they are re-exported here so that a test imports its helpers from one place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_train.checkpoint.format import latest_target
from elastic_train.testing.processes import (
    ROOT,
    TOKEN_VAR,
    Finished,
    base_env,
    free_port,
    group_alive,
    kill_group,
    kill_tagged,
    no_core_dumps,
    pid_alive,
    read_jsonl,
    run,
    tagged,
)

__all__ = [
    "BIN",
    "QUICK",
    "RESUME_RUN",
    "ROOT",
    "SEED_EPOCH_LINE",
    "TOKEN_VAR",
    "VAL",
    "Finished",
    "assert_bitwise_equal",
    "base_env",
    "cli",
    "cli_process",
    "dirs",
    "epoch_metrics",
    "events",
    "final_state",
    "flags",
    "free_port",
    "group_alive",
    "kill_group",
    "kill_tagged",
    "load_chaos",
    "pid_alive",
    "ranks",
    "read_jsonl",
    "reference_run",
    "resume_run_at_2",
    "run",
    "run_ranks",
    "shared_once",
    "spawn_ranks",
    "state_summary",
    "summary_drift",
    "tagged",
    "torchrun",
    "wait_all",
]

BIN = Path(sys.executable).parent
# Validation on 64 of the synthetic set's 1024 samples: a full pass costs a 2-epoch quick run
# more CPU than its training steps, and the tests judge the runtime, not the model. The full set
# is evaluated where the test is about evaluation (the seed's pinned results, tests/process/test_cli.py).
VAL = ["--max-val-samples", "64"]
# Small, fast settings shared by the process-level tests.
QUICK = ["--batch-size", "32", "--max-steps-per-epoch", "3", "--epochs", "2", "--target-accuracy", "1.0", *VAL]
# The short run, checkpointed every 2 steps, that the kill-and-resume tests (one process, torchrun,
# the launcher, the report) compare with an uninterrupted run of the same flags.
RESUME_RUN = [
    "--batch-size",
    "32",
    "--max-steps-per-epoch",
    "4",
    "--epochs",
    "2",
    "--target-accuracy",
    "1.0",
    "--patience",
    "0",
    "--checkpoint-every",
    "2",
    *VAL,
]
# The seed's per-epoch console line, which the trainer must keep printing unchanged.
SEED_EPOCH_LINE = re.compile(
    r"^Epoch \d+/\d+: time=\d+\.\d{3}s, train_loss=\d+\.\d{4}, train_acc=\d\.\d{4}, "
    r"val_loss=\d+\.\d{4}, val_acc=\d\.\d{4}, throughput=\d+\.\d img/s$"
)


def load_chaos() -> Any:
    """``jobs/chaos.py`` as a module (a job script, not a package module): its kill schedule and
    its ``workers(match)``, the processes a launcher started for ``-m elastic_train``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos", ROOT / "jobs" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags(**values: object) -> list[str]:
    """Trainer flags from keywords: flags(batch_size=32) == ["--batch-size", "32"]."""
    return [item for name, value in values.items() for item in (f"--{name.replace('_', '-')}", str(value))]


def cli(args: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None) -> Finished:
    """``python -m elastic_train ARGS`` run to its end in a process of its own, as a real
    subprocess would be (its own session, environment, folder and exit code; unbuffered output;
    its threads joined and its exit handlers run), but forked from a server that imported torch
    once per pytest worker (``_forkserver``): a fresh interpreter spent ~3 s of CPU importing
    torch and the ``torch._dynamo`` an optimizer's construction loads, most of a small run's cost
    on a 2-core machine. What only a fresh interpreter shows (the ``__main__`` module, a Ctrl-C
    during start-up) needs ``cli_process`` or a real ``Popen``, as the Ctrl-C tests
    (tests/process/test_interrupt.py) use."""
    (done,) = _forked_runs([base_env(env)], args, timeout)
    return done


def run_ranks(
    world_size: int, args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> list[Finished]:
    """``ranks``'s processes (the environment torchrun would set, no agent) run to their end,
    forked as ``cli``'s are; by rank."""
    port = free_port()  # one store for the group
    envs = [base_env({**_rank_env(rank, world_size, port), **(env or {})}) for rank in range(world_size)]
    return _forked_runs(envs, args, timeout)


def reference_run(
    world_size: int, args: Sequence[str], timeout: float = 180, env: Mapping[str, str] | None = None
) -> None:
    """A fault-free run that a faulted one is compared with, by ``world_size`` forked ranks
    (``run_ranks``) rather than torchrun: what the workers compute does not depend on the agent,
    and torchrun's agent and fresh interpreters cost ~11 s of CPU more for 2 ranks on 2 cores.
    Fails unless every rank exits 0 and leaves nothing behind."""
    done = run_ranks(world_size, args, timeout, env)
    assert all(d.returncode == 0 and not d.leftovers for d in done), "\n".join(d.output[-3000:] for d in done)


@dataclass
class _Forked:
    """A forked ``python -m elastic_train`` (``_cli_child``), with the part of ``subprocess.Popen``'s
    interface the rank tests use: ``pid`` (also its session), ``args``, ``poll``, ``wait``,
    ``send_signal``, ``communicate``, ``returncode`` (negative: the signal that ended it)."""

    proc: Any
    env: dict[str, str]
    out: Path
    err: Path
    args: list[str]

    @classmethod
    def make(cls, env: dict[str, str], args: Sequence[str], folder: Path, name: str) -> _Forked:
        out, err = folder / f"{name}.stdout", folder / f"{name}.stderr"
        proc = _forkserver().Process(target=_cli_child, args=(env, str(ROOT), list(args), str(out), str(err)))
        return cls(proc, env, out, err, [sys.executable, "-m", "elastic_train", *args])

    def output(self) -> tuple[str, str]:
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: nothing is sent to a process known to be gone
            os.kill(self.pid, signum)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()

    def end(self) -> bool:
        """SIGKILL its session and whatever carries its environment's tag; True if any of it was
        still there (a run must not leave processes behind)."""
        token = self.env[TOKEN_VAR]
        leftovers = group_alive(self.pid) or bool(tagged(token))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        kill_tagged(token)
        self.proc.kill()
        self.proc.join()
        return leftovers


def _forked_runs(envs: Sequence[dict[str, str]], args: Sequence[str], timeout: float) -> list[Finished]:
    """One forked ``python -m elastic_train ARGS`` per environment in ``envs``, all at once, each
    to its end; fails when any is still running after ``timeout`` (then all are ended)."""
    start = time.monotonic()
    argv = [sys.executable, "-m", "elastic_train", *args]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_Forked.make(env, args, Path(tmp), str(i)) for i, env in enumerate(envs)]
        leftovers = [False] * len(runs)
        try:
            for run_ in runs:
                run_.proc.start()
            deadline = start + timeout
            for run_ in runs:
                run_.proc.join(max(0.1, deadline - time.monotonic()))
            alive = [run_ for run_ in runs if run_.proc.is_alive()]
            if alive:
                # The trainer enabled faulthandler: SIGABRT prints every thread's stack to stderr.
                for run_ in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(run_.proc.pid, signal.SIGABRT)
                for run_ in alive:
                    run_.proc.join(3.0)
                told = "\n".join(f"--- stdout\n{o}\n--- stderr\n{e}" for o, e in (r.output() for r in runs))
                sessions = ", ".join(str(r.proc.pid) for r in alive)
                raise AssertionError(
                    f"{len(alive)} of {len(runs)} still running after {timeout}s: {' '.join(argv)} (sessions "
                    f"{sessions}, ended)\n(SIGABRT sent first: their Python stacks are in stderr)\n{told}"
                )
        finally:
            # What each started (DataLoader workers: its session; anything with its environment)
            # must not outlive it, as with ``run``.
            for i, run_ in enumerate(runs):
                if run_.proc.pid is not None:  # else never started (a start before it failed)
                    leftovers[i] = run_.end()
        seconds = time.monotonic() - start
        return [
            Finished(argv, r.proc.exitcode, *r.output(), seconds, gone) for r, gone in zip(runs, leftovers, strict=True)
        ]


def cli_process(args: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None) -> Finished:
    """``python -m elastic_train ARGS`` in a fresh interpreter (``cli`` forks a warm one)."""
    return run([sys.executable, "-m", "elastic_train", *args], timeout, env)


def _forkserver() -> Any:
    """This process's forkserver, started (on first use) with torch, its distributed package and
    ``torch._dynamo`` imported (and this module, with what it imports of elastic_train: no module
    of the package reads the environment when imported, so a child that takes its environment
    after the fork sees what a fresh interpreter would)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    # tests.helpers: the module of the children's targets (each child would import it anyway).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "tests.helpers"])
    return ctx


def _cli_child(env: dict[str, str], cwd: str, args: list[str], out: str, err: str) -> None:
    """``cli``'s child: a session of its own, the caller's environment and folder, its output
    unbuffered into ``out`` and ``err``; exits as the interpreter would after ``sys.exit(main())``."""
    import atexit
    import io
    import threading
    import traceback

    os.setsid()
    no_core_dumps()
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    # PYTHONUNBUFFERED=1, as base_env asks of a fresh interpreter: a SIGKILLed run keeps its lines.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True, errors="backslashreplace"
    )
    _take_place(env, cwd)
    # A fresh ``python -m`` puts its folder and then PYTHONPATH's at the head of sys.path (a
    # plug-in task in a test's folder is imported from there).
    sys.path[:0] = [cwd, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.argv = [str(ROOT / "elastic_train" / "__main__.py"), *args]
    code: int = 1
    try:
        from elastic_train.cli import main

        code = main(args)
    except SystemExit as exc:  # the interpreter's rule: None is 0, a number itself, anything else printed and 1
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # what the interpreter would print before exiting 1
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter joins non-daemon threads first
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def elastic_torchrun(rdzv_id: str) -> list[str]:
    """The mission's elastic torchrun on one node: ``--nnodes=1:2 --max-restarts=3`` over c10d."""
    return [
        str(BIN / "torchrun"),
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=last_call_timeout=1",  # one node: form the round without waiting for a second
    ]


def torchrun(
    torchrun_args: Sequence[str], args: Sequence[str], timeout: float = 180, env: Mapping[str, str] | None = None
) -> Finished:
    return run([str(BIN / "torchrun"), *torchrun_args, "-m", "elastic_train", *args], timeout, env)


@contextmanager
def ranks(world_size: int, args: Sequence[str], env: Mapping[str, str] | None = None) -> Iterator[list[_Forked]]:
    """Start ``world_size`` ranks of ``python -m elastic_train ARGS`` with the environment torchrun
    would set (no agent), forked as ``cli``'s runs are, each in its own session; Popen-like
    (``_Forked``). Whatever is left of them is killed when the block ends."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs: list[_Forked] = []
        try:
            for rank in range(world_size):
                rank_env = base_env({**_rank_env(rank, world_size, port), **(env or {})})
                procs.append(_Forked.make(rank_env, args, Path(tmp), f"rank{rank}"))
                procs[-1].proc.start()
            yield procs
        finally:
            for proc in procs:
                if proc.proc.pid is not None:
                    proc.end()


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets for rank ``rank`` of one node, its store at ``port`` on loopback."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def wait_all(procs: Sequence[_Forked], timeout: float) -> list[Finished]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_group(p)
            raise AssertionError(f"rank process {proc.args} still running after {timeout}s") from None
        results.append(Finished(list(map(str, proc.args)), proc.returncode, out, err, 0.0))
    return results


def events(log_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(log_dir / f"rank-{rank}.jsonl") if e.get("event") == name]


def spawn_ranks(target: Any, world_size: int, args: tuple[Any, ...], timeout: float) -> None:
    """Run ``target(rank, world_size, init_file, *args)`` in ``world_size`` new processes (forked
    from a forkserver, below).

    Fails if any exits non-zero or the group is still running after ``timeout`` (then all are
    killed). ``target`` must be importable (a module-level function).
    """
    # Forked from a server that imported torch once (per pytest worker), not spawned: a spawned
    # rank spent ~2.5 s of CPU importing torch, most of a small test's cost on a 2-core machine.
    # The server's environment and folder are its start's, so each rank takes this call's.
    ctx = _forkserver()
    place = (dict(os.environ), os.getcwd(), target)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_in_place, args=(*place, r, world_size, init_file, *args)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
            alive = [p for p in procs if p.is_alive()]
            assert not alive, f"{len(alive)} rank(s) still running after {timeout}s"
            codes = [p.exitcode for p in procs]
            assert codes == [0] * world_size, f"rank exit codes {codes}"
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()


def _in_place(env: dict[str, str], cwd: str, target: Any, *args: Any) -> None:
    """``target(*args)`` in the caller's environment and folder (a forked rank of ``spawn_ranks``)."""
    _take_place(env, cwd)
    target(*args)


def _take_place(env: dict[str, str], cwd: str) -> None:
    """In a child of ``_forkserver``: the caller's environment and folder (the server's are those
    of its own start), and the platform's start method, as a process the caller started would
    have (a forkserver's child inherits "forkserver": the trainer's DataLoader workers would come
    from a server of their own instead of being forked from it)."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def dirs(base: Path) -> list[str]:
    """The trainer flags that put a run's logs and checkpoints under ``base``."""
    return ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt")]


def final_state(base: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest checkpoint, whoever wrote them (the pieces of
    a sharded one assembled whole)."""
    from elastic_train.checkpoint.manager import load

    folder = latest_target(base / "ckpt")
    assert folder is not None
    return {k: v for k, v in load(folder).whole().items() if k.startswith(("model.", "optim."))}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def epoch_metrics(base: Path) -> list[dict[str, Any]]:
    """Each epoch's metrics that must not depend on restarts (no timings)."""
    keep = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "samples_seen", "sample_digest")
    return [{k: m[k] for k in keep} for m in read_jsonl(base / "logs" / "metrics.jsonl")]


def planned_samples(
    num_samples: int, global_batch: int, epochs: int, max_steps: int | None = None, seed: int = 42
) -> list[tuple[int, int, str]]:
    """Every epoch's (1-based epoch, samples, sample digest) as the sampler plans them: what an
    exactly-once run of any world size must report in ``metrics.jsonl``, computed without training
    (the global batches depend only on the seed, the epoch and the dataset's size)."""
    from elastic_train.data.sampler import global_batches
    from elastic_train.metrics import format_digest, index_digest

    planned = []
    for epoch in range(epochs):
        batches = global_batches(num_samples, global_batch, seed, epoch, max_steps)
        planned.append((epoch + 1, int(batches.numel()), format_digest(index_digest(batches))))
    return planned


def state_hash(checkpoints: Path, prefixes: tuple[str, ...] = ("model.",)) -> str:
    """sha256 of the ``latest`` checkpoint's tensors under ``prefixes`` (name without the
    prefix, dtype, shape, bytes; by name): equal hashes mean bitwise-equal state."""
    import hashlib

    import torch

    from elastic_train.checkpoint.manager import load

    folder = (checkpoints / "latest").resolve()
    tensors = {k: v for k, v in load(folder).whole().items() if k.startswith(prefixes)}
    assert tensors, f"no tensors under {prefixes} in {folder}"
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].contiguous()
        short = name.split(".", 1)[1] if name.startswith("model.") else name
        digest.update(f"{short}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def shared_once(tmp_path_factory: Any, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that ``build`` filled once for the whole test session, whichever pytest-xdist
    worker asks first (the others wait on a file lock): e.g. one fault-free reference run for
    every test file that compares with it. A failed build is retried by the next caller."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, shared by its workers (never an older session's)
    done = base / f"shared-{name}.done"
    with (base / f"shared-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if done.exists():
                return Path(done.read_text())
            folder = Path(tempfile.mkdtemp(prefix=f"shared-{name}-", dir=base))
            build(folder)
            done.write_text(str(folder))
            return folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resume_run_at_2(tmp_path_factory: Any) -> Path:
    """``RESUME_RUN`` through by 2 ranks (``reference_run``), once a session: the uninterrupted
    run that the kill-and-resume tests of torchrun and the warm launcher compare with."""

    def build(base: Path) -> None:
        reference_run(2, [*RESUME_RUN, *dirs(base)])

    return shared_once(tmp_path_factory, "resume-run-at-2", build)


# A compact, portable summary of trained weights (tests/process/test_seed_path_pinned.py): per
# floating tensor its element count, float64 sum, sum of absolute values and sum of squares; an
# integer tensor (BatchNorm's step counter) by its exact values.
Summary = dict[str, list[float] | list[int]]
SUMMARY_STATS = ("sum", "abs_sum", "sum_sq")


def state_summary(checkpoints: Path, prefixes: tuple[str, ...] = ("model.",)) -> Summary:
    """The ``latest`` checkpoint's tensors under ``prefixes``, summarised by ``Summary``'s rule."""
    from elastic_train.checkpoint.manager import load

    folder = (checkpoints / "latest").resolve()
    tensors = {k: v for k, v in load(folder).whole().items() if k.startswith(prefixes)}
    assert tensors, f"no tensors under {prefixes} in {folder}"
    summary: Summary = {}
    for name in sorted(tensors):
        value = tensors[name]
        if not value.is_floating_point():
            summary[name] = [int(v) for v in value.flatten().tolist()]
            continue
        x = value.detach().double().flatten()
        summary[name] = [float(x.numel()), x.sum().item(), x.abs().sum().item(), x.pow(2).sum().item()]
    return summary


def summary_drift(reference: Summary, got: Summary) -> dict[str, float]:
    """How far ``got`` is from ``reference``, per statistic, as the largest over the tensors of:
    the change of the sum and of the abs-sum over ``n * rms`` (the reference tensor's element
    count times its root mean square: 1.0 is every element moved by its typical size), and the
    relative change of the sum of squares. ``int_mismatch`` is 1.0 when an integer tensor
    differs at all. A different tensor set is an ``AssertionError`` naming the difference."""
    assert reference.keys() == got.keys(), (
        f"tensor names differ: missing {sorted(reference.keys() - got.keys())[:5]}, "
        f"extra {sorted(got.keys() - reference.keys())[:5]}"
    )
    drift = dict.fromkeys((*SUMMARY_STATS, "int_mismatch"), 0.0)
    for name, ref in reference.items():
        new = got[name]
        if all(isinstance(v, int) for v in ref):
            drift["int_mismatch"] = max(drift["int_mismatch"], float(ref != new))
            continue
        assert len(new) == 4 and new[0] == ref[0], f"{name}: {new[0]} elements, the reference has {ref[0]}"
        count, total, abs_total, squares = ref
        scale = max(count * (squares / count) ** 0.5, 1e-30)
        drift["sum"] = max(drift["sum"], abs(new[1] - total) / scale)
        drift["abs_sum"] = max(drift["abs_sum"], abs(new[2] - abs_total) / scale)
        drift["sum_sq"] = max(drift["sum_sq"], abs(new[3] - squares) / max(squares, 1e-30))
    return drift


def start_line_now(ledger: Any, lineage: int, origin: Any) -> None:
    """``LineLedger.start`` without its watch of a line ahead of the origin (watched for twice
    the record's ``quiet_s``: microseconds between a test's claims): the start of a new line."""
    from unittest import mock

    from elastic_train.quorum import line

    with mock.patch.object(line, "MIN_WATCH_S", 0.0):
        deadline = time.monotonic() + 10
        while not ledger.start(lineage, origin):
            assert time.monotonic() < deadline, "the start of a line kept watching"
            time.sleep(0.001)
