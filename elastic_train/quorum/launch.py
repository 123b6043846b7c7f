"""``python -m elastic_train.quorum.launch``: the agent of quorum mode (``--ft quorum``).

    python -m elastic_train.quorum.launch --nproc-per-node 2 --max-restarts 3 -m elastic_train [trainer flags]

What torchrun's agent does for a group of workers, this agent does for each replica group
alone: when a group's worker fails only that group is restarted (torchrun would stop every
worker of the node and restart them all from the checkpoint). The survivors keep training; the
new group heals from one of them. Workers are forked warm from multiprocessing's forkserver,
which imported torch, torchft and the trainer once, so a restart skips the interpreter start-up
and the imports (``elastic_train.launch`` does the same for torchrun).

* ``--procs-per-replica K`` (default 1): each replica group is K workers with DDP or FSDP2
  (``--parallel``) inside it, the quorum across the groups (torchft's fault-tolerant HSDP
  shape). ``--nproc-per-node`` counts groups: a node runs N x K workers. The group's workers
  meet in a store this agent hosts (``MASTER_ADDR``/``MASTER_PORT``, a new one for each attempt
  of the group, as torchrun's agent does, on a port the kernel chose: no other process can hold
  it); when one of them fails, the others are SIGKILLed (a SIGTERM would be a preemption to the
  trainer) and the group restarts.

* ``--lighthouse URL``: the quorum's Lighthouse. Without it, node 0's agent starts one on this
  host for the job's lifetime (``--lighthouse-port``: a free one on one node, 29510 on several;
  bound to loopback on one node, else to this host's advertised address), and every other node
  must be given its URL (``jobs/`` passes node 0's address). A port another process listens on
  is refused (exit 2), and the Lighthouse dies with this agent (``quorum.lighthouse``).
* ``--lighthouse-etcd HOST:PORT,...``: no node owns the Lighthouse. Every agent is a candidate
  for its seat, a lease in the job's etcd (``quorum.seat``; the members of
  ``python -m elastic_train.etcd_member``); the holder runs it on ``--lighthouse-port`` (default:
  a free port; the seat's record carries the address), and when its node dies or freezes another
  agent takes the seat after ``--lighthouse-ttl`` seconds and runs it there. Workers reach it
  through a relay on this agent (``quorum.forward``); quorum ids carry the seat's term
  (``quorum.term``). An agent starts its workers once a Lighthouse holds the seat, and exits 1
  if none does within ``--lighthouse-wait`` seconds.
* The job's identity: every worker gets the job id (``--run-id``, else Slurm's, else a new one)
  in ``ELASTIC_TRAIN_QUORUM_JOB`` and the job's secret in ``ELASTIC_TRAIN_QUORUM_SECRET`` (minted
  here on one node; several nodes need one value for every agent, from the environment). A
  replica refuses a quorum with another job's replicas, and serves its state only to requests
  signed with the secret (docs/fault-tolerance.md, "Trust and ownership").
* ``--nnodes`` / ``--node-rank``: replica groups are numbered ``node_rank * nproc + local``.
* ``--max-restarts`` counts per replica group: a group past it stays down; the others go on.
* SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT are forwarded to every worker (they agree on a step,
  participant 0 checkpoints it, all exit 75/76/130) and nothing is restarted afterwards. A
  Ctrl-C in the terminal reaches the workers (in this agent's process group) and the agent's
  copy within milliseconds: one press; a second press ends them at once.
* Exit status: 0 when a worker finished the training (every replica's finish is the same
  training); 75/76/130 when stopped by a signal; 2 on bad input; otherwise the last failure's code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from types import FrameType
from typing import Any

from elastic_train.errors import UsageError
from elastic_train.etcd_member import EtcdError
from elastic_train.outcome import ExitCode
from elastic_train.quorum import identity
from elastic_train.quorum.forward import Forwarder, Route
from elastic_train.quorum.lighthouse import Lighthouse, LighthouseConfig, LighthousePortTaken, _check_port_free
from elastic_train.quorum.names import (
    GROUPS_VAR,
    HOST_VAR,
    JOB_VAR,
    LAUNCHER_THREADS_VAR,
    LINE_VAR,
    SECRET_VAR,
    WARM_ARGV_VAR,
)
from elastic_train.quorum.seat import Holder, Seat, SeatConfig
from elastic_train.quorum.term import TERM_FILE_VAR, write_term

ETCD_VAR = "ELASTIC_TRAIN_LIGHTHOUSE_ETCD"
FENCE_POLL_S = 0.02  # how often the fence thread looks at the seat's lease

# Imported by the forkserver once; a forked worker finds them in memory.
# The last one opens the task's data (``warm``): a restarted worker need not.
PRELOAD = [
    "torch",
    "torchvision",
    "torchft",
    "elastic_train.run",
    "elastic_train.quorum.run",
    "elastic_train.models",
    "elastic_train.quorum.warm",
]
POLL_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
# Codes after which a worker is not restarted: the run is over for it, or the input is bad.
FINAL = {ExitCode.OK, ExitCode.PREEMPTED, ExitCode.STOPPED, ExitCode.INTERRUPTED, ExitCode.USAGE}


def worker(environ: dict[str, str], argv: list[str]) -> None:
    """A worker's entry point, in a process forked from the preloaded forkserver."""
    # A job template's MASTER_ADDR/PORT would become every replica's own store: a group of one
    # hosts its own; a larger group's are its agent's, in ``environ``.
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    os.environ.update(environ)
    # The worker stays in the agent's process group (a node's processes freeze and die together
    # with it): a Ctrl-C reaches it from the terminal and, milliseconds later, as the agent's
    # forwarded copy, which the trainer takes for one press (resilience/preemption.py).
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)  # the trainer installs its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    from elastic_train.cli import main

    code = main(argv)
    sys.stdout.flush()
    os._exit(int(code or 0))  # skip the interpreter teardown of a process that imported torch


