"""The built-in trainer in quorum mode (``--ft quorum``): survivors keep training.

The same task, data order, metrics, early stop and checkpoints as ``trainer.Trainer``; what
differs is who trains a step. Each worker is a replica group of its own (``Replica``); every
step the live replicas form a quorum, split the step's global batch (``QuorumSchedule``), average
their gradients and vote. A failed attempt is discarded by every participant and redone, with the
same global batch, by the next quorum; a restarted worker heals from a live peer. So:

* every committed step trains its global batch exactly once, whatever the membership, and the
  epoch's metrics (correct, loss sum, samples, the sample digest) are SUM-reduced inside the
  step's own collectives: they count committed steps only and are the same on every replica;
* everything a step changes is applied in ``Replica.commit`` after the vote (optimizer,
  scheduler, extra state, the epoch's sums); everything else a replica holds is replicated
  state (``register_state``) that a healing peer fetches: the weights, optimizer, scheduler,
  ``QuorumProgress`` (epoch, history, early stop, the partial epoch's sums) and the checkpoint
  timeline;
* the epoch end is a round of its own: once an epoch's batches are committed, the next attempt
  evaluates instead of training, each participant a contiguous part of the validation set, and
  the sums travel in one collective; its commit appends the epoch's record and takes the
  early-stop decision, the same on every replica (they hold the same sums). A failed round is
  redone over the next quorum like a failed step. Participant 0 of the round prints the epoch
  line and writes ``metrics.jsonl``. The Manager's step counts these rounds too, so the
  training step is counted by ``QuorumProgress`` (``train_step``);
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

import errno
import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn
from torch.utils.data import default_collate

from elastic_train.boundary import FinalCheckpointFailed
from elastic_train.checkpoint.format import CheckpointInvalid, checkpoint_key, latest_target, step_dir_name, step_of
from elastic_train.checkpoint.init_from import apply_init_weights, read_init_weights
from elastic_train.checkpoint.manager import Checkpointer, Loaded, NewerCommitted, choose_checkpoint, load
from elastic_train.checkpoint.snapshot import Position, Snapshot, capture, restore
from elastic_train.config import TrainConfig
from elastic_train.data import Indexed
from elastic_train.data.sampler import split_evenly
from elastic_train.distributed.process_group import Placement
from elastic_train.early_stop import EarlyStopper
from elastic_train.errors import UsageError
from elastic_train.faults import FaultInjector
from elastic_train.logs import Console, MetricsFile, file_only
from elastic_train.metrics import EpochRecord, MetricSums, Totals, format_digest, index_digest
from elastic_train.precision import choose_precision
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
from elastic_train.quorum.replica import Replica, StepAttempt
from elastic_train.quorum.schedule import QuorumSchedule
from elastic_train.quorum.timeouts import WaitBound
from elastic_train.resilience.goodput import Accounting
from elastic_train.resilience.preemption import Preempted, PreemptionFlag, StopKind
from elastic_train.resilience.watchdog import StepWatchdog
from elastic_train.step_log import StepLog
from elastic_train.task import ExtraState, Task, TaskData
from elastic_train.trainer import (
    ELAPSED,
    TRAIN_DIGEST,
    TRAIN_SUMS,
    Summary,
    TrainerCheckpoint,
    build_optimizer,
    build_schedule,
    restore_extra,
    resume_on_schedule,
    seed_everything,
)

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


def share_stats(
    correct: torch.Tensor, mean_loss: torch.Tensor, indices: torch.Tensor, votes: tuple[StopKind, bool]
) -> torch.Tensor:
    """This participant's addends to the step's exact sums (``STATS`` float64 values)."""
    stats = torch.zeros(STATS, dtype=torch.float64)
    count = int(indices.numel())
    stats[CORRECT] = float(correct)
    stats[LOSS_SUM] = float(mean_loss) * count
    stats[SAMPLES] = count
    stats[STOP], stats[SAVE] = stop_vote(votes[0]), float(votes[1])
    lanes = index_digest(indices)
    halves = np.concatenate([lanes & _LOW32, lanes >> np.uint64(32)]).astype(np.float64)
    stats[DIGEST:] = torch.from_numpy(halves)
    return stats


def digest_lanes(stats: torch.Tensor) -> np.ndarray[Any, Any]:
    """The summed halves back into two uint64 lanes (mod 2^64)."""
    halves = stats[DIGEST:].numpy().astype(np.uint64)
    return (halves[:2] + (halves[2:] << np.uint64(32))).astype(np.uint64)


class QuorumTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        placement: Placement,
        task: Task,
        data: TaskData,
        checkpointer: Checkpointer,
        preemption: PreemptionFlag,
        watchdog: StepWatchdog | None = None,
        console: Console | None = None,
        metrics_file: MetricsFile | None = None,
        groups: int = 1,
        faults: FaultInjector | None = None,
        job_start: float | None = None,
    ) -> None:
        self.cfg, self.placement, self.task, self.data = cfg, placement, task, data
        self.device = placement.device
        self.checkpointer = checkpointer
        self.preemption = preemption
        self.watchdog = watchdog
        self.console = console
        self.metrics_file = metrics_file
        # The per-step curve, written by each step's participant 0 from the step's exact sums.
        self.step_log = StepLog(cfg.log_dir, cfg.log_every, True, cfg.batch_size)
        self.groups = groups  # replica groups the job was launched with (for the start line)
        self.faults = faults  # injected faults (tests, benchmarks): ``rank`` is the replica group
        # Inside the step watchdog's limit, which last saw this replica before the round's collective.
        self.eval_timeout_s = 0.5 * cfg.hang_timeout if cfg.hang_timeout else 600.0
        self.schedule = QuorumSchedule(len(data.train), cfg.batch_size, cfg.seed, cfg.max_steps_per_epoch)  # type: ignore[arg-type]
        self.train_items = Indexed(data.train, by_epoch=data.train_by_epoch)
        seed_everything(cfg.seed)  # the same initial weights on every replica: no transfer at step 0
        self.module: nn.Module = task.model(data).to(self.device)
        if cfg.init_from is not None and latest_target(cfg.checkpoint_dir) is None:
            # --init-from on a fresh job: every replica the same weights (no checkpoint yet; once
            # there is one, the line starts from it, and a late replica heals from a peer).
            apply_init_weights(self.module, read_init_weights(cfg.init_from), cfg.init_from)
        self.extra: ExtraState | None = task.extra_state(self.module) if task.extra_state is not None else None
        self.optimizer = (
            task.optimizer(self.module) if task.optimizer is not None else build_optimizer(cfg, self.module)
        )
        self.total_steps = cfg.epochs * self.schedule.batches_per_epoch
        self.scheduler = (
            task.make_scheduler(self.optimizer, self.total_steps)
            if task.scheduler is not None
            else build_schedule(cfg, self.optimizer, self.total_steps)
        )
        self.precision = choose_precision(cfg.amp, self.device, cfg.amp_dtype)
        # The gradient average's wait follows the model (timeouts.GradientBound), inside the
        # watchdog's limit like the evaluation round's.
        # How long an attempt's collectives wait for peers, each measured on its own: the first
        # (the exchange) waits for the slowest peer's forward and backward, the gradient average
        # for the gradients to cross the slowest link.
        self.exchange_bound = WaitBound(cfg.peer_timeout, self.eval_timeout_s)
        self.gradient_bound = WaitBound(cfg.peer_timeout, self.eval_timeout_s)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
        # The quorum id of an attempt whose collective failed: gloo's group is then broken until
        # the quorum changes, which torchft 0.2.0 does only when the membership does.
        self._broken_group: int | None = None
        # A heal's load_state_dict and the optimizer step wait for a running save's copies.
        checkpointer.guard(self.module, self.optimizer)
        self.stopper = EarlyStopper(
            task.early_stop_target(cfg.target_accuracy), cfg.patience, monitor=task.monitor, mode=task.mode
        )
        self.progress = QuorumProgress(
            early_stop=self.stopper.state(), timeline=checkpointer.timeline, job_start=job_start or time.time()
        )
        self._last_save = time.monotonic()
        # Floating or integer module buffers (BatchNorm statistics): kept equal on every replica.
        self._buffers = list(self.module.buffers())
        self._buffers_before: list[torch.Tensor] = []
        self._synced_buffers = torch.zeros(0, dtype=torch.float64)
        self._salvage: _Salvage | None = None

    # ------------------------------------------------------------------ replicated state
    def register(self, replica: Replica) -> None:
        """What a healing peer fetches: everything a committed step changes."""
        guarded = self.checkpointer.guarded  # the model and optimizer are guarded by their hooks
        replica.register_state("model", self.module.load_state_dict, self.module.state_dict)
        replica.register_state("optimizer", self.optimizer.load_state_dict, self.optimizer.state_dict)
        replica.register_state("scheduler", guarded(self.scheduler.load_state_dict), self.scheduler.state_dict)
        scaler = self.precision.scaler
        if scaler.is_enabled():
            replica.register_state("scaler", guarded(scaler.load_state_dict), scaler.state_dict)
        if self.extra is not None:
            replica.register_state("extra", guarded(self.extra.load_state_dict), self.extra.state_dict)
        replica.register_state("progress", guarded(self._load_progress), self._progress_state)

    def _progress_state(self) -> dict[str, Any]:
        self.progress.early_stop = self.stopper.state()
        self.progress.timeline = self.checkpointer.timeline
        return self.progress.to_json()

    def _load_progress(self, state: dict[str, Any]) -> None:
        self.progress.load(state)
        self.stopper.resume(self.progress.early_stop)
        self.checkpointer.timeline = self.progress.timeline

    # ------------------------------------------------------------------ one attempt
    def _batch(self, epoch: int, indices: Sequence[int]) -> tuple[list[Any], torch.Tensor]:
        keys: list[Any] = [(epoch, i) for i in indices] if self.data.train_by_epoch else list(indices)
        *batch, collated = default_collate([self.train_items[k] for k in keys])
        return batch, collated

    @property
    def train_step(self) -> int:
        """Global batches committed so far, counted across epochs: the step the loop trains next
        (the Manager's own step also counts evaluation rounds)."""
        return self.progress.epoch * self.schedule.batches_per_epoch + self.progress.batch_in_epoch

    @property
    def evaluating(self) -> bool:
        """Every batch of the epoch is committed, its evaluation round is not yet."""
        return self.progress.batch_in_epoch >= self.schedule.batches_per_epoch

    @property
    def commits(self) -> int:
        """The Manager step this position stands for: what a continuous run has committed."""
        return expected_commits(self.train_step, self.progress.epoch)

    def position(self) -> QuorumPosition:
        p = self.progress
        timeline = timeline_key(self.checkpointer.timeline)
        return QuorumPosition(self.commits, self.train_step, p.epoch, self.evaluating, p.lineage, timeline)

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
        if broken is None or replica.quorum_id != broken or attempt.world < 2:
            return
        if attempt.rank == attempt.world - 1:
            raise Rejoin(
                f"a collective of quorum {broken} failed with every participant alive and the quorum did not "
                "change: its process group is broken; leaving so that the quorum re-forms (raise --peer-timeout "
                "if this repeats)"
            )

    def _exchange(
        self, replica: Replica, attempt: StepAttempt, stats: torch.Tensor, timeout_s: float | None = None
    ) -> torch.Tensor | None:
        """The attempt's first collective: the step's exact sums and every participant's
        position (``agreement``), in one SUM. Returns the summed ``stats``, or None when the
        collective failed or the participants stand at different positions: then nothing
        commits, and a participant that differs from participant 0 raises ``Rejoin``."""
        block = position_block(self.position(), attempt.rank, attempt.world)
        both = torch.cat([stats, block])
        bound = timeout_s if timeout_s is not None else self.exchange_bound.seconds()
        began = time.perf_counter()
        if not replica.sum(both, timeout_s=bound):
            log.info("exchange_failed", bound_s=round(bound, 3), after_s=round(time.perf_counter() - began, 3))
            if timeout_s is None:
                self.exchange_bound.failed(time.perf_counter() - began)
            self._broken_group = replica.quorum_id
            return None
        if timeout_s is None:
            self.exchange_bound.record(time.perf_counter() - began)
        try:
            disagreement = check(decode(both[stats.numel() :], attempt.world), attempt.rank)
        except ValueError as exc:  # a row written by none or by two: the membership is not what we think
            replica.refuse(f"position exchange garbled: {exc}")
            log.error("position_exchange_garbled", step=self.train_step, error=str(exc))
            return None
        if disagreement is not None:
            why = disagreement.explain(attempt.rank)
            replica.refuse(why)
            log.error("position_mismatch", step=self.train_step, detail=why)
            if attempt.rank in disagreement.differing:
                raise Rejoin(why)
            return None
        return both[: stats.numel()]

    def train_attempt(self, replica: Replica, attempt: StepAttempt) -> torch.Tensor | None:
        """Forward, backward and the step's collectives; the step's summed stats, or None when
        a collective failed (the attempt will not commit).

        A survivor redoing a step whose gradient average failed (a peer died) keeps what it
        computed: its gradients are still its own share's (the average writes them back only on
        success), so it trains only the samples of its new share it has not trained yet and
        rescales (``_Salvage``). Not with module buffers, which the first forward changed.
        """
        if self.faults is not None:
            self.faults.at_step(self.train_step + 1)
        share, stash = attempt.share, self._salvage
        self._salvage = None
        reuse = (
            stash is not None
            and attempt.heal is None
            and stash.step == share.step
            and not self._buffers
            and set(stash.indices) <= set(share.indices)
        )
        self.module.train()
        if reuse:
            assert stash is not None
            with torch.no_grad():  # its W_old/G * sum(old share) becomes W/G * sum(old share)
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(attempt.world / stash.world)
            done = set(stash.indices)
            rest = [i for i in share.indices if i not in done]
            stats = stash.stats.clone()
            log.info("salvaged", step=share.step, kept=len(stash.indices), computing=len(rest))
        else:
            self.optimizer.zero_grad(set_to_none=True)
            rest, stats = list(share.indices), torch.zeros(STATS, dtype=torch.float64)
            self._buffers_before = [b.detach().clone() for b in self._buffers]  # a discarded attempt's
        # Forward updates them too (BatchNorm statistics): put back on discard. In micro-batches
        # of --micro-batch-size samples (memory bounded whatever the quorum's size): gradients
        # accumulate; each part weighs its own size, the sums add up exactly.
        micro = self.cfg.micro_batch_size or len(rest) or 1
        for part in (rest[i : i + micro] for i in range(0, len(rest), micro)):
            batch, indices = self._batch(share.epoch, part)
            x, y = self.task.to_device(batch, self.device)
            with self.precision.autocast():
                outputs = self.module(x)
                loss = self.task.loss(outputs, y)
            # W/G per sample: the participants' average is the global batch's mean (loss_weight).
            weight = len(part) * attempt.world / self.cfg.batch_size
            self.precision.scaler.scale(loss * weight).backward()  # type: ignore[no-untyped-call]
            stats += share_stats(
                self.task.correct(outputs.detach(), y), loss.detach().float(), indices, (StopKind.NONE, False)
            )
        save_due = self.cfg.checkpoint_every_seconds > 0 and (
            time.monotonic() - self._last_save >= self.cfg.checkpoint_every_seconds
        )
        stats[STOP] = stop_vote(self.preemption.kind)
        stats[SAVE] = float(save_due and attempt.rank == 0)
        mine = stats.clone()
        # First the positions (and the sums): gradients of different global batches are never averaged.
        summed = self._exchange(replica, attempt, stats)
        if summed is None or not self._average_gradients(replica):
            self._salvage = _Salvage(share.step, attempt.world, share.indices, mine)
            return None
        if self._buffers and not self._sync_buffers(replica, attempt):
            return None
        return summed

    def _average_gradients(self, replica: Replica) -> bool:
        bound = self.gradient_bound.seconds()
        if self.faults is not None:  # a slow link on this replica: its peers wait in the average
            time.sleep(self.faults.link_delay(self.gradient_bytes, self.train_step + 1))
        began = time.perf_counter()
        if not replica.average_gradients(self.module.parameters(), timeout_s=bound):
            after = time.perf_counter() - began
            self.gradient_bound.failed(after)
            self._broken_group = replica.quorum_id
            log.info("gradient_average_failed", bound_s=round(bound, 3), after_s=round(after, 3))
            return False
        took = time.perf_counter() - began
        self.gradient_bound.record(took)
        if took > self.cfg.peer_timeout:  # a flat --peer-timeout would have failed this one
            log.info("gradient_average_slow", seconds=round(took, 3), bound_s=round(bound, 3))
        return True

    def _sync_buffers(self, replica: Replica, attempt: StepAttempt) -> bool:
        """Participant 0's buffers become everyone's, as DDP broadcasts rank 0's: a SUM where
        every other participant contributes zeros (one collective, any dtype via float64)."""
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64).cpu() for b in self._buffers])
        if attempt.rank != 0:
            flat.zero_()
        if not replica.sum(flat, timeout_s=self.exchange_bound.seconds()):
            self._broken_group = replica.quorum_id
            return False
        self._synced_buffers = flat
        return True

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for buffer, before in zip(self._buffers, self._buffers_before, strict=True):
                buffer.copy_(before)

    def _apply(self, stats: torch.Tensor, seconds: float) -> None:
        """Everything a committed step changes (run by ``Replica.commit`` after the vote)."""
        self.checkpointer.wait_staged()  # an async save may still be copying the weights
        scaler = self.precision.scaler
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        if self._buffers:
            offset = 0
            with torch.no_grad():
                for buffer in self._buffers:
                    n = buffer.numel()
                    buffer.copy_(self._synced_buffers[offset : offset + n].view_as(buffer).to(buffer.dtype))
                    offset += n
        if self.extra is not None:
            self.extra.after_step(self.train_step + 1)
        p = self.progress
        p.sums = [p.sums[i] + float(stats[i]) for i in (CORRECT, LOSS_SUM, SAMPLES)]
        p.add_digest(digest_lanes(stats))
        p.batch_in_epoch += 1
        p.elapsed += seconds

    # ------------------------------------------------------------------ the run
    def fit(self, replica: Replica) -> Summary:
        """Train until the last epoch or an early stop. While the whole quorum stands at step 0
        its participant 0 chooses where the line of training starts (``_start_line``)."""
        wall_start = time.perf_counter()
        first = True
        since = last_commit = time.perf_counter()  # a step's training time counts its discarded attempts
        world, discarded, quorum_id = 0, 0, -1
        while True:
            if self.watchdog is not None:  # waiting for a quorum (bounded by the quorum timeout)
                self.watchdog.beat(self.train_step, "quorum")
            if self.faults is not None:
                self.faults.before_quorum()
            attempt = replica.begin_step(self.schedule, lambda: self.train_step)
            self._check_step(replica)
            self._leave_a_broken_group(replica, attempt)
            if replica.quorum_id != quorum_id:
                quorum_id = replica.quorum_id
                self.exchange_bound.new_membership()
                self.gradient_bound.new_membership()
            if attempt.heal is not None:
                heal = attempt.heal
                log.info("healed", from_step=heal.from_step, to_step=heal.to_step, seconds=round(heal.seconds, 3))
                since = time.perf_counter()
            self._speak(attempt.rank == 0)
            if first:
                first = False
                self._announce(attempt)
            if attempt.step == 0 and self._start_line(replica, attempt):
                since = time.perf_counter()
                continue
            if self.progress.finished or (self.train_step >= self.total_steps and not self.evaluating):
                break
            step, evaluating, began = self.train_step, self.evaluating, time.perf_counter()
            if self.watchdog is not None:
                self.watchdog.beat(step, "evaluate" if evaluating else "train")
            if evaluating:
                stats = self.eval_attempt(replica, attempt)
                apply = partial(self._end_epoch, stats, attempt.world) if stats is not None else None
            else:
                stats = self.train_attempt(replica, attempt)
                apply = partial(self._apply, stats, time.perf_counter() - since) if stats is not None else None
            if apply is None or not replica.commit(apply):
                if self._buffers and not evaluating:
                    self._restore_buffers()
                # attempt_s: the attempt's own time, from its quorum to the failed vote (lost work).
                attempt_s = round(time.perf_counter() - began, 3)
                log.info("discarded", step=step, world=attempt.world, evaluating=evaluating, attempt_s=attempt_s)
                discarded += 1
                if discarded >= MAX_DISCARDS:
                    # A replica that heartbeats but whose collectives always fail (gloo bound to the
                    # wrong interface, a firewall, a timeout shorter than the allreduce) would keep
                    # every quorum failing forever: end this worker, with the likely causes.
                    raise RuntimeError(
                        f"{discarded} attempts in a row at step {step} were discarded (world {attempt.world}): the "
                        "replicas reach the Lighthouse but not each other. Check GLOO_SOCKET_IFNAME (the "
                        "interface the nodes share), firewalls between the nodes, and raise --peer-timeout "
                        "if a step's allreduce takes longer"
                    )
                continue
            assert stats is not None
            now = time.perf_counter()
            if attempt.world != world or discarded:
                # What a membership change cost: the time from the previous commit (includes the
                # discarded attempts, detection, the new quorum and any heal).
                log.info(
                    "quorum_changed",
                    step=self.train_step,
                    world=attempt.world,
                    previous_world=world,
                    discarded=discarded,
                    seconds_since_commit=round(now - last_commit, 3),
                    quorum_s=round(attempt.quorum_seconds, 3),  # forming this quorum (and healing, if any)
                )
            elif self.train_step % PROGRESS_EVERY == 0:
                log.info("committed", step=self.train_step, world=attempt.world)
            if discarded:
                self.progress.lost_s += began - last_commit
                self.progress.discarded += discarded
            if world and attempt.world < world:
                self.progress.failures += world - attempt.world
            world, discarded, since, last_commit = attempt.world, 0, now, now
            self._after_commit(attempt, stats, evaluated=evaluating)
            if self.progress.finished:
                break
        return self._summary(time.perf_counter() - wall_start)

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
        block = choice.block() if choice is not None else empty_block()
        # Waits for participant 0's choice (it reads and verifies the checkpoint): the bound of
        # the watchdog's limit, as an evaluation round's.
        if not replica.sum(block, timeout_s=self.eval_timeout_s):
            self._broken_group = replica.quorum_id
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
        self.progress.lineage = agreed.lineage
        self.checkpointer.timeline = self.progress.timeline = agreed.timeline
        log.info("line_started", lineage=f"{agreed.lineage:x}", timeline=agreed.timeline, checkpoint=agreed.checkpoint)
        if loaded is None:
            return False  # from the seed: this attempt trains step 0
        replica.discard(step=self.commits, reason="loaded the checkpoint; the quorum continues from it")
        if self.console is not None:
            m = loaded.manifest
            self.console.line(f"Resumed from {loaded.folder} at epoch {m.epoch + 1}, step {m.step}")
        log.info("resumed", path=str(loaded.folder), step=loaded.manifest.step, saved_world_size=loaded.world_size)
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

    def _after_commit(self, attempt: StepAttempt, stats: torch.Tensor, evaluated: bool) -> None:
        """The step boundary: saves and an agreed stop. Every replica decides the same from the
        step's sums; participant 0 of the step saves."""
        step = self.train_step
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if attempt.rank == 0 and not evaluated and self.step_log.due(step) and stats[SAMPLES] > 0:
            loss = float(stats[LOSS_SUM] / stats[SAMPLES])  # the global batch's, exact
            lr = float(self.optimizer.param_groups[0]["lr"])
            self.step_log.step(step, self.progress.epoch + 1, loss, lr, attempt.world)
        stop = stats[STOP] > 0 and not self.progress.finished
        every = self.cfg.checkpoint_every
        # The step that completes an epoch is not saved by the step count: its evaluation round
        # is next, and saves that step's state (one checkpoint per step, not two).
        periodic = not evaluated and not self.evaluating and every > 0 and step % every == 0
        due = evaluated or periodic or (stats[SAVE] > 0 and not self.evaluating)
        committed: bool | None = None
        if attempt.rank == 0 and (stop or self.progress.finished or due):
            # The last and a stopping step's checkpoints are waited for: the process ends next.
            committed = self._save(step, sync=stop or self.progress.finished)
        self._collect_save()
        if stop:
            raise Preempted(step, bool(committed), agreed_stop(float(stats[STOP])))
        if self.progress.finished and committed is False:  # participant 0's final save
            raise FinalCheckpointFailed(step)

    def _save(self, step: int, sync: bool) -> bool | None:
        try:
            self.checkpointer.take_lock()  # judges an older pending save before taking the lock back
        except (UsageError, OSError) as exc:
            log.error("checkpoint_failed", step=step, error=str(exc), detail="could not take the directory lock")
            return False
        self._last_save = time.monotonic()
        return self.checkpointer.save(self.snapshot(step, self.progress.finished), sync=sync)

    def _collect_save(self) -> None:
        """Commit this replica's background save once its shard is written."""
        if self.checkpointer.pending and self.checkpointer.local_done():
            self.checkpointer.commit_pending()

    def _speak(self, main: bool) -> None:
        """Participant 0 of the current attempt prints (an epoch's line: see ``_end_epoch``)."""
        if self.console is not None:
            self.console.enabled = main

    def _announce(self, attempt: StepAttempt) -> None:
        params = sum(p.numel() for p in self.module.parameters())
        if self.console is not None and attempt.step == 0 and attempt.heal is None:
            self.console.line(f"Training started with {self.groups} processes")
            self.console.line(
                f"Fault tolerance: quorum ({attempt.world} of {self.groups} replica groups in the first quorum), "
                f"device: {self.device.type}, model: {self.task.name} ({params / 1e6:.2f}M params), "
                f"dataset: {self.data.describe()}, global batch: {self.cfg.batch_size}, "
                f"precision: {self.precision.name}"
            )
        log.info("run_config", **file_only(config=self.cfg.to_json(), params=params, mode="quorum"))

    # ------------------------------------------------------------------ epoch end
    @torch.no_grad()
    def eval_attempt(self, replica: Replica, attempt: StepAttempt) -> torch.Tensor | None:
        """This participant's contiguous part of the validation set, SUM-reduced over the
        quorum in one collective: exact (each sample once) for any membership. Layout: the
        step stats (``STATS``) then the task's extra metric sums."""
        self.checkpointer.wait_staged()
        self.module.eval()
        sums = MetricSums(self.device)
        names = sorted(self.task.metrics)
        extra = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        part = split_evenly(len(self.data.val), attempt.world, attempt.rank)  # type: ignore[arg-type]
        items = Indexed(self.data.val)
        size = -(-self.cfg.batch_size // attempt.world)  # a training share's size: known to fit
        for start in range(part.start, part.stop, size):
            if self.watchdog is not None:
                self.watchdog.beat(self.train_step, "evaluate")
            *batch, indices = default_collate([items[i] for i in range(start, min(start + size, part.stop))])
            x, y = self.task.to_device(batch, self.device)
            with self.precision.autocast():
                outputs = self.module(x)
                loss = self.task.loss(outputs, y)
            outputs = outputs.float()
            sums.add_batch(self.task.correct(outputs, y), y.shape[0], loss.float())
            sums.add_indices(indices)
            for i, name in enumerate(names):
                extra[i] += self.task.metrics[name](outputs, y).detach().to(torch.float64)
        stats = torch.zeros(STATS + len(names), dtype=torch.float64)
        stats[CORRECT:STOP] = sums.sums.cpu()
        stats[STOP] = stop_vote(self.preemption.kind)
        lanes = sums._lanes()
        stats[DIGEST:STATS] = torch.from_numpy(
            np.concatenate([lanes & _LOW32, lanes >> np.uint64(32)]).astype(np.float64)
        )
        stats[STATS:] = extra.cpu()
        # Shards take uneven time (a node busier than another): wait for the slowest as long as
        # the watchdog would let a rank evaluate, not the step collectives' few seconds.
        return self._exchange(replica, attempt, stats, timeout_s=self.eval_timeout_s)

    def _end_epoch(self, stats: torch.Tensor, world: int) -> None:
        """The committed evaluation round: the epoch's record, line, early stop (run by
        ``Replica.commit``; every replica holds the same sums, so decides the same)."""
        p = self.progress
        train = p.totals()
        val = Totals(
            float(stats[CORRECT]), float(stats[LOSS_SUM]), int(stats[SAMPLES]), format_digest(digest_lanes(stats))
        )
        names = sorted(self.task.metrics)
        extra = {
            name: float(stats[STATS + i]) / val.samples if val.samples else math.nan for i, name in enumerate(names)
        }
        record = EpochRecord.of(p.epoch, world, train, val, p.elapsed, self.train_step, extra)
        p.history.append(record.to_json())
        p.epoch += 1
        p.batch_in_epoch, p.sums, p.digest, p.elapsed = 0, [0.0, 0.0, 0.0], [0, 0], 0.0
        # Every replica that committed the round offers the line; exactly one is written (the
        # round's participant 0 may have failed its vote while the others committed).
        first = self.metrics_file is not None and self.metrics_file.append_once(
            record.to_json(), key=("epoch", "step", "sample_digest"), since=p.job_start - METRICS_CLOCK_SLACK_S
        )
        if first and self.console is not None:
            self.console.line(
                record.console_line(self.cfg.epochs, self.task.rate_unit, self.task.accuracy), always=True
            )
        log.info("epoch_end", **file_only(**record.to_json()))
        stop = self.stopper.update(self.task.monitored(record))
        if stop and first and self.console is not None:
            self.console.line(f"Early stopping at epoch {record.epoch}: {self.stopper.reason}", always=True)
        p.finished = stop or p.epoch >= self.cfg.epochs

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, step: int, finished: bool) -> Snapshot:
        """The run at a committed step, as a world-size-1 checkpoint (any mode resumes it)."""
        p = self.progress
        sums = torch.tensor(p.sums, dtype=torch.float64)
        digest = torch.from_numpy(np.array(p.digest, dtype=np.uint64).view(np.int64).copy())
        app = TrainerCheckpoint(self.stopper.state(), p.history)
        return capture(
            Position(step, p.epoch, p.batch_in_epoch, finished),
            self.module,
            self.optimizer,
            device=self.device,
            scheduler=self.scheduler,
            scaler=self.precision.scaler,
            extra=self.extra.state_dict() if self.extra is not None else None,
            per_rank={TRAIN_SUMS: sums, TRAIN_DIGEST: digest, ELAPSED: torch.tensor([p.elapsed], dtype=torch.float64)},
            app=app.to_json(),
            accounting=p.accounting().to_json(),
            config=self.cfg.to_json(),
        )

    def restore(self, loaded: Loaded) -> None:
        """Continue from a checkpoint of any mode and world size: the partial epoch's sums of
        every rank that wrote it are folded into the replicated progress."""
        done = restore(
            loaded,
            self.module,
            self.optimizer,
            rank=0,
            world_size=1,
            device=self.device,
            scheduler=self.scheduler,
            scaler=self.precision.scaler,
        )
        restore_extra(self.extra, done.extra, self.task, loaded.folder)
        if self.task.scheduler is None:  # as restart mode does: another --epochs' curve
            resume_on_schedule(self.scheduler, self.optimizer)
        app = TrainerCheckpoint.from_json(done.payload.app)
        self.stopper.resume(app.early_stop)
        pos = done.position
        # A finished run trains on when this run's flags ask for more (--epochs, target, patience).
        last = self.task.monitored(EpochRecord(**app.history[-1])) if app.history else None
        over = pos.epoch >= self.cfg.epochs or (last is not None and bool(self.stopper.stops_at(last)))
        finished = pos.finished and over
        sums = MetricSums(torch.device("cpu"))
        for part in done.old_ranks:
            sums.sums += part[TRAIN_SUMS].cpu()
            sums.add_digest(part[TRAIN_DIGEST])
        self.progress = QuorumProgress(
            epoch=pos.epoch,
            batch_in_epoch=pos.batch_in_epoch,
            sums=[float(v) for v in sums.sums],
            digest=[int(v) for v in sums.digest.numpy().view(np.uint64)],
            elapsed=max(float(part[ELAPSED]) for part in done.old_ranks),
            history=app.history,
            early_stop=self.stopper.state(),
            finished=finished,
            timeline=self.checkpointer.timeline,
        )
        saved = Accounting.from_json(done.payload.accounting) if done.payload.accounting else None
        if saved is not None:  # the job's start and losses so far (a restart-mode run's too)
            self.progress.job_start, self.progress.lost_s = saved.job_start, saved.lost_s
            self.progress.failures = sum(saved.restarts.values())
            self.progress.discarded = saved.recomputed_steps

    def weights_sha256(self) -> str:
        """sha256 of the model's tensors (names, dtypes, shapes, bytes): equal on every replica
        that ended on the same line of training."""
        digest = hashlib.sha256()
        for name, value in sorted(self.module.state_dict().items()):
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}|{flat.dtype}|{tuple(value.shape)}\n".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def _summary(self, wall: float) -> Summary:
        stopped = bool(self.stopper.reason)
        return Summary.of(
            self.progress.history, wall, self.groups, self.placement.is_cuda, stopped, self.task.samples_are
        )
