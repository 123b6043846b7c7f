"""One replica group's side of quorum training, on torchft's ``Manager``.

A replica group is the workers of one agent: one, or K with DDP or FSDP2 inside the group (the
quorum agent's ``--procs-per-replica K``, or a torchrun agent per group). Its agent
restarts the group when one of them dies, and each new worker fetches the current state from the
worker of the same group rank in a live peer group instead of a checkpoint. Every step
(``Replica.begin_step``) the replicas that are alive form a quorum through the Lighthouse
(``elastic_train.quorum.lighthouse``); the quorum agrees on the step, and each participant trains
its share of that step's global batch (``QuorumSchedule``). A step that any participant fails to
finish is discarded by all of them and redone, with the same global batch, over the next quorum.
So a peer's failure costs the survivors one discarded attempt and the Lighthouse's heartbeat
timeout, never a restart.

The loop, for one step::

    attempt = replica.begin_step(schedule)      # quorum, heal if behind, the share to train
    loss = ...; (loss * attempt.share.weight).backward()
    replica.average_gradients(model.parameters())
    replica.commit(lambda: (optimizer.step(), scheduler.step()))   # False: redo the same step

Choices that differ from torchft's own recipe, and why:

* no ``torchft.DistributedDataParallel``: in torchft 0.2.0 its communication hook asserts
  (ddp.py) when a peer dies mid-allreduce, because the failed gloo work's future is never set,
  and the SURVIVOR crashes. ``average_gradients`` allreduces one flat buffer through
  ``Manager.allreduce`` instead: a failed collective only makes the commit vote False;
* synchronous quorum only (``use_async_quorum=False``): the asynchronous one overlaps the
  forward pass with forming the quorum, so a participant would cut its share of the global
  batch before knowing how many participants there are;
* ``init_sync=False`` by default (``ReplicaConfig.init_sync``): replicas that seed their
  initial weights identically need no state transfer at step 0; a replica behind the quorum's
  step heals either way.

Limits: the gradient average
runs after the backward pass, in one flat copy of the gradients (no overlap with backward as
DDP's buckets give); the Lighthouse is a single point of failure (without it ``begin_step``
raises after ``quorum_timeout_s`` and the worker exits); a failure inside the optimizer step
ends that replica's worker (``commit``), which heals from a peer when its agent restarts it.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import structlog
import torch
from torch import nn
from torch.distributed import AllreduceOptions, ReduceOp

from elastic_train.errors import UsageError
from elastic_train.outcome import ExitCode
from elastic_train.quorum import identity
from elastic_train.quorum.group_watch import GroupWatch
from elastic_train.quorum.names import HOST_VAR, SECRET_VAR
from elastic_train.quorum.schedule import QuorumSchedule, StepShare
from elastic_train.quorum.term import follow_terms

T = TypeVar("T")

log = structlog.get_logger(__name__)

# Exit status of a worker whose state may be half updated (an error after the commit vote): the
# agent counts it as a failure and restarts the worker, which heals from a live peer.
EXIT_AFTER_COMMIT_FAILED = ExitCode.QUORUM_STATE_UNSAFE
# Quorums in a row with more members than samples in a global batch before a replica gives up
# (``Replica._oversized``): a moment's surplus passes within a few; a standing one is bad input.
MAX_OVERSIZED_IN_A_ROW = 10


@dataclass(frozen=True)
class ReplicaConfig:
    """How a replica group reaches the quorum, and how long it waits for what.

    torchft lets ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC`` and
    ``TORCHFT_CONNECT_TIMEOUT_SEC`` (whole seconds) override the three Manager timeouts below.
    """

    lighthouse: str  # the Lighthouse's URL, http://host:port (torchft's TORCHFT_LIGHTHOUSE)
    replica_group: int  # this group's index (torchft's REPLICA_GROUP_ID): distinct per group
    # Logs and files are named "<name>_<group>" (``replica_id``); torchft's replica id also
    # carries the job and the group's size ("<name>@<job>@<K>_<group>", ``member_id``) and reads
    # its trailing digits.
    name: str = "replica"
    # The job's id (``identity.job_id``: the agent's JOB_VAR, Slurm's job id, torchrun's run id):
    # a quorum holding a replica of another job is refused before anything moves.
    job: str = field(default_factory=lambda: identity.job_id(os.environ))
    # Signs the state transfer (``elastic_train.quorum.transport``); the same for every replica.
    secret: str = field(default_factory=lambda: os.environ.get(SECRET_VAR, ""), repr=False)
    # Bounds a gloo collective: how long a participant waits for a peer that stopped answering
    # (a killed peer's closed socket fails it at once). Too short fails healthy but slow steps.
    collective_timeout_s: float = 2.0
    # Manager RPCs (the commit vote), the state transfer to a healing peer, torchft's futures.
    timeout_s: float = 10.0
    # How long ``begin_step`` waits for a quorum; longer than any step. Past it the worker fails.
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0  # connecting to the Lighthouse and to a peer's Manager
    # A quorum request the Lighthouse failed (it died; its agent starts it again on its port) is
    # sent again after this long (torchft floors it at 0.1 s), to a new connection. torchft's
    # default is no retry: its Manager server then never answers the waiting workers, which
    # fail only at the quorum timeout and restart (measured: a Lighthouse restart cost a restart
    # of every replica). A request that hangs (a frozen or unreachable Lighthouse) is not helped:
    # each try may wait the whole quorum timeout; the worker's own wait is bounded by it.
    lighthouse_retry_s: float = 0.25
    # A replica group of several workers: a worker whose liveness counter in the group's store
    # has not moved for this long is taken for frozen, and every other worker of the group exits
    # (``group_watch``), so that the group leaves the quorum within about this long plus the
    # Lighthouse's heartbeat timeout. Above any stretch a worker's Python keeps the GIL (the heal
    # transfer's longest is ~15 ms for 400 MB: measured) or its host leaves it unscheduled; the
    # longest silence a run saw is logged (``group_watch_stopped``) to show the margin.
    peer_silence_s: float = 1.0
    # Advertised to peers (the state transfer; the group's store when torchrun's MASTER_ADDR is a
    # loopback name): must reach this host from theirs. HOST_VAR overrides the host name (e.g.
    # an address where names do not resolve).
    hostname: str = field(default_factory=lambda: os.environ.get(HOST_VAR) or socket.gethostname())
    # True when replicas may start from different weights: at step 0 all but one then load the
    # first replica's state. False (the default) trusts identically seeded initial weights.
    init_sync: bool = False

    def __post_init__(self) -> None:
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"lighthouse address {self.lighthouse!r} is not a URL: pass http://host:port "
                "(what torchft_lighthouse prints as 'Lighthouse listening on')"
            )
        if self.replica_group < 0:
            raise ValueError(f"replica group {self.replica_group} is negative: number the groups 0, 1, 2, ...")
        if self.name[-1:].isdigit():
            raise ValueError(f"replica name {self.name!r} ends in a digit: torchft would read it as the group index")
        if not self.name or any(c in self.name for c in "@:_"):
            raise ValueError(f"replica name {self.name!r} is empty or holds '@', ':' or '_' (replica id separators)")
        timeouts = (
            "collective_timeout_s",
            "timeout_s",
            "quorum_timeout_s",
            "connect_timeout_s",
            "lighthouse_retry_s",
            "peer_silence_s",
        )
        for what in timeouts:
            if getattr(self, what) <= 0:
                raise ValueError(f"{what} must be positive, got {getattr(self, what)}")

    @property
    def replica_id(self) -> str:
        return f"{self.name}_{self.replica_group}"

    @property
    def quorum_retries(self) -> int:
        """torchft's ``quorum_retries``: after a failed try it sleeps ``quorum_timeout / (retries + 1)``
        (at least 0.1 s) and tries again; each try may take the whole quorum timeout."""
        return max(0, math.ceil(self.quorum_timeout_s / self.lighthouse_retry_s) - 1)


@dataclass(frozen=True)
class Heal:
    """This replica was behind the quorum and loaded a live peer's state before the step."""

    from_step: int
    to_step: int
    seconds: float  # forming the quorum plus fetching and loading the peer's state