@dataclass
class Slot:
    """One replica group on this node: its workers, and how often it was restarted."""

    group: int
    restarts: int = 0
    procs: list[ForkServerProcess] = field(default_factory=list)
    started: float = 0.0
    codes: list[int] = field(default_factory=list)  # the group's code at each end
    failure: int | None = None  # the first failure of the current attempt (siblings are then killed)
    store: Any = None  # the group's store for its current attempt (a TCPStore), when it has several workers
    address: str = ""  # where the group's workers reach ``store``

    def exitcodes(self) -> list[int | None]:
        return [proc.exitcode for proc in self.procs]

    def signal(self, signum: int) -> None:
        for proc in self.procs:
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def ended(self) -> int | None:
        """None while the group runs. A worker that failed (or exited 2, bad input) ends the
        group: its siblings are killed (they may be blocked in a collective with it) and the
        first failure is the group's code, bad input before any. Otherwise every worker ended on
        its own: the first nonzero code, else 0."""
        codes = self.exitcodes()
        # Bad input ends the group too: a sibling would fail in a collective with it (and be
        # restarted for it), and the agent must see the usage error, not that crash.
        failed = [c for c in codes if c is not None and (c not in FINAL or c == ExitCode.USAGE)]
        if ExitCode.USAGE in failed:
            self.failure = ExitCode.USAGE
        elif failed and self.failure is None:
            # Several seen in one poll: a death by a signal from outside (SIGKILL, the OOM
            # killer) is the cause, a sibling's error exit its consequence (its collective with
            # the dead worker failed within the poll interval). Not so for a frozen sibling
            # that ``GroupWatch`` SIGKILLed before exiting HUNG: the freeze is the cause. This
            # slot's own SIGKILL comes only after the failure is recorded (a stop signal the
            # agent forwards may kill a worker still starting, but then nothing restarts).
            self.failure = ExitCode.HUNG if ExitCode.HUNG in failed else min(failed, key=lambda code: code >= 0)
        if None in codes:
            if self.failure is not None:
                self.signal(signal.SIGKILL)
            return None
        for proc in self.procs:
            proc.join()
        if self.failure is not None:
            return self.failure
        return next((c for c in codes if c), 0)  # type: ignore[misc]


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "-m" in argv:
        cut = argv.index("-m")
        if argv[cut + 1 : cut + 2] != ["elastic_train"]:
            raise SystemExit(
                "elastic_train.quorum.launch: error: it launches the trainer only: ... -m elastic_train [flags]"
            )
        ours, trainer = argv[:cut], argv[cut + 2 :]
    elif "--" in argv:
        cut = argv.index("--")
        ours, trainer = argv[:cut], argv[cut + 1 :]
    else:
        ours, trainer = argv, []
    p = argparse.ArgumentParser(prog="python -m elastic_train.quorum.launch", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="replica groups on this node")
    p.add_argument(
        "--procs-per-replica",
        type=int,
        default=1,
        help="workers per replica group (DDP or FSDP2 inside it, --parallel); a node runs nproc-per-node x this",
    )
    p.add_argument("--nnodes", type=int, default=int(os.environ.get("SLURM_NNODES", "1")))
    p.add_argument("--node-rank", "--node_rank", type=int, default=int(os.environ.get("SLURM_NODEID", "0")))
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=3, help="per replica group")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), help="http://host:port")
    p.add_argument(
        "--lighthouse-port",
        type=int,
        default=None,
        help="where node 0 starts one if --lighthouse is unset (default: a free port on one node or with "
        "--lighthouse-etcd, 29510 on several)",
    )
    p.add_argument(
        "--lighthouse-etcd",
        default=os.environ.get(ETCD_VAR),
        help="etcd members HOST:PORT,...: the Lighthouse runs on whichever node holds its seat there",
    )
    p.add_argument(
        "--lighthouse-ttl",
        type=int,
        default=SeatConfig.ttl_s,
        help="seconds before another node takes a lost Lighthouse's seat (keep under 0.45 x --hang-timeout)",
    )
    p.add_argument(
        "--lighthouse-wait",
        type=float,
        default=60.0,
        help="with --lighthouse-etcd: seconds to wait at start for a Lighthouse to hold the seat (etcd's start "
        "included) before exiting 1",
    )
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", default=None, help="the job's id (default: Slurm's, or new)")
    args = p.parse_args(ours)
    if args.lighthouse_wait <= 0:
        p.error(f"--lighthouse-wait {args.lighthouse_wait:g}: give seconds, more than 0")
    if args.lighthouse_etcd and args.lighthouse:
        p.error("--lighthouse and --lighthouse-etcd exclude each other: a given Lighthouse, or one whose seat moves")
    if args.lighthouse_etcd and args.run_id is None and not os.environ.get("SLURM_JOB_ID"):
        p.error("--lighthouse-etcd needs one --run-id for every node's agent: the seat's key is the job's")
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        p.error(f"--nproc-per-node {args.nproc_per_node}, --nnodes {args.nnodes}, --node-rank {args.node_rank}: bad")
    if args.procs_per_replica < 1:
        p.error(f"--procs-per-replica {args.procs_per_replica}: a replica group needs 1 worker or more")
    if args.nnodes > 1 and args.run_id is None and not os.environ.get("SLURM_JOB_ID"):
        p.error("--nnodes > 1 needs one --run-id for every node's agent (the job's checkpoint lock is shared by it)")
    if args.nnodes > 1 and len(os.environ.get(SECRET_VAR, "")) < identity.MIN_SECRET_CHARS:
        p.error(
            f"--nnodes > 1 needs {SECRET_VAR}: one random value (16+ characters) for every node's agent, "
            f"e.g. export {SECRET_VAR}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
        )
    if args.lighthouse is None and args.lighthouse_etcd is None and args.node_rank != 0:
        p.error("only node 0 starts the Lighthouse: pass --lighthouse http://<node 0>:<port> on the others")
    return args, trainer


