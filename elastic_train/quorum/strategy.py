"""Quorum mode's strategy (``--ft quorum``) for the one training loop: survivors keep training.

The loop (``trainer.Trainer``) is restart mode's: the same task, data order, step, metrics,
early stop and checkpoints; what this strategy changes is who trains a step (the
``strategy.StepStrategy`` interface). A replica group is one worker or K (``--procs-per-replica``:
DDP or FSDP2 inside the group, ``GroupComm`` for its sums); every step the live groups form a
quorum (``Replica``), split the step's global batch over their workers (``QuorumSchedule``),
average their gradients across the groups and vote. A failed attempt is discarded by every
participant and redone, with the same global batch, by the next quorum; a restarted worker heals
from a live peer. So:

* every committed step trains its global batch exactly once, whatever the membership, and the
  epoch's metrics (correct, loss sum, samples, the sample digest) are SUM-reduced inside the
  step's own collectives: they count committed steps only and are the same on every replica;
* everything a step changes is applied in ``Replica.commit`` after the vote (optimizer,
  scheduler, extra state, the epoch's sums); everything else a replica holds is replicated
  state (``register_state``) that a healing peer fetches: the weights, optimizer, scheduler,
  ``QuorumProgress`` (epoch, history, early stop, the partial epoch's sums) and the checkpoint
  timeline;
* the epoch end is a round of its own (as in every mode): once an epoch's batches are
  committed, the next attempt evaluates instead of training, each participant a contiguous
  part of the validation set, and the sums travel in one collective; its commit appends the epoch's record and takes the
  early-stop decision, the same on every replica (they hold the same sums). A failed round is
  redone over the next quorum like a failed step. Participant 0 of the round prints the epoch
  line and writes ``metrics.jsonl``. The Manager's step counts these rounds too, so the
  training step is the loop's (``TrainState.step``);
* module buffers (BatchNorm statistics) are participant 0's after every step, as DDP
  broadcasts rank 0's, and are put back when an attempt is discarded;
* checkpoints: participant 0 of a step that is due saves it (asynchronously; it takes the
  directory lock from the replica that saved before it, which belongs to the same job). A job
  whose replicas all start at step 0 (a launch, a requeue, or every replica lost) loads
  ``latest`` in its first attempt, which is then discarded; a restarted replica whose peers
  are ahead never reads a checkpoint, it heals.

Limits: saves are made by one replica at a time, so a replica that dies
mid-save leaves an uncommitted folder that the next save cleans up, never a committed one.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from elastic_train.boundary import Decision
from elastic_train.checkpoint.format import CheckpointInvalid, checkpoint_key, latest_target, step_dir_name, step_of
from elastic_train.checkpoint.manager import Checkpointer, Loaded, NewerCommitted, choose_checkpoint, load
from elastic_train.checkpoint.snapshot import Snapshot
from elastic_train.config import TrainConfig
from elastic_train.data import Indexed
from elastic_train.data.sampler import loss_weight, split_evenly
from elastic_train.distributed.shard_state import load_module_shards, load_optimizer_shards, local_shard, local_state
from elastic_train.errors import UsageError
from elastic_train.faults import FaultInjector
from elastic_train.logs import file_only
from elastic_train.metrics import EpochRecord, MetricSums, Totals, format_digest
from elastic_train.quorum.agreement import (
    LineChoice,
    QuorumPosition,
    check,
    decode,
    empty_block,
    expected_commits,
    mint_lineage,
    position_block,
    timeline_key,
)
from elastic_train.quorum.group_comm import GroupComm
from elastic_train.quorum.line import (
    CLAIMANTS,
    Claim,
    LineAlive,
    LineLedger,
    Version,
    agreed,
    claims_block,
    decode_claims,
    off_line,
)
from elastic_train.quorum.replica import Replica, StepAttempt
from elastic_train.quorum.schedule import QuorumSchedule, StepShare
from elastic_train.quorum.timeouts import WaitBound
from elastic_train.resilience.goodput import Accounting
from elastic_train.resilience.preemption import PreemptionFlag, StopKind
from elastic_train.resilience.watchdog import StepWatchdog
from elastic_train.strategy import Attempt, Share
from elastic_train.trainer import TRAIN_DIGEST, TRAIN_SUMS, TrainState

if TYPE_CHECKING:
    from elastic_train.trainer import Trainer

log = structlog.get_logger(__name__)

_LOW32 = np.uint64(0xFFFFFFFF)
# Layout of the per-step exact sums (float64; every entry is an integer or a loss sum): the
# epoch metrics, two votes, and the sample digest's two uint64 lanes as 32-bit halves (a sum of
# halves over W participants stays below 2^53, exact in float64, for W < 2^21).
CORRECT, LOSS_SUM, SAMPLES, STOP, SAVE, DIGEST = 0, 1, 2, 3, 4, 5
STATS = DIGEST + 4
# Lines of metrics.jsonl older than the job's start (less this, for other hosts' clocks) are an
# earlier run's: the same epoch there does not stand for this job's line.
METRICS_CLOCK_SLACK_S = 60.0
MAX_DISCARDS = 20  # attempts in a row before a worker gives up (see ``fit``)
CLAIM_RETRY_S = 1.0  # the pause after an attempt whose claims were refused
PROGRESS_EVERY = 5  # committed steps between "committed" log events (each replica's progress)


class Rejoin(RuntimeError):
    """This replica's state must not go on: the worker exits with ``QUORUM_STATE_UNSAFE`` so
    that its agent restarts it, and the restarted worker heals from a live peer."""


@dataclass(frozen=True)
class _Salvage:
    """A failed attempt's local work: its share's gradients (left in ``p.grad``) and sums."""

    step: int
    world: int  # the failed attempt's participants (the gradients are scaled for it)
    indices: tuple[int, ...]
    stats: torch.Tensor  # this participant's addends, not yet summed


@dataclass
class QuorumProgress:
    """Where the run is, replicated on every replica (healed with the weights)."""

    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # global batches of the current epoch committed
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # correct, loss sum, samples
    digest: list[int] = field(default_factory=lambda: [0, 0])  # the epoch's uint64 lanes
    elapsed: float = 0.0  # the epoch's training seconds so far
    history: list[dict[str, Any]] = field(default_factory=list)
    early_stop: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    timeline: str = ""  # the checkpoints' line of training (``Checkpointer.timeline``)
    # Goodput bookkeeping (``Accounting``): when the job started, the workers lost from the
    # quorum, the time from a commit to the next successful attempt when attempts failed in
    # between, and the steps those attempts had trained (lost work).
    job_start: float = 0.0
    failures: int = 0
    lost_s: float = 0.0
    discarded: int = 0
    # The line of training this state belongs to (``agreement.mint_lineage``): minted when a
    # quorum starts from a checkpoint or from the seed, taken over with a heal. Two replicas at
    # the same position on different lines hold different weights and must not average.
    lineage: int = 0
    # The quorum id that committed the last step (0 at the line's start; ``line.Version``).
    tip: int = 0

    def accounting(self) -> Accounting:
        return Accounting(
            self.job_start, {"failure": self.failures} if self.failures else {}, self.lost_s, self.discarded
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def load(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def add_digest(self, lanes: np.ndarray[Any, Any]) -> None:
        mine = np.array(self.digest, dtype=np.uint64)
        mine += lanes.astype(np.uint64)
        self.digest = [int(v) for v in mine]

    def totals(self) -> Totals:
        correct, loss_sum, samples = self.sums
        return Totals(correct, loss_sum, int(samples), format_digest(np.array(self.digest, dtype=np.uint64)))


# The stop vote travels in the SUM-reduced stats: each replica adds STOP_BASE ** kind, so the
# strongest kind asked for anywhere is the highest power present (exact in float64 below
# STOP_BASE replicas). Every replica then stops the same way: a Ctrl-C on one node's agent is
# an interrupt on every replica, never a preemption a job script would requeue.
STOP_BASE = 1024


def stop_vote(kind: StopKind) -> float:
    return float(STOP_BASE ** int(kind)) if kind is not StopKind.NONE else 0.0


def agreed_stop(total: float) -> StopKind:
    """The strongest stop in a sum of ``stop_vote``s (``NONE`` for 0)."""
    for kind in sorted(StopKind, reverse=True):
        if kind is not StopKind.NONE and total >= STOP_BASE ** int(kind):
            return kind
    return StopKind.NONE


def sums_stats(sums: MetricSums, votes: tuple[StopKind, bool]) -> torch.Tensor:
    """A member's exact sums and votes as addends to the step's collective (``STATS`` float64
    values): correct, loss sum and samples, the two votes, the digest lanes as 32-bit halves."""
    stats = torch.zeros(STATS, dtype=torch.float64)
    stats[CORRECT:STOP] = sums.sums.detach().to("cpu", torch.float64)
    stats[STOP], stats[SAVE] = stop_vote(votes[0]), float(votes[1])
    lanes = sums._lanes()
    stats[DIGEST:] = torch.from_numpy(np.concatenate([lanes & _LOW32, lanes >> np.uint64(32)]).astype(np.float64))
    return stats


def stats_sums(stats: torch.Tensor) -> MetricSums:
    """The summed ``STATS`` back as sums (on the CPU) of the whole step."""
    sums = MetricSums(torch.device("cpu"))
    sums.sums.copy_(stats[CORRECT:STOP])
    sums.add_digest(torch.from_numpy(digest_lanes(stats).view(np.int64)))
    return sums


def digest_lanes(stats: torch.Tensor) -> np.ndarray[Any, Any]:
    """The summed halves back into two uint64 lanes (mod 2^64)."""
    halves = stats[DIGEST:STATS].numpy().astype(np.uint64)
    return (halves[:2] + (halves[2:] << np.uint64(32))).astype(np.uint64)


class QuorumStrategy:
    """The loop's ``StepStrategy`` in quorum mode: this worker belongs to a replica group of
    ``comm.size`` workers; each step the live groups form a quorum (``Replica.begin_step``), their
    workers train their shares of the step's global batch, average gradients (inside the group
    by DDP or FSDP2, across the groups here) and vote (``Replica.commit``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        checkpointer: Checkpointer,
        preemption: PreemptionFlag,
        watchdog: StepWatchdog | None = None,
        groups: int = 1,
        faults: FaultInjector | None = None,
        job_start: float | None = None,
        comm: GroupComm | None = None,
        ledger: LineLedger | None = None,
    ) -> None:
        self.cfg = cfg
        # This worker's replica group (K workers, DDP or FSDP2 inside it; one by default).
        self.comm = comm if comm is not None else GroupComm()
        self.checkpointer = checkpointer
        self.preemption = preemption
        self.watchdog = watchdog
        self.groups = groups  # replica groups the job was launched with (start line)
        self.processes = groups * self.comm.size  # workers (the summary's process count)
        self.faults = faults  # injected faults (tests, benchmarks): ``rank`` is the replica group
        self.job_start = job_start or time.time()
        # Inside the step watchdog's limit, which last saw this replica before the round's collective.
        self.eval_timeout_s = 0.5 * cfg.hang_timeout if cfg.hang_timeout else 600.0
        # How long an attempt's collectives wait for peers, each measured on its own: the first
        # (the exchange) waits for the slowest peer's forward and backward, the gradient average
        # for the gradients to cross the slowest link (timeouts.WaitBound).
        self.exchange_bound = WaitBound(cfg.peer_timeout, self.eval_timeout_s)
        self.gradient_bound = WaitBound(cfg.peer_timeout, self.eval_timeout_s)
        # The quorum id of an attempt whose collective failed: gloo's group is then broken until
        # the quorum changes, which torchft 0.2.0 does only when the membership does.
        self._broken_group: int | None = None
        self._last_save = time.monotonic()
        self._buffers_before: list[torch.Tensor] = []
        self._synced_buffers = torch.zeros(0, dtype=torch.float64)
        self._salvage: _Salvage | None = None
        self._fills = 0  # FSDP2 evaluation: forwards this worker adds to match its group's longest part
        self._step_share: StepShare | None = None  # the current attempt's whole share
        self._prior: torch.Tensor | None = None  # a salvaged attempt's stats, added to this one's
        self._summed = torch.zeros(STATS, dtype=torch.float64)  # the committed step's summed stats
        self._announced = False
        # Bookkeeping between commits (``discarded`` / ``committed``): what a failure cost.
        self._world, self._discarded, self._quorum_id = 0, 0, -1
        self._last_commit = time.perf_counter()
        self._began = self._last_commit
        # The line record in etcd (``quorum.line``, with --lighthouse-etcd): participant 0 claims
        # each step there, on a thread of its own while the step's forward and backward run.
        self.ledger = ledger
        self._claimer = ThreadPoolExecutor(1, thread_name_prefix="line-claim") if ledger is not None else None
        # This participant's claim of the attempt: (claimant slot, the version claimed, the answer).
        self._claim: tuple[int, Version, Future[Claim] | Claim] | None = None
        self._inflight: Future[Claim] | None = None  # the claim thread's current request
        self._agreed: Version | None = None  # the version the attempt's claims agreed on
        self._refusal = ""  # why the last claims were refused (the discards' error names it)
        self._start_failures = 0  # starts of a line in a row whose record etcd did not take
        self._saving: dict[int, tuple[int, Version]] = {}  # train step -> (lineage, version) being saved
        if ledger is not None:
            checkpointer.commit_guard = self._may_commit_checkpoint

    # ------------------------------------------------------------------ the loop's model
    def wrap(self, module: nn.Module, loop: Trainer) -> nn.Module:
        """Inside the replica group: the bare module for a group of one worker, DDP over a
        larger group, or FSDP2 in place over the group (``--parallel fsdp``: the shard
        dimension inside the group, the replicate dimension managed by the quorum). Across the
        groups the gradients are averaged after backward (``reduce_step``)."""
        samples = len(loop.data.train)  # type: ignore[arg-type]
        self.schedule = QuorumSchedule(samples, self.cfg.batch_size, self.cfg.seed, self.cfg.max_steps_per_epoch)
        self.train_items = Indexed(loop.data.train, by_epoch=loop.data.train_by_epoch)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        # Floating or integer module buffers (BatchNorm statistics): kept equal on every replica.
        self._buffers = list(module.buffers())
        if self.cfg.parallel == "fsdp":
            from elastic_train.distributed.fsdp import mesh_for, shard_model  # DTensor: only when used

            blocks = loop.task.fsdp_blocks(module) if loop.task.fsdp_blocks is not None else None
            sharded = shard_model(module, mesh_for(loop.device, self.comm.size), blocks, loop.precision.dtype)
            self.gradient_bytes //= self.comm.size  # each worker averages its own shard across groups
            return sharded
        if self.comm.size == 1:
            return module
        # Plain DDP: quorum mode is equal up to summation order, so its own buckets (which overlap
        # the backward) stay; restart mode fixes them (elastic_train.distributed.ddp).
        return DistributedDataParallel(
            module,
            device_ids=[loop.device.index] if loop.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            find_unused_parameters=loop.task.find_unused_parameters,
        )

    def bind(self, loop: Trainer) -> None:
        self.loop = loop
        self.progress = QuorumProgress(
            early_stop=loop.stopper.state(), timeline=self.checkpointer.timeline, job_start=self.job_start
        )

    def start(self) -> None:
        pass  # the start lines wait for the first quorum (``_announce``)

    def attach(self, replica: Replica) -> None:
        """What a healing peer fetches: everything a committed step changes."""
        self.replica = replica
        loop = self.loop
        guarded = self.checkpointer.guarded  # the model and optimizer are guarded by their hooks
        module, optimizer = loop.module, loop.optimizer
        if self.cfg.parallel == "fsdp":
            # Each worker moves its own shards, from the worker of the same group rank in a live
            # group (same shard shapes); nothing is gathered.
            replica.register_state(
                "model", partial(load_module_shards, module), lambda: local_state(module.state_dict())
            )
            replica.register_state(
                "optimizer", partial(load_optimizer_shards, optimizer), lambda: local_state(optimizer.state_dict())
            )
        else:
            replica.register_state("model", module.load_state_dict, module.state_dict)
            replica.register_state("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        replica.register_state("scheduler", guarded(loop.scheduler.load_state_dict), loop.scheduler.state_dict)
        scaler = loop.precision.scaler
        if scaler.is_enabled():
            replica.register_state("scaler", guarded(scaler.load_state_dict), scaler.state_dict)
        if loop.extra is not None:
            replica.register_state("extra", guarded(loop.extra.load_state_dict), loop.extra.state_dict)
        replica.register_state("progress", guarded(self._load_progress), self._progress_state)

    # ------------------------------------------------------------------ replicated progress
    def _progress_state(self) -> dict[str, Any]:
        """The loop's position and partial epoch, and this mode's bookkeeping (``QuorumProgress``)."""
        loop, p = self.loop, self.progress
        p.epoch, p.batch_in_epoch = loop.state.epoch, loop.state.batch_in_epoch
        p.sums = [float(v) for v in loop.sums.sums.cpu()]
        p.digest = [int(v) for v in loop.sums._lanes()]
        p.elapsed = loop.elapsed
        p.history = [r.to_json() for r in loop.state.history]
        p.finished = loop.state.finished
        p.early_stop = loop.stopper.state()
        p.timeline = self.checkpointer.timeline
        return p.to_json()

    def _load_progress(self, state: dict[str, Any]) -> None:
        p, loop = self.progress, self.loop
        p.load(state)
        step = p.epoch * loop.batches_per_epoch + p.batch_in_epoch
        loop.state = TrainState(p.epoch, step, p.batch_in_epoch, [EpochRecord(**r) for r in p.history], p.finished)
        totals = p.totals()
        sums = MetricSums(loop.device)
        sums.sums.copy_(torch.tensor([totals.correct, totals.loss_sum, float(totals.samples)], dtype=torch.float64))
        sums.add_digest(torch.from_numpy(np.array(p.digest, dtype=np.uint64).view(np.int64)))
        loop.sums, loop.elapsed = sums, p.elapsed
        loop.stopper.resume(p.early_stop)
        self.checkpointer.timeline = p.timeline

    # ------------------------------------------------------------------ positions
    @property
    def commits(self) -> int:
        """The Manager step this position stands for: what a continuous run has committed
        (the Manager's step also counts evaluation rounds)."""
        return expected_commits(self.loop.state.step, self.loop.state.epoch)

    def position(self) -> QuorumPosition:
        state = self.loop.state
        timeline = timeline_key(self.checkpointer.timeline)
        return QuorumPosition(
            self.commits,
            state.step,
            state.epoch,
            self.loop.evaluating,
            self.progress.lineage,
            timeline,
            self.progress.tip,
        )

    def version(self) -> Version:
        """Where this replica stands on its line (``quorum.line``)."""
        return Version(self.commits, self.progress.tip)

    def _check_step(self, replica: Replica) -> None:
        """The Manager step is a function of the position, on every replica (a heal brings
        both from the same peer): torchft then heals by position, never back."""
        if replica.committed_steps != self.commits:
            raise Rejoin(
                f"manager step {replica.committed_steps} does not stand for this replica's position "
                f"({self.position().describe()}, i.e. step {self.commits}): its state is not trusted"
            )

    def _leave_a_broken_group(self, replica: Replica, attempt: StepAttempt) -> None:
        """A collective of the last attempt failed with every peer alive (a wait ran into its
        bound): gloo closed the connections, and torchft reconfigures the group only when the
        quorum changes, so every later collective of this membership would fail at once (a
        discard storm). The quorum's last participant leaves (restarted, it heals), which
        changes the quorum; the others reconfigure with it."""
        broken, self._broken_group = self._broken_group, None
        k = self.comm.size
        if broken is None or replica.quorum_id != broken or attempt.world < 2 * k:
            return
        if attempt.rank // k == attempt.world // k - 1:  # the last group, every worker of it
            raise Rejoin(
                f"a collective of quorum {broken} failed with every participant alive and the quorum did not "
                "change: its process group is broken; leaving so that the quorum re-forms (raise --peer-timeout "
                "if this repeats)"
            )

    # ------------------------------------------------------------------ one attempt
    def begin_step(self) -> Attempt | None:
        """The quorum for the next step (a heal first if this replica is behind); while the
        whole quorum stands at step 0, where the line of training starts (``_start_line``)."""
        loop, replica = self.loop, self.replica
        if self.watchdog is not None:  # waiting for a quorum (bounded by the quorum timeout)
            self.watchdog.beat(loop.state.step, "quorum")
        if self.faults is not None:
            self.faults.before_quorum()
        attempt = replica.begin_step(self.schedule, lambda: loop.state.step)
        self._check_step(replica)
        self._leave_a_broken_group(replica, attempt)
        if replica.quorum_id != self._quorum_id:
            self._quorum_id = replica.quorum_id
            self.exchange_bound.new_membership()
            self.gradient_bound.new_membership()
        if attempt.heal is not None:
            heal = attempt.heal
            log.info("healed", from_step=heal.from_step, to_step=heal.to_step, seconds=round(heal.seconds, 3))
            loop.restart_clock()
        self._attempt = attempt
        loop.console.enabled = attempt.rank == 0  # participant 0 prints (an epoch's line: ``publish``)
        if not self._announced:
            self._announced = True
            self._announce(attempt)
        if attempt.step == 0 and self._start_line(replica, attempt):
            loop.restart_clock()
            return None
        if not loop.over:
            self._begin_claim(attempt)
        if loop.over or loop.evaluating:
            return Attempt(attempt.world, attempt.rank, None)
        return Attempt(attempt.world, attempt.rank, *self._share(attempt))

    def _begin_claim(self, attempt: StepAttempt) -> None:
        """The attempt's claimants (the first groups' first workers) claim its step: in the line
        record when there is one (on the claim thread, answered in the first collective), else
        participant 0 alone, at once (the quorum's id still travels, so that every participant
        records the same ``tip``)."""
        self._claim, self._agreed, self._refusal = None, None, ""
        group, inside = divmod(attempt.rank, self.comm.size)
        if inside != 0 or group >= (CLAIMANTS if self.ledger is not None else 1):
            return
        new, mine = Version(self.commits + 1, self.replica.quorum_id), self.version()
        if self.ledger is None or self._claimer is None:
            self._claim = (group, new, Claim(True, new, mine_tip=mine.tip))
            return
        if self._inflight is not None and not self._inflight.done():
            # An earlier claim still waits for etcd: queued behind it, this one would land late.
            self._claim = (
                group,
                new,
                Claim(False, new, None, "an earlier claim still waits for etcd", mine_tip=mine.tip),
            )
            return
        # An evaluation round is quiet for up to its bound: a start of a line watches that long.
        quiet = self.eval_timeout_s if self.loop.evaluating else 0.0
        self._inflight = self._claimer.submit(self.ledger.claim, self.progress.lineage, mine, new, quiet)
        self._claim = (group, new, self._inflight)

    def _claim_block(self, bound_s: float) -> tuple[torch.Tensor, Claim | None]:
        """This participant's addend for the claims, and its own claim (None: not a claimant).
        The answer is awaited at most ``bound_s`` (the peers wait for it in the collective): a
        later one counts as refused (a swap that lands late is an unapplied head, which the
        next attempt voids or finds already made)."""
        if self._claim is None:
            return claims_block(None, None), None
        slot, new, answer = self._claim
        if isinstance(answer, Future):
            try:
                answer = answer.result(timeout=bound_s)
            except FutureTimeout:
                answer = Claim(False, new, None, f"etcd did not answer the claim within {bound_s:.1f} s")
        training = answer.ok and not self.loop.evaluating  # the fault names a training step
        if training and self.faults is not None and self.faults.fires("kill_after_claim", self.loop.state.step + 1):
            os.kill(os.getpid(), signal.SIGKILL)  # claimed, not applied anywhere: the next quorum voids it
        return claims_block(answer, slot), answer

    def _share(self, attempt: StepAttempt) -> tuple[Share, bool]:
        """This replica's share, less what a salvaged attempt of the same step already trained.

        A survivor redoing a step whose gradient average failed (a peer died) keeps what it
        computed: its gradients are still its own share's (the average writes them back only on
        success), so it trains only the samples of its new share it has not trained yet and
        rescales (``_Salvage``). Not with module buffers, which the first forward changed."""
        share, stash = attempt.share, self._salvage
        self._salvage, self._step_share, self._prior = None, share, None
        reuse = (
            stash is not None
            and attempt.heal is None
            and stash.step == share.step
            and not self._buffers
            and self.comm.size == 1  # DDP / FSDP2 inside a group reduce every backward again
            and set(stash.indices) <= set(share.indices)
        )
        if reuse:
            assert stash is not None
            with torch.no_grad():  # its W_old/G * sum(old share) becomes W/G * sum(old share)
                for p in self.loop.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(attempt.world / stash.world)
            done = set(stash.indices)
            rest = [i for i in share.indices if i not in done]
            self._prior = stash.stats.clone()
            log.info("salvaged", step=share.step, kept=len(stash.indices), computing=len(rest))
        else:
            rest = list(share.indices)
            self._buffers_before = [b.detach().clone() for b in self._buffers]  # a discarded attempt's
        self.loop.model.train()  # type: ignore[no-untyped-call]
        weight = loss_weight(len(rest), self.cfg.batch_size, attempt.world)
        if not rest:
            return Share([], torch.zeros(0, dtype=torch.long), weight), reuse
        keys: list[Any] = [(share.epoch, i) for i in rest] if self.loop.data.train_by_epoch else rest
        *batch, indices = default_collate([self.train_items[k] for k in keys])
        return Share(batch, indices, weight), reuse

    def reduce_step(self, attempt: Attempt, sums: MetricSums) -> MetricSums | None:
        """The step's collectives: the exact sums with every participant's position, then the
        gradient average, then participant 0's buffers. None: a collective failed or the
        positions differ, and the attempt will not commit (its work is kept: ``_Salvage``)."""
        assert self._step_share is not None
        save_due = self.cfg.checkpoint_every_seconds > 0 and (
            time.monotonic() - self._last_save >= self.cfg.checkpoint_every_seconds
        )
        stats = sums_stats(sums, (self.preemption.kind, save_due and attempt.rank == 0))
        if self._prior is not None:
            stats[CORRECT:STOP] += self._prior[CORRECT:STOP]
            stats[DIGEST:] += self._prior[DIGEST:]
        mine = stats.clone()
        # First the positions (and the sums): gradients of different global batches are never averaged.
        summed = self._exchange(attempt, stats)
        # The group agrees on its average: a worker that skipped the commit vote while a sibling
        # cast one would hold the group's vote (torchft waits for every group rank) to its timeout.
        if summed is None or not self._group_agrees(self._average_gradients()):
            share = self._step_share
            self._salvage = _Salvage(share.step, attempt.world, share.indices, mine)
            return None
        if self._buffers and not self._sync_buffers(attempt):
            return None
        self._summed = summed
        return stats_sums(summed)

    def _exchange(self, attempt: Attempt, stats: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor | None:
        """The attempt's first collective: the step's exact sums and every participant's
        position (``agreement``), in one SUM. Returns the summed ``stats``, or None when the
        collective failed or the participants stand at different positions: then nothing
        commits, and a participant that differs from participant 0 raises ``Rejoin``."""
        replica = self.replica
        block = position_block(self.position(), attempt.rank, attempt.world)
        bound = timeout_s if timeout_s is not None else self.exchange_bound.seconds()
        claim_block, own_claim = self._claim_block(0.5 * bound)
        both = torch.cat([stats, block, claim_block])
        began = time.perf_counter()
        summed = replica.sum(both, timeout_s=bound)
        if not summed:
            log.info("exchange_failed", bound_s=round(bound, 3), after_s=round(time.perf_counter() - began, 3))
            if timeout_s is None:
                self.exchange_bound.failed(time.perf_counter() - began)
            self._broken_group = replica.quorum_id
        # Across the groups each worker summed with the same group rank; inside the group the
        # rest (every worker's row and addends). A sibling's failure fails the whole group.
        if not self._group_agrees(summed, both):
            return None
        if timeout_s is None:
            self.exchange_bound.record(time.perf_counter() - began)
        try:
            positions = decode(both[stats.numel() : -claim_block.numel()], attempt.world)
            claims = decode_claims(both[-claim_block.numel() :])
        except ValueError as exc:  # a row written by none or by two: the membership is not what we think
            replica.refuse(f"position exchange garbled: {exc}")
            log.error("position_exchange_garbled", step=self.loop.state.step, error=str(exc))
            return None
        disagreement = check(positions, attempt.rank)
        version = agreed(claims)
        if version is None:
            self._refused_claims(attempt, claims, own_claim, positions)
            return None
        if own_claim is not None and own_claim.voided is not None:
            log.warning("line_claim_voided", step=self.loop.state.step, voided=str(own_claim.voided), by=str(version))
        self._agreed = version
        if disagreement is not None:
            why = disagreement.explain(attempt.rank)
            replica.refuse(why)
            log.error("position_mismatch", step=self.loop.state.step, detail=why)
            # With the line record the taken claim says where the line is (not participant 0).
            leave = (
                self._off_line(attempt, claims, positions)
                if self.ledger is not None
                else attempt.rank in disagreement.differing
            )
            if leave:
                raise Rejoin(why)
            return None
        return both[: stats.numel()]

    def _refused_claims(
        self, attempt: Attempt, claims: dict[int, Claim], own: Claim | None, positions: list[QuorumPosition]
    ) -> None:
        """No claim of the attempt was taken (or the claimants claimed different versions):
        nothing commits. A replica whose state the record says is not the line's leaves and
        heals; the others try again (a live replica holding the line's head heals them)."""
        # Only a claimant's own answer carries its reason (the collective carries the verdicts).
        why = own.why if own is not None and own.why else "no claim of the attempt was taken by the line record"
        if len({c.new for c in claims.values()}) > 1:
            why = f"the claimants claimed different versions ({sorted(str(c.new) for c in claims.values())})"
        self._refusal = why
        self.replica.refuse(why)
        mine, lineage = self.version(), self.progress.lineage
        log.warning("line_claim_refused", step=self.loop.state.step, world=attempt.world, mine=str(mine), detail=why)
        if self._off_line(attempt, claims, positions):  # this participant's own claim included
            found = next((c.found for c in claims.values() if c.found is not None), None)
            raise Rejoin(
                f"this replica's state ({mine}, lineage {lineage:x}) is not on the job's line: the line record "
                f"holds {found.head if found is not None else '-'} of lineage {found.lineage if found else 0:x}; "
                "restarting to heal from a replica on it"
            )
        # Nothing changes by trying again at once (etcd out of reach fails in microseconds when
        # the route is gone): paced, the attempts in a row that end a worker span ~20 s.
        time.sleep(CLAIM_RETRY_S)

    def _off_line(self, attempt: Attempt, claims: dict[int, Claim], positions: list[QuorumPosition]) -> bool:
        """``line.off_line`` for this participant (claimant slot g is participant g x K)."""
        stands = [(p.lineage, Version(p.commits, p.tip)) for p in positions]
        return off_line(claims, stands, lambda slot: slot * self.comm.size, attempt.rank)

    def _may_commit_checkpoint(self, step: int) -> str | None:
        """The checkpointer's guard, before a save of ``step`` commits: the line record must
        confirm the version saved (``LineLedger.check_commit``)."""
        saving = self._saving.pop(step, None)
        for older in [s for s in self._saving if s < step]:  # saves that failed before their commit
            del self._saving[older]
        if self.ledger is None or saving is None:
            return None if self.ledger is None else f"step {step} was not saved by this strategy"
        lineage, version = saving
        return self.ledger.check_commit(lineage, version)

    def _average_gradients(self) -> bool:
        bound = self.gradient_bound.seconds()
        step = self.loop.state.step
        if self.faults is not None:  # a slow link on this replica: its peers wait in the average
            time.sleep(self.faults.link_delay(self.gradient_bytes, step + 1))
            if self.faults.fires("kill_before_average", step + 1):  # the peers' average then fails
                os.kill(os.getpid(), signal.SIGKILL)
        began = time.perf_counter()
        if not self._average_across_groups(bound):
            after = time.perf_counter() - began
            self.gradient_bound.failed(after)
            self._broken_group = self.replica.quorum_id
            log.info("gradient_average_failed", bound_s=round(bound, 3), after_s=round(after, 3))
            return False
        took = time.perf_counter() - began
        self.gradient_bound.record(took)
        if took > self.cfg.peer_timeout:  # a flat --peer-timeout would have failed this one
            log.info("gradient_average_slow", seconds=round(took, 3), bound_s=round(bound, 3))
        return True

    def _group_agrees(self, ok: bool, tensor: torch.Tensor | None = None) -> bool:
        """Every worker of this replica group says ``ok`` (and ``tensor`` is SUMmed over the
        group: ``GroupComm``). A sibling's failed collective is the whole group's: each of its
        workers then treats the quorum's group as broken (``_leave_a_broken_group``)."""
        agreed = self.comm.sum(tensor, ok) if tensor is not None else self.comm.all(ok)
        if not agreed:
            self._broken_group = self.replica.quorum_id
        return agreed and ok

    def _average_across_groups(self, bound: float) -> bool:
        """DDP inside a group (or a group of one) holds whole gradients; FSDP2 reduce-scattered
        them over the group, and each worker averages its shard with the same shard of every
        other group (zeros for a parameter without a gradient, so every group sends one layout)."""
        params = [p for p in self.loop.module.parameters() if p.requires_grad]
        if self.cfg.parallel != "fsdp":
            return self.replica.average_gradients(params, timeout_s=bound)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return self.replica.average([local_shard(p.grad) for p in params if p.grad is not None], timeout_s=bound)

    def _sync_buffers(self, attempt: Attempt) -> bool:
        """Participant 0's buffers become everyone's, as DDP broadcasts rank 0's: a SUM where
        every other participant contributes zeros (one collective, any dtype via float64)."""
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64).cpu() for b in self._buffers])
        if attempt.rank != 0:
            flat.zero_()
        summed = self.replica.sum(flat, timeout_s=self.exchange_bound.seconds())
        if not summed:
            self._broken_group = self.replica.quorum_id
        if not self._group_agrees(summed, flat):  # the first group's other workers sent zeros
            return False
        self._synced_buffers = flat
        return True

    def commit(self, apply: Callable[[], None]) -> bool:
        return self.replica.commit(apply)

    def on_apply(self) -> None:
        """A committed step's buffers: participant 0's (``_sync_buffers``)."""
        if self._buffers:
            offset = 0
            with torch.no_grad():
                for buffer in self._buffers:
                    n = buffer.numel()
                    buffer.copy_(self._synced_buffers[offset : offset + n].view_as(buffer).to(buffer.dtype))
                    offset += n

    def discarded(self, attempt: Attempt, evaluating: bool, began: float) -> None:
        """Nothing of the attempt was applied; the next quorum redoes the step."""
        if self._buffers and not evaluating:  # the forward changed them (BatchNorm statistics)
            with torch.no_grad():
                for buffer, before in zip(self._buffers, self._buffers_before, strict=True):
                    buffer.copy_(before)
        step = self.loop.state.step
        # attempt_s: the attempt's own time, from its quorum to the failed vote (lost work).
        attempt_s = round(time.perf_counter() - began, 3)
        log.info("discarded", step=step, world=attempt.world, evaluating=evaluating, attempt_s=attempt_s)
        if not self._discarded:
            self._began = began
        self._discarded += 1
        if self._discarded >= MAX_DISCARDS:
            # A replica that heartbeats but whose collectives always fail (gloo bound to the
            # wrong interface, a firewall, a timeout shorter than the allreduce) would keep
            # every quorum failing forever: end this worker, with the likely causes.
            if self._refusal:  # the collectives worked: the line record in etcd refused the step
                raise RuntimeError(
                    f"{self._discarded} attempts in a row at step {step} were discarded (world {attempt.world}): "
                    f"the line record refused them ({self._refusal}). Check that etcd's members "
                    f"({','.join(self.ledger.endpoints) if self.ledger else '-'}) answer from every node; when a "
                    "replica holding the line's head is cut off, the others wait for it (docs/fault-tolerance.md, "
                    "'The line record')"
                )
            raise RuntimeError(
                f"{self._discarded} attempts in a row at step {step} were discarded (world {attempt.world}): the "
                "replicas reach the Lighthouse but not each other. Check GLOO_SOCKET_IFNAME (the "
                "interface the nodes share), firewalls between the nodes, and raise --peer-timeout "
                "if a step's allreduce takes longer"
            )

    def committed(self, attempt: Attempt) -> None:
        """What a membership change cost (goodput): the time from the previous commit,
        including the discarded attempts, detection, the new quorum and any heal."""
        now, p, step = time.perf_counter(), self.progress, self.loop.state.step
        if self._agreed is not None:  # the version the claims agreed on, the same on every participant
            p.tip, self._agreed = self._agreed.tip, None
        if attempt.world != self._world or self._discarded:
            log.info(
                "quorum_changed",
                step=step,
                world=attempt.world,
                previous_world=self._world,
                discarded=self._discarded,
                seconds_since_commit=round(now - self._last_commit, 3),
                quorum_s=round(self._attempt.quorum_seconds, 3),  # forming this quorum (and healing, if any)
            )
        elif step % PROGRESS_EVERY == 0:
            log.info("committed", step=step, world=attempt.world)
        if self._discarded:
            p.lost_s += self._began - self._last_commit
            p.discarded += self._discarded
        if self._world and attempt.world < self._world:  # groups lost (each of K workers)
            p.failures += (self._world - attempt.world) // self.comm.size
        self._world, self._discarded, self._last_commit = attempt.world, 0, now

    # ------------------------------------------------------------------ evaluation round
    def val_batches(self, attempt: Attempt) -> Iterator[list[Any]]:
        """This participant's contiguous part of the validation set: exact (each sample once)
        for any membership, in batches of a training share's size (known to fit)."""
        val = self.loop.data.val
        part = split_evenly(len(val), attempt.world, attempt.rank)  # type: ignore[arg-type]
        items = Indexed(val)
        size = -(-self.cfg.batch_size // attempt.world)
        if self.cfg.parallel == "fsdp":
            if self.replica.refused:
                # An oversized quorum (``Replica._oversized``): the round cannot commit, and the
                # ranks it gave are clipped, so the group's counts below would differ.
                self._fills = 0
                return
            # Every FSDP2 forward gathers parameters over the group: each worker runs as many
            # forwards as the group's longest part (the rest in ``reduce_eval``). The parts
            # follow from the membership alone, so every worker counts the same without asking.
            first = attempt.rank - self.comm.rank
            counts = [
                -(-len(split_evenly(len(val), attempt.world, first + r)) // size)  # type: ignore[arg-type]
                for r in range(self.comm.size)
            ]
            self._fills = max(counts) - counts[self.comm.rank]
        for start in range(part.start, part.stop, size):
            yield default_collate([items[i] for i in range(start, min(start + size, part.stop))])

    def reduce_eval(
        self, attempt: Attempt, sums: MetricSums, extra: torch.Tensor
    ) -> tuple[Totals, torch.Tensor] | None:
        """The round's sums and the task's extra metric sums in one collective. Shards take
        uneven time (a node busier than another): wait for the slowest as long as the watchdog
        would let a rank evaluate, not the step collectives' few seconds."""
        if self.cfg.parallel == "fsdp":
            from elastic_train.distributed.fsdp import reshard_all

            for _ in range(self._fills):  # join the group's other gathers (``val_batches``)
                self.loop.forward_filler()
            self._fills = 0
            reshard_all(self.loop.module)
        stats = torch.cat([sums_stats(sums, (self.preemption.kind, False)), extra.detach().to("cpu", torch.float64)])
        summed = self._exchange(attempt, stats, timeout_s=self.eval_timeout_s)
        if summed is None:
            return None
        self._summed = summed[:STATS]
        val = stats_sums(summed[:STATS])
        correct, loss_sum, samples = (float(v) for v in val.sums)
        return Totals(correct, loss_sum, int(samples), val.digest_hex()), summed[STATS:]

    # ------------------------------------------------------------------ the epoch
    def epoch_totals(self, sums: MetricSums) -> Totals:
        """The epoch's sums are the committed steps' global sums already."""
        correct, loss_sum, samples = (float(v) for v in sums.sums.cpu())
        return Totals(correct, loss_sum, int(samples), sums.digest_hex())

    def epoch_time(self, elapsed: float) -> float:
        return elapsed

    def publish(self, record: EpochRecord) -> bool:
        """Every replica that committed the round offers the line; exactly one is written (the
        round's participant 0 may have failed its vote while the others committed)."""
        loop = self.loop
        first = loop.metrics_file.append_once(
            record.to_json(),
            key=("epoch", "step", "sample_digest"),
            since=self.progress.job_start - METRICS_CLOCK_SLACK_S,
        )
        if first:
            loop.console.line(
                record.console_line(loop.cfg.epochs, loop.task.rate_unit, loop.task.accuracy), always=True
            )
        return first

    def decide_stop(self, value: float) -> bool:
        """Every replica holds the same sums, so decides the same (no broadcast)."""
        return self.loop.stopper.update(value)

    # ------------------------------------------------------------------ between steps
    def boundary(self, attempt: Attempt, evaluated: bool) -> Decision:
        """Saves and an agreed stop. Every replica decides the same from the step's sums;
        participant 0 of the step saves."""
        loop, stats = self.loop, self._summed
        step, finished = loop.state.step, loop.state.finished
        stop = stats[STOP] > 0 and not finished
        every = self.cfg.checkpoint_every
        # The step that completes an epoch is not saved by the step count: its evaluation round
        # is next, and saves that step's state (one checkpoint per step, not two).
        periodic = not evaluated and not loop.evaluating and every > 0 and step % every == 0
        due = evaluated or periodic or (stats[SAVE] > 0 and not loop.evaluating)
        committed: bool | None = None
        if self._saves(attempt) and (stop or finished or due):
            # The last and a stopping step's checkpoints are waited for: the process ends next.
            committed = self._save(stop or finished)
        self._collect_save()
        kind = agreed_stop(float(stats[STOP])) if stop else StopKind.NONE
        # Only participant 0's group saves: a final save failed there is the run's failure.
        return Decision(stop=kind, stop_committed=bool(committed), committed=committed is not False)

    def _saves(self, attempt: Attempt) -> bool:
        """This worker's group is participant 0's: its workers save the step together (each its
        shards; the group's rank 0 holds the lock and commits)."""
        return attempt.rank // self.comm.size == 0

    def _save(self, sync: bool) -> bool | None:
        step, ck = self.loop.state.step, self.checkpointer
        error = ""
        try:
            if ck.pending:  # collective inside the group: judged before the lock is taken back
                ck.commit_pending()
            if self.comm.is_first:
                ck.lock.ensure_held()
        except (UsageError, OSError) as exc:
            error = str(exc)
        if not self.comm.all(not error):
            log.error(
                "checkpoint_failed", step=step, error=error or "a worker of the group", detail="could not take the lock"
            )
            return False
        self._last_save = time.monotonic()
        if self.ledger is not None and self.comm.is_first:  # what the commit guard asks the record about
            self._saving[step] = (self.progress.lineage, self.version())
        return ck.save(self._snapshot(), sync=sync)

    def _snapshot(self) -> Snapshot:
        """The loop's checkpoint state. The partial epoch's sums are the quorum's global sums on
        every worker: in a group, only its rank 0 writes them (the others zeros), so that a load
        sums them once (``restore``), at any world size and in either mode."""
        snap = self.loop.snapshot(self.loop.state.finished)
        if self.comm.rank == 0:
            return snap
        per_rank = dict(snap.per_rank)
        for key in (TRAIN_SUMS, TRAIN_DIGEST):
            per_rank[key] = torch.zeros_like(per_rank[key])
        return dataclasses.replace(snap, per_rank=per_rank)

    def _collect_save(self) -> None:
        """Commit this group's background save once every worker's shard is written (the
        commit is collective inside the group: every worker decides the same)."""
        ck = self.checkpointer
        if ck.pending and self.comm.all(ck.local_done()):
            ck.commit_pending()

    def accounting(self) -> Accounting:
        return self.progress.accounting()

    def close(self) -> None:
        pass

    def _announce(self, attempt: StepAttempt) -> None:
        loop = self.loop
        params = sum(p.numel() for p in loop.module.parameters())
        if attempt.step == 0 and attempt.heal is None:
            k = self.comm.size
            inside = "" if k == 1 else f" of {k} workers ({'FSDP2' if self.cfg.parallel == 'fsdp' else 'DDP'} inside)"
            loop.console.line(f"Training started with {self.processes} processes")
            loop.console.line(
                f"Fault tolerance: quorum ({attempt.world // k} of {self.groups} replica groups{inside} in the first "
                "quorum), "
                f"device: {loop.device.type}, model: {loop.task.name} ({params / 1e6:.2f}M params), "
                f"dataset: {loop.data.describe()}, global batch: {self.cfg.batch_size}, "
                f"precision: {loop.precision.name}"
            )
        log.info("run_config", **file_only(config=self.cfg.to_json(), params=params, mode="quorum"))

    # ------------------------------------------------------------------ where a line starts
    def _start_line(self, replica: Replica, attempt: StepAttempt) -> bool:
        """The whole quorum stands at step 0 (a launch, a requeue, every replica lost): where
        does its line of training start? Participant 0 alone chooses (the newest valid
        checkpoint, or the seed), settles the directory under the lock and mints the line's
        lineage; one collective gives its choice to the others, which load that very folder.
        A participant that cannot read it raises ``Rejoin`` (restarted, it heals from the
        others); the job goes on. True: the attempt is over (a checkpoint was loaded, and the
        next quorum continues from it; or nothing was agreed and step 0 is tried again)."""
        choice: LineChoice | None = None
        loaded: Loaded | None = None
        if attempt.rank == 0:
            choice, loaded = self._choose_line()
            if choice is not None and not self._start_record(choice, loaded):
                choice, loaded = None, None
        block = choice.block() if choice is not None else empty_block()
        # Waits for participant 0's choice (it reads and verifies the checkpoint): the bound of
        # the watchdog's limit, as an evaluation round's.
        summed = replica.sum(block, timeout_s=self.eval_timeout_s)
        if not summed:
            self._broken_group = replica.quorum_id
        if not self._group_agrees(summed, block):  # participant 0's choice reaches its group's other workers
            replica.discard(step=0, reason="the start of the line was not agreed")
            return True
        try:
            agreed = LineChoice.from_block(block)
        except ValueError as exc:
            replica.discard(step=0, reason=str(exc))
            return True
        if agreed is None:  # participant 0 chooses again at the next attempt
            replica.discard(step=0, reason="participant 0 made no choice")
            return True
        if agreed.checkpoint is not None and loaded is None:
            loaded = self._load_chosen(agreed)
        if loaded is not None:
            self.restore(loaded)
        self.progress.lineage, self.progress.tip = agreed.lineage, 0
        self.checkpointer.timeline = self.progress.timeline = agreed.timeline
        log.info("line_started", lineage=f"{agreed.lineage:x}", timeline=agreed.timeline, checkpoint=agreed.checkpoint)
        if loaded is None:
            return False  # from the seed: this attempt trains step 0
        replica.discard(step=self.commits, reason="loaded the checkpoint; the quorum continues from it")
        m = loaded.manifest
        self.loop.console.line(f"Resumed from {loaded.folder} at epoch {m.epoch + 1}, step {m.step}")
        log.info("resumed", path=str(loaded.folder), step=loaded.manifest.step, saved_world_size=loaded.world_size)
        return True

    def _start_record(self, choice: LineChoice, loaded: Loaded | None) -> bool:
        """Participant 0, before its choice travels: the line record names the new line, so a
        replica still on an earlier one (cut off while every other replica restarted) can never
        claim on it again. False: etcd did not answer; the line is chosen again."""
        if self.ledger is None:
            return True
        commits = expected_commits(loaded.position.step, loaded.position.epoch) if loaded is not None else 0
        try:
            if not self.ledger.start(choice.lineage, Version(commits, 0)):
                # A line ahead of the checkpoint, watched across attempts: is a replica on it?
                time.sleep(CLAIM_RETRY_S)
                return False
        except LineAlive as exc:  # a live replica holds the line: it heals the ones at step 0
            log.warning("line_alive", detail=str(exc), checkpoint_step=commits)
            time.sleep(CLAIM_RETRY_S)
            return False
        except Exception as exc:  # no record, no line: every participant retries
            self._start_failures += 1
            log.warning("line_record_unwritten", lineage=f"{choice.lineage:x}", error=f"{type(exc).__name__}: {exc}")
            if self._start_failures >= MAX_DISCARDS:
                raise RuntimeError(
                    f"the line record could not be written {self._start_failures} times in a row "
                    f"({type(exc).__name__}: {exc}): check that etcd's members ({','.join(self.ledger.endpoints)}) "
                    "answer from this node"
                ) from exc
            return False
        self._start_failures = 0
        return True

    def _choose_line(self) -> tuple[LineChoice | None, Loaded | None]:
        """Participant 0: the directory's one settler. None: choose again (a newer checkpoint
        was committed meanwhile, which is never moved aside in quorum mode)."""
        ck = self.checkpointer
        ck.take_lock()  # UsageError: another job holds the directory (every replica would hear the same)
        selection = choose_checkpoint(ck.cfg, ck.fingerprint)  # UsageError: nothing valid, incompatible, ...
        loaded = self._read(selection.folder, "it chose") if selection.folder is not None else None
        try:
            # --resume PATH is the user's choice of an older step: its future is moved aside as in
            # restart mode. With auto, anything newer is a replica of this job's commit: keep it.
            timeline = ck.settle(selection, keep_newer=self.cfg.resume == "auto")
        except NewerCommitted as exc:
            log.warning("line_choice_retried", detail=str(exc))
            return None, None
        key = checkpoint_key(selection.folder) if selection.folder is not None else None
        if selection.folder is not None and key is None:
            raise UsageError(f"checkpoint {selection.folder} is not a step folder", "pass a step-N folder to --resume")
        return LineChoice(key, mint_lineage(), timeline_key(timeline)), loaded

    def _load_chosen(self, choice: LineChoice) -> Loaded:
        """What participant 0 chose, found from the same flags (never from a path on the wire)."""
        assert choice.checkpoint is not None
        if self.cfg.resume == "auto":
            folder = self.checkpointer.cfg.root / step_dir_name(*choice.checkpoint)
        else:
            given = Path(self.cfg.resume)
            folder = latest_target(given) or given
            if checkpoint_key(folder) != choice.checkpoint:
                raise Rejoin(f"participant 0 loaded step folder {choice.checkpoint}, --resume names {folder}")
        loaded = self._read(folder, "participant 0 chose")
        self.checkpointer.adopt_loaded(loaded, choice.timeline)
        return loaded

    def _read(self, folder: Path, whose: str) -> Loaded:
        try:
            step = step_of(folder)
            if self.faults is not None and step is not None and self.faults.fires("load_error", step):
                raise OSError(errno.EIO, "injected load_error", str(folder))
            return load(folder)
        except (CheckpointInvalid, OSError) as exc:
            # Another replica may read it fine: this one restarts and heals from the quorum.
            raise Rejoin(f"could not load checkpoint {folder}, which {whose}: {exc}") from exc

    def restore(self, loaded: Loaded) -> None:
        """Continue from a checkpoint of any mode and world size: this worker loads its part as
        rank ``comm.rank`` of its group, and the partial epoch's sums of every rank that wrote
        it are folded into its own (every worker holds the global sums; the per-rank random
        streams are its own, not reseeded)."""
        loop = self.loop
        done = loop.restore(loaded, rank=self.comm.rank, world_size=self.comm.size, reseed=False)
        # Every worker holds the quorum's global sums: those of every rank that wrote it.
        sums = MetricSums(loop.device)
        for part in done.old_ranks:
            sums.sums += part[TRAIN_SUMS].to(loop.device, torch.float64)
            sums.add_digest(part[TRAIN_DIGEST])
        loop.sums = sums
        p = self.progress
        p.timeline = self.checkpointer.timeline
        saved = Accounting.from_json(done.payload.accounting) if done.payload.accounting else None
        if saved is not None:  # the job's start and losses so far (a restart-mode run's too)
            p.job_start, p.lost_s = saved.job_start, saved.lost_s
            p.failures = sum(saved.restarts.values())
            p.discarded = saved.recomputed_steps

    def weights_sha256(self) -> str:
        """sha256 of the model's tensors (names, dtypes, shapes, bytes; under FSDP2 this worker's
        shards): equal on the workers of one group rank in every replica group that ended on
        the same line of training."""
        digest = hashlib.sha256()
        for name, value in sorted(local_state(self.loop.module.state_dict()).items()):
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}|{flat.dtype}|{tuple(value.shape)}\n".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