@dataclass(frozen=True)
class StepAttempt:
    """What the quorum agreed for one attempt at a step, and this replica's part in it."""

    step: int  # the global step the quorum trains (the committed steps so far)
    world: int  # data-parallel members in this attempt: the quorum's groups x workers per group
    rank: int  # this worker's rank among them (group index in the quorum x K + group rank)
    share: StepShare  # the samples this replica trains on
    heal: Heal | None  # set when this replica healed to ``step`` before the attempt
    quorum_seconds: float  # time spent in ``begin_step``


@dataclass(frozen=True)
class _GroupEnv:
    """The replica group's own store, as torchrun sets it (or none: a plain process)."""

    rank: int
    world_size: int
    store_addr: str | None
    store_port: int | None

    @classmethod
    def from_environ(cls) -> _GroupEnv:
        """One torchrun agent per replica group: its RANK and WORLD_SIZE are the group's."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size > 1 and (addr is None or port is None):
            raise ValueError(
                f"WORLD_SIZE={world_size} without MASTER_ADDR/MASTER_PORT: a replica group of several "
                "workers meets in its agent's store; start each group with torchrun --nproc-per-node=K"
            )
        return cls(int(os.environ.get("RANK", "0")), world_size, addr, int(port) if port else None)

    @property
    def attempt(self) -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _host_copy(state: T) -> T:
    """A copy of ``state`` whose tensors are in host memory: no second copy of a large model on
    its GPU while a peer heals (the healer's ``load`` moves them to its device)."""
    from torch.utils._pytree import tree_map

    def copy_leaf(leaf: Any) -> Any:
        return leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else copy.deepcopy(leaf)

    return tree_map(copy_leaf, state)  # type: ignore[no-any-return]


def _reachable(store_host: str, advertised: str) -> str:
    """The group's store as other hosts reach it. The quorum's process group meets in its first
    participant's store, so the address the Manager advertises must work from every other
    group's host. torchrun's c10d rendezvous (``--standalone`` included) hands its workers
    ``MASTER_ADDR`` = the agent's ``socket.getfqdn()``, which is a loopback name wherever
    ``/etc/hosts`` maps the host name to 127.0.x.x (Debian's default; "localhost" here), and
    the static backend gives 127.0.0.1: on another host that is the other host (measured: a
    quorum across two network namespaces failed every configure). torchrun's store listens on
    every interface, so this host's advertised name reaches it. The Manager connects to it by
    that name too: ``HOST_VAR`` must then be an address of this host (not a NAT's)."""
    return advertised if identity.resolves_to_loopback(store_host) else store_host


def _state_transport(config: ReplicaConfig) -> Any:
    """The state transfer to and from healing peers: tensors and JSON signed with the job's
    secret, never pickle (torchft's own unpickles what any peer serves), served on the job's
    interface under ``config.hostname`` (torchft's own advertises ``socket.gethostname()``,
    which another host or network namespace may resolve to itself). ``UsageError`` without a
    job id or secret."""
    from elastic_train.quorum.transport import SignedStateTransport

    identity.require_identity(config.job, config.secret, config.replica_id)
    return SignedStateTransport(
        advertise=config.hostname,
        bind=identity.bind_address(config.hostname),
        secret=config.secret,
        timeout=timedelta(seconds=config.timeout_s),
    )


class Replica:
    """A replica group's torchft ``Manager`` with the settings quorum mode relies on.

    Under torchrun the Manager uses the agent's store (``MASTER_ADDR``/``MASTER_PORT``), which
    outlives the worker; a plain process hosts a store of its own on loopback.
    """

    def __init__(self, config: ReplicaConfig) -> None:
        from torchft import Manager, ProcessGroupGloo  # optional dependency: elastic-train[ft]

        self.config = config
        self.group = group = _GroupEnv.from_environ()
        self._oversized_in_a_row = 0
        # The replica id torchft and the Lighthouse see: "<name>@<job>@<K>_<group>".
        self.member_id = identity.member_id(config.name, config.job, config.replica_group, group.world_size)
        self._own_store: object = None  # kept alive: the Manager and its peers use it
        store_addr, store_port = group.store_addr, group.store_port
        if store_addr is None or store_port is None:
            # The quorum's process group meets in its first participant's store: peers on other
            # hosts connect to it by the advertised name. It listens on the job's interface only
            # (TCPStore itself binds every interface): on a socket bound here, handed over.
            listener = identity.listen(identity.bind_address(config.hostname))
            store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
                config.hostname,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
            self._own_store = store
            store_addr, store_port = config.hostname, int(store.port)
        self._watch: GroupWatch | None = None
        if group.world_size > 1:  # first thing: the Manager's start-up below may take seconds
            store = self._store_client(store_addr, store_port, timeout_s=config.peer_silence_s)
            watch = GroupWatch(
                store,
                group.attempt,
                group.rank,
                group.world_size,
                config.peer_silence_s,
                startup_s=config.connect_timeout_s + config.peer_silence_s,  # a peer's imports may lag
            )
            self._watch = watch.start()
        ready = f"elastic_train/replica_ready/{group.attempt}"
        if group.rank != 0:
            # The group's Manager server runs on group rank 0, which publishes its address in the
            # agent's store under fixed keys; the store outlives a restart of the group, so a
            # worker reading before rank 0 wrote would connect to the previous attempt's server.
            # Rank 0 may itself take up to the connection timeout to reach the Lighthouse.
            wait = timedelta(seconds=config.connect_timeout_s + config.timeout_s)
            self._store_client(store_addr, store_port).wait([ready], wait)
        self.manager: Any = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=config.collective_timeout_s)),
            load_state_dict=None,  # state comes from register_state, one entry per component
            state_dict=None,
            min_replica_size=1,  # a replica alone may commit: survivors never wait for a peer
            use_async_quorum=False,
            init_sync=config.init_sync,
            timeout=timedelta(seconds=config.timeout_s),
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timedelta(seconds=config.connect_timeout_s),
            quorum_retries=config.quorum_retries,
            rank=group.rank,
            world_size=group.world_size,
            store_addr=_reachable(store_addr, config.hostname),
            store_port=store_port,
            lighthouse_addr=config.lighthouse,
            replica_id=self.member_id,
            hostname=config.hostname,
            checkpoint_transport=_state_transport(config),
        )
        identity.guard_quorum(self.manager, config.job, self.member_id, config.lighthouse)
        follow_terms(self.manager)  # quorum ids unique across Lighthouses (--lighthouse-etcd)
        if group.rank == 0 and group.world_size > 1:
            self._store_client(store_addr, store_port).set(ready, "1")

    @staticmethod
    def _store_client(addr: str, port: int, timeout_s: float = 300.0) -> Any:
        return torch.distributed.TCPStore(  # type: ignore[attr-defined]
            addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )

    @property
    def quorum_id(self) -> int:
        """The id of the quorum the current attempt runs in (torchft reconfigures its process
        group only when this changes)."""
        return int(self.manager._quorum_id)

    @property
    def committed_steps(self) -> int:
        """Steps this replica has committed (or healed to): the next step it trains."""
        return int(self.manager.current_step())

    def register_state(self, name: str, load: Callable[[T], None], state: Callable[[], T]) -> None:
        """Make ``state()`` part of what a healing peer fetches, and ``load`` how it is applied.

        The peer gets a deep COPY taken when the transfer is staged (at the start of the step
        it heals at): torchft's HTTP transport copies only device tensors and serves CPU ones
        by reference, from a thread, while this replica trains on. The copy makes what the peer
        loads exactly the state at the step boundary, whatever this replica (or a state function
        returning live containers) changes meanwhile. It costs one copy of the state, taken only
        when a peer heals.
        """
        self.manager.register_state_dict_fn(name, load, lambda: _host_copy(state()))

    def begin_step(self, schedule: QuorumSchedule, position: Callable[[], int] | None = None) -> StepAttempt:
        """Join the quorum for the next step (healing from a peer first if this replica is
        behind) and return the agreed step, membership and this replica's share.

        ``position``: which of the schedule's global batches to cut, read AFTER the quorum (a
        heal may have just replaced the loop's state); default: the committed steps. A loop
        whose commits include other work (an evaluation round) counts its batches itself.
        """
        before = self.committed_steps
        started = time.monotonic()
        self.manager.start_quorum()  # sync: returns with the group reconfigured and state loaded
        seconds = time.monotonic() - started
        step = self.committed_steps
        world, rank = int(self.manager.num_participants()), self.manager.participating_rank()
        if rank is None:  # only torchft's spare-replica mode leaves a replica out
            raise RuntimeError(f"replica {self.config.replica_id} is not participating in the quorum for step {step}")
        heal = Heal(before, step, seconds) if step != before else None
        batch = position() if position is not None else step
        # The data-parallel members are the quorum's groups times each group's workers.
        k = self.group.world_size
        world, rank = world * k, int(rank) * k + self.group.rank
        if world > schedule.global_batch:  # every participant of the quorum sees the same count
            return self._oversized(schedule, step, batch, world, rank, heal, seconds)
        self._oversized_in_a_row = 0
        share = schedule.share(batch, world, rank)
        return StepAttempt(step, world, rank, share, heal, seconds)

    def _oversized(
        self, schedule: QuorumSchedule, step: int, batch: int, world: int, rank: int, heal: Heal | None, seconds: float
    ) -> StepAttempt:
        """A quorum with more members than the global batch has samples. It may be a moment's
        (a dead group's request still counted, or a group too many that will fail and leave), so
        the attempt is refused (its commit fails and the next quorum is formed) rather than the job
        ended; only ``MAX_OVERSIZED_IN_A_ROW`` such quorums in a row are a configuration error.
        The refused attempt trains one sample per member (any valid share: nothing commits)."""
        self._oversized_in_a_row += 1
        if self._oversized_in_a_row > MAX_OVERSIZED_IN_A_ROW:
            raise UsageError(
                f"the quorum for step {step} holds {world} members ({world // self.group.world_size} replica "
                f"groups of {self.group.world_size} workers) for a global batch of {schedule.global_batch}, "
                f"{self._oversized_in_a_row} quorums in a row: each member needs a sample",
                f"use a global batch of {world} or more, or fewer replica groups or workers per group",
            )
        self.refuse(f"{world} members for a global batch of {schedule.global_batch}")
        last = schedule.global_batch - 1
        share = schedule.share(batch, schedule.global_batch, min(rank, last))
        return StepAttempt(step, schedule.global_batch, min(rank, last), share, heal, seconds)

    def average(self, tensors: Sequence[torch.Tensor], timeout_s: float | None = None) -> bool:
        """Average ``tensors`` in place over the attempt's participants, in one collective.

        Returns False when the collective failed (a peer died or timed out): the tensors are
        then garbage and the attempt must not be committed (``commit`` will vote False).
        ``timeout_s``: how long to wait for the slowest peer (``sum``); the gradients of a large
        model take longer than ``collective_timeout_s`` (``timeouts.GradientBound``).
        """
        if not tensors:
            return True
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        if timeout_s is None:
            # Manager.allreduce catches the failure, records it for the commit vote and returns a
            # work whose wait() is False; later collectives of the attempt are skipped.
            self.manager.allreduce(flat).wait()
            if self.manager.errored() is not None:
                return False
        else:  # SUM then divide, as Manager.allreduce's average does, with this call's own bound
            if not self.sum(flat, timeout_s=timeout_s):
                return False
            flat.div_(int(self.manager.num_participants()))
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return True

    def sum(self, tensor: torch.Tensor, timeout_s: float | None = None) -> bool:
        """SUM ``tensor`` in place over the attempt's participants (exact counts, metric sums,
        votes); False when the collective failed (see ``average``).

        ``timeout_s``: wait this long for the slowest peer instead of ``collective_timeout_s``,
        for a collective that ends uneven work (an evaluation round: a shard's time varies
        more than a step's). torchft's ``Manager.allreduce`` takes no per-call timeout, so this
        one goes to the Manager's process group directly, and a failure is reported to the
        Manager as its own collectives' are (the commit vote then fails).
        """
        if timeout_s is None:
            self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
            return self.manager.errored() is None
        if self.manager.errored() is not None:
            return False
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        opts.timeout = timedelta(seconds=timeout_s)
        try:
            self.manager._pg.allreduce([tensor], opts).wait()  # torchft 0.2.0: the reconfigured group
        except Exception as exc:  # a peer died or stayed silent past the timeout
            self.manager.report_error(exc)
            return False
        return True

    @property
    def refused(self) -> bool:
        """The current attempt already failed here (a collective, ``refuse``): it cannot commit."""
        return self.manager.errored() is not None

    def refuse(self, reason: str) -> None:
        """Make this attempt's commit vote fail (the participants disagree on something the
        attempt relies on); the rest of its collectives are skipped."""
        self.manager.report_error(RuntimeError(f"attempt refused: {reason}"))

    def discard(self, step: int, reason: str) -> None:
        """End the current attempt without training: every participant must call it with the
        same ``step``, which the next quorum starts from (e.g. all of them loaded a checkpoint
        at that step). The vote fails on purpose, so nothing is committed."""
        self.manager.report_error(RuntimeError(f"attempt discarded: {reason}"))
        self.manager.should_commit()
        self.manager.load_state_dict({"step": step, "batches_committed": step * int(self.manager.num_participants())})

    def average_gradients(
        self, parameters: Iterable[nn.Parameter], extras: Sequence[torch.Tensor] = (), timeout_s: float | None = None
    ) -> bool:
        """The data-parallel gradient average (what DDP does), plus ``extras`` (e.g. metric
        sums) in the same collective. A parameter without a gradient contributes zeros, so
        every participant sends the same layout."""
        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return self.average([*(p.grad for p in params if p.grad is not None), *extras], timeout_s=timeout_s)

    def commit(self, apply: Callable[[], None]) -> bool:
        """Vote on the attempt; when every participant finished it, run ``apply`` (optimizer,
        scheduler, metric sums: everything a step changes) and return True.

        False: nothing was applied, train the same step again (``begin_step``). An exception
        inside ``apply`` ends the process at once with ``EXIT_AFTER_COMMIT_FAILED``: the
        replica's state may be half updated and must never reach a peer; its agent restarts it
        and it heals. Unwinding instead could let a caller's ``except`` keep training on it.
        """
        if not self.manager.should_commit():
            return False
        try:
            apply()
        except BaseException:
            traceback.print_exc()
            print(
                f"replica {self.config.replica_id}: failed after committing step {self.committed_steps - 1}; "
                "exiting so that the agent restarts this worker and it heals from a peer",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_AFTER_COMMIT_FAILED)
        return True

    def close(self, clean: bool = True) -> None:
        """Stop the Manager's server and state transfer; peers drop this replica from the next
        quorum after the Lighthouse's heartbeat timeout. ``clean``: this worker finished, and its
        group's other workers should not take its silence for a freeze."""
        if self._watch is not None:
            self._watch.stop(left=clean)
            log.info(
                "group_watch_stopped",
                longest_silence_s=round(self._watch.longest_silence_s, 3),
                longest_round_s=round(self._watch.longest_round_s, 3),
                stalled_rounds=self._watch.stalled_rounds,
                bound_s=self._watch.silence_s,
            )
        self.manager.shutdown(wait=False)

    def __enter__(self) -> Replica:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(clean=exc_type is None)