def job_id(args: argparse.Namespace) -> str:
    return str(args.run_id or os.environ.get("SLURM_JOB_ID") or uuid.uuid4().hex[:12])


@dataclass
class SeatedLighthouse:
    """The Lighthouse whose seat moves (``--lighthouse-etcd``): this agent runs ``server`` while
    ``seat`` says so, and its workers reach whoever holds the seat through ``relay``.

    ``supervise`` is called from the agent's main loop, every 50 ms, and never blocks there: the
    fence (kill the Lighthouse once the seat may be gone) must not wait behind a slow start."""

    seat: Seat
    server: Lighthouse
    relay: Forwarder
    start_timeout_s: float = 60.0
    launched_at: float = 0.0
    serving: bool = False  # the launched Lighthouse listens (announced)
    failures: int = 0  # starts that failed in a row
    closed: threading.Event = field(default_factory=threading.Event)
    # The fence thread and the main loop both act on ``server``: one at a time.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Where the workers read the term of the Lighthouse the relay leads to (``quorum.term``).
    term_file: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="elastic-train-seat-")) / "term")
    term: int = 0
    launched_term: int = 0  # the term the last Lighthouse launched here served under

    def __post_init__(self) -> None:
        # The fence also runs on a thread of its own: the main loop may be busy for seconds (a
        # fork of the first worker, a group's store, a stop), and after a thaw any thread may
        # run first. Only the start needs the main thread (the Lighthouse dies with its starter).
        threading.Thread(target=self._fence_loop, name="lighthouse-fence", daemon=True).start()

    def _fence_loop(self) -> None:
        while not self.closed.wait(FENCE_POLL_S):
            self.fence()

    def fence(self) -> None:
        with self.lock:
            if self.server.running() and not self.seat.mine():
                self.server.kill()
                print("[quorum-agent] this agent lost the Lighthouse seat: its Lighthouse is stopped", flush=True)

    def supervise(self, stopping: bool) -> None:
        self.fence()
        with self.lock:
            if self.seat.mine():
                if not stopping:
                    self._serve(self.server.running())
                elif not self.server.running():  # stopping: the other nodes need a Lighthouse more than this one
                    self.seat.abdicate()
        holder = self.seat.holder()
        if holder is not None and holder.term != self.term:
            write_term(self.term_file, holder.term)  # before the relay carries a request to it
            self.term = holder.term
        self.relay.retarget(_route(holder))

    def _serve(self, running: bool) -> None:
        """Launch the Lighthouse, or see whether the launched one listens yet. One Lighthouse
        process per term: one that ended while the seat stayed this agent's is not launched
        again under that term (its quorum ids would repeat, ``quorum.term``); the seat is given
        up, and the next holder, maybe this agent, takes it with a new term."""
        holder = self.seat.holder()
        if holder is None:
            return
        try:
            if not running:
                if self.launched_term == holder.term:
                    self.seat.resign()
                    return
                if time.monotonic() - self.launched_at < 1.0:  # a crashing binary is not relaunched 20 times a second
                    return
                self.serving = False
                self.launched_at = time.monotonic()
                self.launched_term = holder.term
                self.server.launch()
            elif not self.serving and self.server.listening():
                self.serving, self.failures = True, 0
                print(
                    f"[quorum-agent] Lighthouse at {self.seat.config.address} (pid {self.server.pid}), "
                    f"bound to {self.server.host}, holding its seat",
                    flush=True,
                )
            elif not self.serving and time.monotonic() - self.launched_at > self.start_timeout_s:
                raise TimeoutError(f"not listening after {self.start_timeout_s:.0f} s")
        except (LighthousePortTaken, FileNotFoundError) as exc:  # nothing a retry changes
            self._give_up(str(exc))
        except (OSError, RuntimeError, TimeoutError) as exc:
            self.server.kill()
            self.failures += 1
            if self.failures >= 3:
                self._give_up(f"{self.failures} starts failed, the last: {exc}")
            else:
                print(f"[quorum-agent] the Lighthouse did not start ({exc}); trying again", flush=True)

    def _give_up(self, why: str) -> None:
        self.server.kill()
        print(f"[quorum-agent] cannot run the Lighthouse here ({why}): the seat is left to another agent", flush=True)
        self.seat.abdicate()

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            self.server.kill()  # first: once the seat is released, another agent may start serving
        self.seat.stop(release=True)  # the others take the seat at their next read, not after the TTL
        self.relay.close()
        shutil.rmtree(self.term_file.parent, ignore_errors=True)


