"""``python -m elastic_train.launch``: torchrun with warm worker starts.

    python -m elastic_train.launch [torchrun flags] -m elastic_train [trainer flags]

The same agent, the same c10d rendezvous, the same flags and the same restart semantics as
``torchrun`` (this module parses its arguments with torchrun's own parser and hands them to
torch's ``elastic_launch``). One thing differs: torchrun starts every worker, and every restarted
worker, as a fresh Python interpreter that imports torch, torchvision and the trainer again. Here
the workers are forked from multiprocessing's *forkserver*, a helper process the agent starts
once and that has those modules imported already (a preload). A restart then skips the
interpreter start-up and the imports: on the 2-core test machine about 3.5 s of the ~7.5 s a
worker restart costs (see docs/benchmarks.md).

What stays the same for the worker: the environment torchrun sets (RANK, WORLD_SIZE,
MASTER_ADDR, ...), signals (the agent forwards SIGTERM/SIGUSR1/SIGUSR2 to the worker's pid), exit
codes (75 preempted, 124 hung, 2 bad input), ``@record`` error files and the failure summary.
Each worker sits in a session of its own, as torchrun's do, so a Ctrl-C in the terminal reaches
the agent only, which forwards it once; the workers checkpoint the step and exit 130, and this
launcher exits 130 too (a second Ctrl-C ends everything at once).
The forkserver imports torch but never touches CUDA, so forked workers can use it.

Only the trainer can be launched this way (``-m elastic_train``): that is what is preloaded.

One default differs, for elastic node ranges (``--nnodes=1:2``): the rendezvous' last call is 5 s,
not torch's 30 s, unless ``--rdzv-conf`` sets ``last_call_timeout`` (see ``with_short_last_call``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any, NoReturn

# Imported by the forkserver once; a forked worker finds them in memory.
PRELOAD = ["torch", "torchvision", "elastic_train.run", "elastic_train.models", "elastic_train.data"]


def worker(*argv: str) -> None:
    """A worker's entry point (in a process forked from the preloaded forkserver)."""
    from elastic_train.cli import main

    # Out of the terminal's process group: a Ctrl-C arrives once, forwarded by the agent (the
    # trainer reads a second SIGINT as a second Ctrl-C).
    os.setsid()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # torchrun runs python -u
    code = main(list(argv))
    if code:
        sys.exit(code)  # torch's wrapper re-raises a non-zero SystemExit: the process exits with it
    queue = _return_queue()
    if queue is not None:
        _hand_in_and_exit(queue)


def _return_queue() -> Any:
    """The queue torch's ``_wrap`` (the function its multiprocessing context runs in each worker)
    puts this worker's return value on, found on the stack; None when not called from it."""
    from torch.distributed.elastic.multiprocessing import api

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is api._wrap.__code__:
            return frame.f_locals.get("ret_val_")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _hand_in_and_exit(queue: Any) -> NoReturn:
    """Give torch's agent this worker's return value and exit without waiting for the agent.

    After the entry point returns, ``_wrap`` puts its value on ``queue`` and waits on an Event
    until the agent has read every worker's. The agent's ``Event.set()`` waits in turn until every
    waiting worker has woken, so a worker SIGKILLed in that wait (an OOM kill, an operator; the
    goodput soak's last kill on Dec 7, just as the run finished) leaves the agent blocked in
    ``set()`` forever, past its workers' exit (torch's own comment on ``_worker_finished_event``
    says so). Nothing needs the wait here: the value is None, written at once (a ``SimpleQueue``
    has no feeder thread), and a dead worker's value stays readable in the pipe. So this worker
    puts it and exits as multiprocessing's bootstrap would after its target; the Event never has a
    sleeper and the agent's ``set()`` returns at once."""
    from multiprocessing import util

    queue.put(None)
    try:
        util._exit_function()  # type: ignore[attr-defined]  # the process's finalizers, its children
    finally:
        shutdown = getattr(threading, "_shutdown", None)  # joins non-daemon threads, as at exit
        if shutdown is not None:
            shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):  # C's stdio too (torch's --redirects files): _wrap's exit would
            ctypes.CDLL(None).fflush(None)
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_launch)(argv) or 0


def _launch(argv: Sequence[str] | None) -> int:
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(list(sys.argv[1:] if argv is None else argv))  # type: ignore[no-untyped-call]
    if not (args.module and args.training_script == "elastic_train") or args.no_python:
        print(
            "elastic_train.launch: error: it launches the trainer only: "
            "python -m elastic_train.launch [torchrun flags] -m elastic_train [trainer flags] "
            "(use torchrun for anything else)",
            file=sys.stderr,
        )
        return 2
    if args.standalone:  # as torchrun does: a private c10d rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.rdzv_conf = with_short_last_call(args.nnodes, args.rdzv_conf)
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    # The agent logs a worker's failure with its traceback, and torch's log formatter imports
    # torch._dynamo (and sympy) to format it: ~2 s of CPU on the first failure, on the recovery's
    # critical path. Import it now, in the background, while the first workers start.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
    multiprocessing.set_forkserver_preload(PRELOAD)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(config=config, entrypoint=worker)(*args.training_script_args)
    except SignalException as exc:
        # The agent forwarded the signal and waited for its workers (torch's shutdown): they
        # checkpointed the step. Exit as the shell reports the signal, without a traceback.
        print(f"elastic_train.launch: stopped by {signal.Signals(exc.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        _stop_helpers()
    return 0


# torch waits this long (default 30 s) for more nodes once an elastic range's minimum is there, at
# the start and at every restart: with --nnodes=1:2 on one node, every recovery paid it.
SHORT_LAST_CALL_S = 5


def with_short_last_call(nnodes: str, rdzv_conf: str) -> str:
    """``--rdzv-conf`` with ``last_call_timeout`` of ``SHORT_LAST_CALL_S`` for an elastic node
    range (``MIN:MAX`` with MIN < MAX), unless the user set one. A fixed node count has no last call."""
    low, _, high = nnodes.partition(":")
    if not high or low == high or "last_call_timeout" in rdzv_conf:
        return rdzv_conf
    extra = f"last_call_timeout={SHORT_LAST_CALL_S}"
    return f"{rdzv_conf},{extra}" if rdzv_conf else extra


def _stop_helpers() -> None:
    """Wait for the forkserver and the resource tracker to exit with us, not seconds later.

    They would exit by themselves when this process closes its end of their pipes, but tearing
    down an interpreter that imported torch takes a while: a job step (or a test) that ends
    while they still run would see stray processes. The forkserver is SIGKILLed first: it holds
    nothing (its workers are separate processes, already ended or signalled by now), and its
    orderly exit, torch's teardown, took 1.3 s of every launch's wall clock on two cores.
    """
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver  # type: ignore[attr-defined]
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for helper in (server, resource_tracker._resource_tracker):  # type: ignore[attr-defined]
        stop = getattr(helper, "_stop", None)  # CPython's own clean-up hook (3.8+): closes, reaps
        if stop is not None:
            with contextlib.suppress(Exception):  # best effort: they exit by themselves anyway
                stop()


if __name__ == "__main__":
    sys.exit(main())