class Agent:
    def __init__(
        self,
        args: argparse.Namespace,
        trainer_argv: list[str],
        lighthouse: str,
        server: Lighthouse | None = None,
        seated: SeatedLighthouse | None = None,
    ) -> None:
        self.args = args
        self.server = server  # the Lighthouse this agent runs (node 0 without --lighthouse), supervised
        self.seated = seated  # or the one whose seat moves between the agents
        self.trainer_argv = ["--ft", "quorum", *trainer_argv]
        self.lighthouse = lighthouse
        self.run_id = job_id(args)
        # Signs the state transfer between this job's replicas; minted per launch on one node.
        self.secret = os.environ.get(SECRET_VAR) or secrets.token_hex(16)
        first = args.node_rank * args.nproc_per_node
        self.slots = [Slot(first + i) for i in range(args.nproc_per_node)]
        self.ctx = multiprocessing.get_context("forkserver")
        self.stopping: int | None = None  # the stop signal received, if any
        self.failures: list[int] = []  # every worker exit, in the order they were seen
        self.k = args.procs_per_replica
        self.local_workers = args.nproc_per_node * self.k
        cores = len(os.sched_getaffinity(0))
        # The user's OMP_NUM_THREADS, else a share of the cores: a custom loop that sets none
        # would otherwise start a pool of every core in each worker (named as the launcher's own
        # choice, which the trainer caps on a GPU).
        users = os.environ.get("OMP_NUM_THREADS")
        self.threads = users or str(max(1, cores // self.local_workers))
        self.threads_are_ours = not users
        if users:  # the workers inherit this environment: no stale mark may make the user's a default
            os.environ.pop(LAUNCHER_THREADS_VAR, None)

    def environ(self, slot: Slot, rank: int = 0) -> dict[str, str]:
        # On one node every listener (a replica's store and state server) stays on loopback.
        local = {HOST_VAR: "127.0.0.1"} if self.args.nnodes == 1 and not os.environ.get(HOST_VAR) else {}
        if self.k > 1:  # the group's world: its agent's store (torchrun's variables, as torchrun sets them)
            local.update(
                MASTER_ADDR=slot.address,
                MASTER_PORT=str(slot.store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
            )
        return {
            **local,
            # The replica group's world for torch.distributed (a world of one by default); the
            # local rank picks the GPU (cuda:<local rank>) and the local world size the CPU
            # threads, as under torchrun.
            "RANK": str(rank),
            "LOCAL_RANK": str((slot.group - self.args.node_rank * self.args.nproc_per_node) * self.k + rank),
            "WORLD_SIZE": str(self.k),
            "LOCAL_WORLD_SIZE": str(self.local_workers),
            "GROUP_RANK": str(self.args.node_rank),
            "REPLICA_GROUP_ID": str(slot.group),
            "TORCHELASTIC_RESTART_COUNT": str(slot.restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            JOB_VAR: self.run_id,
            SECRET_VAR: self.secret,
            "TORCHFT_LIGHTHOUSE": self.lighthouse,
            GROUPS_VAR: str(self.args.nnodes * self.args.nproc_per_node),
            **({TERM_FILE_VAR: str(self.seated.term_file)} if self.seated is not None else {}),
            # The line record lives with the seat: the same members (``quorum.line``).
            **({LINE_VAR: ",".join(self.seated.seat.config.endpoints)} if self.seated is not None else {}),
            "OMP_NUM_THREADS": self.threads,
            **({LAUNCHER_THREADS_VAR: self.threads} if self.threads_are_ours else {}),
        }

    def start(self, slot: Slot) -> None:
        if self.k > 1:
            # A new store for each attempt of the group, as torchrun's agent makes one for each
            # rendezvous round: the workers' process group reads its peers' addresses from fixed
            # keys, and a restarted worker must never find its predecessor's there.
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            slot.store = None  # the previous attempt's closes
            slot.address = "127.0.0.1" if self.args.nnodes == 1 else _host_address()
            # On the job's interface only (loopback on one node), as every replica's own store.
            listener = identity.listen(identity.bind_address(slot.address))
            slot.store = TCPStore(
                slot.address,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        slot.procs, slot.failure, slot.started = [], None, time.monotonic()
        for rank in range(self.k):
            name = f"replica-{slot.group}" if self.k == 1 else f"replica-{slot.group}.{rank}"
            proc = self.ctx.Process(target=worker, args=(self.environ(slot, rank), self.trainer_argv), name=name)
            proc.start()
            slot.procs.append(proc)
            where = "" if self.k == 1 else f", group rank {rank}"
            print(
                f"[quorum-agent] replica group {slot.group}: worker pid {proc.pid} (restart {slot.restarts}){where}",
                flush=True,
            )

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = signum
        for slot in self.slots:
            slot.signal(signum)

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.forward)
        # torchft's Rust side logs every quorum and commit at INFO (thousands of lines a run); its
        # logger reads RUST_LOG once, when the forkserver imports torchft.
        os.environ.setdefault("RUST_LOG", "warn")
        os.environ[WARM_ARGV_VAR] = json.dumps(self.trainer_argv)  # read by the forkserver's preload
        multiprocessing.set_forkserver_preload(PRELOAD)
        if not self.await_lighthouse():
            return 1 if self.stopping is None else 128 + self.stopping  # no worker ever started
        for slot in self.slots:
            self.start(slot)
        live = list(self.slots)
        while live:
            time.sleep(POLL_S)
            self.supervise_lighthouse()
            for slot in list(live):
                code = slot.ended()
                if code is None:
                    continue
                slot.codes.append(code)
                self.failures.append(code)
                live.remove(slot)
                if code == ExitCode.USAGE:
                    print(f"[quorum-agent] replica group {slot.group}: bad input (exit 2); stopping", flush=True)
                    self.forward(signal.SIGTERM, None)
                elif code not in FINAL and self.stopping is None and slot.restarts < self.args.max_restarts:
                    print(
                        f"[quorum-agent] replica group {slot.group}: worker exited with {code}; restarting", flush=True
                    )
                    slot.restarts += 1
                    self.start(slot)
                    live.append(slot)
                elif code not in FINAL:
                    print(
                        f"[quorum-agent] replica group {slot.group}: worker exited with {code}; not restarted",
                        flush=True,
                    )
        for slot in self.slots:
            slot.store = None  # the groups' stores close with the job
        return self.outcome()

    def await_lighthouse(self) -> bool:
        """With a seat in etcd, workers start once some agent's Lighthouse holds it: a Manager
        that finds none at its first quorum would wait out its quorum timeout."""
        if self.seated is None:
            return True
        deadline = time.monotonic() + self.args.lighthouse_wait
        while self.seated.seat.holder() is None:
            self.seated.supervise(stopping=self.stopping is not None)
            if self.stopping is not None:
                return False
            if time.monotonic() > deadline:
                print(
                    f"elastic_train.quorum.launch: error: no Lighthouse holds its seat in etcd "
                    f"({self.args.lighthouse_etcd}) after {self.args.lighthouse_wait:g} s: start the etcd members "
                    "(python -m elastic_train.etcd_member), check that a majority of them runs, or wait longer "
                    "(--lighthouse-wait)",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            time.sleep(POLL_S)
        self.seated.supervise(stopping=self.stopping is not None)
        return self.stopping is None

    def supervise_lighthouse(self) -> None:
        """A Lighthouse that died is started again on its port: it keeps no state worth keeping
        (the next quorum is formed from the replicas' heartbeats), and without it no replica
        gets past its next step (they exit after the quorum timeout)."""
        if self.seated is not None:
            self.seated.supervise(stopping=self.stopping is not None)
            return
        server = self.server
        if server is None or server.proc is None or server.proc.poll() is None or self.stopping is not None:
            return
        print(f"[quorum-agent] Lighthouse exited with {server.proc.returncode}; starting it again", flush=True)
        try:
            server.start()
        except (OSError, RuntimeError, TimeoutError) as exc:  # the workers end after their quorum timeout
            print(f"[quorum-agent] could not start the Lighthouse again: {exc}", flush=True)
            self.server = None

    def outcome(self) -> int:
        """How the training ended, from each replica group's last worker exit."""
        last = [slot.codes[-1] for slot in self.slots if slot.codes]
        # A final checkpoint that never committed outranks the others' finish: the run's end is not on disk.
        for code in (
            ExitCode.USAGE,
            ExitCode.FINAL_CHECKPOINT_FAILED,
            ExitCode.OK,
            ExitCode.PREEMPTED,
            ExitCode.STOPPED,
            ExitCode.INTERRUPTED,
        ):
            if code in last:
                return int(code)
        # Nobody finished: the most recent failure, a signal as the shell reports it (128 + N).
        failed = [c for c in self.failures if c != 0] or [1]
        return 128 - failed[-1] if failed[-1] < 0 else failed[-1]


def _host_address() -> str:
    """This host's name as the other nodes reach it (Slurm's node names resolve cluster-wide)."""
    return os.environ.get(HOST_VAR) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def lighthouse_here(args: argparse.Namespace, **kwargs: Any) -> tuple[Lighthouse, str]:
    """A Lighthouse (not started) bound to the job's interface, and the URL replicas reach it at.
    Every quorum change waits for it: its heartbeat timeout is what a dead worker costs the
    survivors (LighthouseConfig)."""
    log = Path(os.environ.get("ELASTIC_TRAIN_LIGHTHOUSE_LOG", os.devnull))
    single = args.nnodes == 1
    advertised = "127.0.0.1" if single else _host_address()
    bind = "127.0.0.1" if single else identity.bind_address(advertised)
    if not single and identity.is_loopback(bind):
        print(
            f"[quorum-agent] warning: {advertised} resolves to {bind} here, a loopback address other nodes "
            f"cannot reach; set {HOST_VAR} to this host's address",
            flush=True,
        )
    lighthouse = Lighthouse(
        LighthouseConfig(),
        host=bind,
        # With a seat the address travels in etcd: any free port (one fixed port collides with etcd's on a member node).
        port=args.lighthouse_port or (None if single or args.lighthouse_etcd else 29510),
        log=log,
        **kwargs,
    )
    return lighthouse, f"http://{advertised}:{lighthouse.port}"


def start_lighthouse(args: argparse.Namespace) -> tuple[Lighthouse, str]:
    """Node 0's Lighthouse for the job's lifetime."""
    lighthouse, address = lighthouse_here(args)
    lighthouse.start()
    print(f"[quorum-agent] Lighthouse at {address} (pid {lighthouse.pid}), bound to {lighthouse.host}", flush=True)
    return lighthouse, address


def seated_lighthouse(args: argparse.Namespace) -> SeatedLighthouse:
    """A candidate for the Lighthouse's seat (``--lighthouse-etcd``). Its port is checked now:
    a port taken here is bad input at start, not a seat given up later."""
    config = SeatConfig(tuple(filter(None, args.lighthouse_etcd.split(","))), job_id(args), "", args.lighthouse_ttl)
    server, address = lighthouse_here(args)
    _check_port_free(server.host, server.port)
    config = dataclasses.replace(config, address=address)
    seat = Seat(config)
    seat.start()
    return SeatedLighthouse(seat, server, Forwarder(current=lambda: _route(seat.holder())))


def _route(holder: Holder | None) -> Route | None:
    return Route(holder.address, holder.term) if holder is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    args, trainer = parse(sys.argv[1:] if argv is None else argv)
    lighthouse: Lighthouse | None = None
    seated: SeatedLighthouse | None = None
    address = args.lighthouse
    try:
        if args.lighthouse_etcd:
            seated = seated_lighthouse(args)
            address = seated.relay.address
        elif address is None:
            lighthouse, address = start_lighthouse(args)
    except (LighthousePortTaken, UsageError, EtcdError, ValueError) as exc:
        print(f"elastic_train.quorum.launch: error: {exc}", file=sys.stderr, flush=True)
        return int(ExitCode.USAGE)
    try:
        return Agent(args, trainer, address, lighthouse, seated).run()
    finally:
        if lighthouse is not None:
            lighthouse.stop()
        if seated is not None:
            seated.close()
        from elastic_train.launch import _stop_helpers

        _stop_helpers()


if __name__ == "__main__":
    sys.exit(main())
