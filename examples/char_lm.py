"""A character-level language model trained by a loop of your own, in either fault-tolerance mode.

Not image classification, not the built-in trainer: one plain PyTorch loop (``train``) that asks
``et.LoopSteps`` who trains which samples at each step, how gradients are averaged and whether
the step commits, and runs unchanged in both modes:

* ``--ft restart`` (default; ``et.RestartSteps``): a DDP group under torchrun. A failure ends
  the attempt; torchrun restarts the group, which resumes from the last checkpoint
  (``Checkpointer`` + ``capture``/``restore``: sharded, verified, async safetensors of model,
  optimizer, scheduler, RNG streams and position, committed atomically). ``StepBoundary``
  makes every rank take the same stop / save decision between steps; ``PreemptionFlag`` turns
  SIGTERM/SIGUSR1/SIGUSR2/SIGINT into a checkpoint and exit 76/75/130; ``StepWatchdog`` ends a
  rank that stops making progress so torchrun restarts the group.
* ``--ft quorum`` (``et.QuorumSteps``): each worker is a replica in a quorum that torchft's
  Lighthouse forms every step. A failed attempt is trained again by the survivors; a restarted
  worker fetches the current state from a live peer (no checkpoint) and rejoins.

In both, step ``s`` trains global batch ``s`` of the run cut over the step's members, so every
sample is trained once per epoch and the global batch is constant whatever the membership.
Dropout masks are keyed by ``(seed, step, sample)`` (``SampleDropout``), so a step's update does
not depend on which member trained a sample: the weights after a kill equal an uninterrupted
run's bit for bit in restart mode at the same world size, up to float reduction order otherwise.

Restart mode, like any torchrun script (the text is generated, nothing is downloaded)::

    torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=localhost:29400 --rdzv-id=charlm --rdzv-conf=last_call_timeout=5 \\
        examples/char_lm.py --checkpoint-dir checkpoints/charlm

Quorum mode, two replicas on one host (on several, give the Lighthouse's host)::

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --heartbeat_timeout_ms 400 \\
        --join_timeout_ms 100 &
    # One job id and one secret for every replica (it signs the weights a restarted one fetches).
    export ELASTIC_TRAIN_QUORUM_JOB=charlm ELASTIC_TRAIN_QUORUM_SECRET=$(openssl rand -hex 16)
    for g in 0 1; do
        REPLICA_GROUP_ID=$g TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 torchrun --standalone \\
            --nproc-per-node=1 --max-restarts=3 examples/char_lm.py --ft quorum --log-dir logs/charlm &
    done; wait

A quorum replica appends one JSON line per event to ``<log-dir>/replica_<g>.jsonl`` (``start``,
``heal``, ``commit`` with the step's membership and samples, ``discarded``, ``done``) and ends
with ``final step=<n> train_loss=<mean> sha256=<weights>`` (tests/launch/test_examples.py and
tests/launch/test_quorum.py read them).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import Dataset

import elastic_train as et

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"
WORDS = "the a model rank step loss node fails and resumes from its last checkpoint while others wait".split()
TEXT_SEED = 1234


def make_text(chars: int, seed: int) -> str:
    """Sentences of a tiny vocabulary with a fixed seed: learnable structure, no download."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) + rng.choice([". ", ", ", ".\n"])
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:chars]


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``i``: ``context`` characters and the same shifted by one (next-character targets)."""

    def __init__(self, text: str, context: int) -> None:
        self.codes = torch.tensor([ALPHABET.index(c) for c in text], dtype=torch.long)
        self.context = context

    def __len__(self) -> int:
        return (len(self.codes) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        chunk = self.codes[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self[i] for i in indices]
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def splits(chars: int, context: int) -> tuple[Windows, Windows]:
    """The training windows (the first 90% of the text) and the validation windows (the rest)."""
    text = make_text(chars, seed=TEXT_SEED)
    cut = int(len(text) * 0.9)
    return Windows(text[:cut], context), Windows(text[cut:], context)


class CharLM(nn.Module):
    """Embedding, dropout, GRU, classifier."""

    def __init__(self, vocab: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(0.1)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.drop(self.embed(codes)))
        logits: torch.Tensor = self.head(hidden)
        return logits.transpose(1, 2)  # [N, vocab, T]: cross_entropy's class dimension is 1


class SampleDropout(nn.Dropout):
    """Dropout whose mask for a sample depends only on ``(seed, step, sample index)``.

    ``nn.Dropout`` draws from the process's RNG stream, so a sample's mask would depend on which
    member trains it and what that member drew before: on the membership. Keyed masks make a
    step's update the same for any membership (a quorum that shrank, a group restarted at
    another size). ``step`` and ``indices`` must be set before each training forward.
    """

    def __init__(self, p: float, seed: int) -> None:
        super().__init__(p)
        self.seed = seed
        self.step = 0
        self.indices: tuple[int, ...] = ()

    def _mask(self, index: int, shape: torch.Size) -> torch.Tensor:
        key = hashlib.blake2b(f"{self.seed}:{self.step}:{index}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        return torch.rand(shape, generator=generator) >= self.p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if len(self.indices) != x.shape[0]:
            raise RuntimeError(f"SampleDropout got {x.shape[0]} samples but {len(self.indices)} keys: set them first")
        keep = torch.stack([self._mask(i, x.shape[1:]) for i in self.indices]).to(x.device)
        return x * keep / (1.0 - self.p)


class LossSums:
    """The run's exact training loss: sums over committed global batches, equal on every member
    (restart mode checkpoints them; a healing quorum replica fetches them with the weights)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.samples = 0

    def state(self) -> dict[str, float]:
        return {"loss": self.loss, "samples": float(self.samples)}

    def load(self, state: dict[str, float]) -> None:
        self.loss, self.samples = state["loss"], int(state["samples"])

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.loss, float(self.samples)], dtype=torch.float64)

    @property
    def mean(self) -> float:
        return self.loss / max(self.samples, 1)


class EventLog:
    """One JSON object per line, appended (a restarted worker continues its replica's file)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO = path.open("a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields}) + "\n")


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights by name; a sharded (FSDP2) parameter gathered over its group, which
    every worker of the group must call together."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().contiguous()
        for name, value in sorted(model.state_dict().items())
    }


def weights_sha256(weights: dict[str, torch.Tensor]) -> str:
    """sha256 of the weights (name, dtype, shape, bytes, by name): equal means bitwise equal."""
    digest = hashlib.sha256()
    for name, value in sorted(weights.items()):
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ft", choices=["restart", "quorum"], default="restart", help="fault-tolerance mode")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="global steps in all (default: the epochs' steps)")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (sequences)")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--chars", type=int, default=40_000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    restart = p.add_argument_group("restart mode")
    restart.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/char_lm"))
    restart.add_argument("--checkpoint-every", type=int, default=4, help="steps; epoch ends are always saved")
    restart.add_argument("--hang-timeout", type=float, default=60.0)
    quorum = p.add_argument_group("quorum mode")
    quorum.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), help="http://host:port")
    quorum.add_argument(
        "--parallel",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="inside a replica group of several workers: DDP, or FSDP2 (each worker holds a shard)",
    )
    quorum.add_argument("--replica-group", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", "0")))
    quorum.add_argument("--log-dir", type=Path, default=Path("logs/char_lm"))
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="pad each attempt's forward and backward to at least this many seconds (sleeping): stands in "
        "for a larger model, so that a short run outlasts a killed worker's restart",
    )
    quorum.add_argument("--collective-timeout", type=float, default=2.0, help="seconds a collective waits for a peer")
    quorum.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds a step waits for a quorum")
    quorum.add_argument(
        "--peer-silence",
        type=float,
        default=1.0,
        help="seconds a worker of a replica group may stay silent before its group leaves the quorum "
        "(a frozen worker; the other groups go on)",
    )
    quorum.add_argument(
        "--group-timeout",
        type=float,
        default=120.0,
        help="seconds a collective inside a replica group of several workers waits: a frozen worker "
        "takes its group out after this long (the other groups go on after --collective-timeout)",
    )
    args = p.parse_args(argv)
    if args.ft == "restart" and args.parallel != "ddp":
        p.error("--parallel fsdp is this example's quorum mode; restart mode's FSDP2 is the trainer's --parallel fsdp")
    if args.ft == "quorum" and not args.lighthouse:
        p.error("--ft quorum needs a Lighthouse: pass --lighthouse http://host:port or set TORCHFT_LIGHTHOUSE")
    return args


@dataclass
class Run:
    """What the loop trains, and the mode's hooks around a committed step."""

    args: argparse.Namespace
    model: nn.Module  # the bare module (its weights, its state dict)
    forward: nn.Module  # what the step calls: the mode's wrapper (``LoopSteps.wrap``)
    dropout: SampleDropout
    train_set: Windows
    val_set: Windows
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sums: LossSums
    device: torch.device
    total_steps: int
    val_world: int = 1  # evaluation: members sharing the validation set (restart mode: the group)
    val_rank: int = 0
    after_begin: Callable[[et.StepAttempt], None] = lambda attempt: None
    before_apply: Callable[[], None] = lambda: None  # restart: an async save may still copy the weights
    # After a committed step (its loss, its seconds): an exit code ends the run (an agreed stop).
    after_commit: Callable[[et.StepAttempt, float, float], int | None] = lambda attempt, loss, seconds: None
    on_discard: Callable[[et.StepAttempt, float], None] = lambda attempt, seconds: None
    # After an epoch's (or the run's last) evaluation: an exit code ends the run.
    after_epoch: Callable[[bool], int | None] = lambda finished: None


def train(steps: et.LoopSteps, run: Run) -> int:
    """The one loop of both modes: ``steps`` says who trains what and whether a step commits."""
    batch = run.args.batch_size
    per_epoch = steps.schedule.batches_per_epoch
    while steps.committed_steps < run.total_steps:
        started = time.monotonic()
        attempt = steps.begin_step()
        run.after_begin(attempt)
        if attempt.step >= run.total_steps:  # healed to the end
            break
        computing = time.monotonic()
        loss_sum = train_share(run, attempt)
        if run.args.step_time > 0:
            time.sleep(max(0.0, run.args.step_time - (time.monotonic() - computing)))
        steps.average_gradients(run.model.parameters(), extras=[loss_sum])
        # The global batch's mean loss: the members' average of share sums, times W, over G.
        loss = float(loss_sum) * attempt.world / batch
        if not steps.commit(partial(apply_update, run, loss)):
            run.on_discard(attempt, time.monotonic() - started)
            continue  # nothing applied: the survivors train the same global batch again
        stop = run.after_commit(attempt, loss, time.monotonic() - started)
        if stop is not None:
            return stop
        done = steps.committed_steps
        if done % per_epoch == 0 or done == run.total_steps:
            val_loss = evaluate(run)
            if attempt.rank == 0:
                epoch = -(-done // per_epoch)
                print(f"epoch {epoch}: step {done}, val_loss={val_loss:.4f}", flush=True)
            stop = run.after_epoch(done >= run.total_steps)
            if stop is not None:
                return stop
    return 0


def train_share(run: Run, attempt: et.StepAttempt) -> torch.Tensor:
    """Forward and backward on this member's share; returns the share's summed loss (for the
    exact global mean). The gradient is weighted so the average over members is the global
    batch's mean gradient, whatever the split."""
    share = attempt.share
    codes, targets = run.train_set.batch(share.indices)
    run.dropout.step, run.dropout.indices = attempt.step, share.indices
    run.forward.train()  # type: ignore[no-untyped-call]
    run.optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(run.forward(codes.to(run.device)), targets.to(run.device))
    (loss * share.weight).backward()  # type: ignore[no-untyped-call]
    return loss.detach().double() * len(share.indices)


def apply_update(run: Run, loss: float) -> None:
    """Everything a committed step changes (``commit`` runs it only when the step commits)."""
    run.before_apply()
    run.optimizer.step()
    run.scheduler.step()
    run.sums.loss += loss * run.args.batch_size
    run.sums.samples += run.args.batch_size


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss per character, exact: each of ``val_world`` members its disjoint
    shard, SUM of sums over them (restart mode: the group). A quorum replica, whose group may
    change from one step to the next, evaluates the whole validation set itself."""
    run.model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)
    for indices in et.EvalBatchSampler(len(run.val_set), run.args.batch_size, run.val_world, run.val_rank):
        codes, targets = run.val_set.batch(indices)
        loss = nn.functional.cross_entropy(run.model(codes.to(run.device)), targets.to(run.device), reduction="sum")
        sums += torch.stack([loss.double(), torch.tensor(float(targets.numel()), device=run.device)])
    if run.val_world > 1:
        torch.distributed.all_reduce(sums)
    if run.args.parallel == "fsdp":
        et.reshard_all(run.model)  # a forward without backward leaves the root's parameters gathered
    return float(sums[0] / sums[1])


def build(args: argparse.Namespace, device: torch.device) -> Run:
    """Model, data and optimizer: the same in both modes (the same initial weights everywhere)."""
    train_set, val_set = splits(args.chars, args.context)
    torch.manual_seed(args.seed)
    model = CharLM(len(ALPHABET)).to(device)
    dropout = SampleDropout(0.1, args.seed)
    model.drop = dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = et.QuorumSchedule(len(train_set), args.batch_size, args.seed)
    total = args.steps if args.steps is not None else args.epochs * schedule.batches_per_epoch
    scheduler = lr_schedule(optimizer, total)
    return Run(args, model, model, dropout, train_set, val_set, optimizer, scheduler, LossSums(), device, total)


def lr_schedule(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (total + 1))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    try:
        return quorum_mode(args) if args.ft == "quorum" else restart_mode(args)
    except et.UsageError as exc:  # bad input (e.g. a quorum mixing group sizes): the message, exit 2
        print(f"char_lm: {exc}", file=sys.stderr, flush=True)
        return int(et.ExitCode.USAGE)


# ---------------------------------------------------------------------------------------- restart
def restart_mode(args: argparse.Namespace) -> int:
    env = et.DistEnv.from_environ()  # torchrun's variables, or a world of one
    et.configure_logging(env)
    placement = et.choose_placement("auto", env)  # CUDA + NCCL when there is a GPU, else gloo
    flag = et.PreemptionFlag(et.StopGrace(10.0, env.rank))
    flag.install()
    faults = et.FaultInjector.from_environ(env.rank, args.checkpoint_dir / ".faults")  # tests kill workers
    with et.process_group(env, placement, timeout_s=120.0):
        run = build(args, placement.device)
        steps = et.RestartSteps(et.QuorumSchedule(len(run.train_set), args.batch_size, args.seed), env, run.device)
        run.forward = steps.wrap(run.model)
        # What a resumed run must share with the checkpoint; anything else may change.
        fingerprint = {
            "example": "char_lm",
            "seed": args.seed,
            "batch_size": args.batch_size,
            "context": args.context,
            "data.train_samples": len(run.train_set),
        }
        control = et.ControlPlane()  # a small gloo group for the step-boundary agreement
        checkpointer = et.Checkpointer(
            et.CheckpointConfig(root=args.checkpoint_dir, hang_timeout=args.hang_timeout),
            env,
            fingerprint,
            control.group,
            hooks=et.CheckpointFaults(faults),
        )
        checkpointer.start()
        watchdog = et.StepWatchdog(args.hang_timeout, env.rank)
        checkpointer.heartbeat = watchdog.alive  # a long save is progress, not a hang
        try:
            loaded = checkpointer.resume()
            if loaded is not None:
                restored = et.restore(
                    loaded,
                    run.model,
                    run.optimizer,
                    rank=env.rank,
                    world_size=env.world_size,
                    device=run.device,
                    scheduler=run.scheduler,
                    extra_like={"loss_sums": run.sums.as_tensor()},
                )
                sums = restored.extra["loss_sums"]
                run.sums.load({"loss": float(sums[0]), "samples": float(sums[1])})
                steps.resume_at(restored.position.step)
                if env.is_main:
                    print(f"resumed from {loaded.folder} at step {restored.position.step}", flush=True)
                if restored.position.finished:
                    return 0
            boundary = et.StepBoundary(
                checkpointer, control, et.SavePolicy(every_steps=args.checkpoint_every), flag, is_main=env.is_main
            )
            per_epoch = steps.schedule.batches_per_epoch

            def snapshot(finished: bool = False) -> et.Snapshot:
                epoch, batch = divmod(steps.committed_steps, per_epoch)
                return et.capture(
                    et.Position(steps.committed_steps, epoch, batch, finished),
                    run.model,
                    run.optimizer,
                    device=run.device,
                    scheduler=run.scheduler,
                    extra={"loss_sums": run.sums.as_tensor()},
                )

            def after_commit(attempt: et.StepAttempt, loss: float, seconds: float) -> int | None:
                del attempt, loss, seconds
                done = steps.committed_steps
                watchdog.beat(done)
                epoch_end = done % per_epoch == 0 or done == run.total_steps
                decision = boundary.after_step(done, snapshot, epoch_end=epoch_end)
                return int(decision.stop.exit_code) if decision.stop else None

            def after_epoch(finished: bool) -> int | None:
                decision = boundary.epoch_end(partial(snapshot, finished), finished=finished)
                return int(decision.stop.exit_code) if decision.stop else None

            run.val_world, run.val_rank = env.world_size, env.rank
            run.after_begin = lambda attempt: faults.at_step(attempt.step + 1)  # tests kill a rank mid-step
            run.before_apply = checkpointer.wait_staged
            run.after_commit, run.after_epoch = after_commit, after_epoch
            watchdog.start()
            if steps.committed_steps >= run.total_steps:  # stopped on the last step: close the run
                val_loss = evaluate(run)
                if env.is_main:
                    print(f"final: step {steps.committed_steps}, val_loss={val_loss:.4f}", flush=True)
                code = after_epoch(True) or 0
            else:
                code = train(steps, run)
            if code == 0 and env.is_main:
                print(f"done train_loss={run.sums.mean:.4f}", flush=True)
            return code
        finally:
            watchdog.stop()
            checkpointer.close()


# ----------------------------------------------------------------------------------------- quorum
def quorum_mode(args: argparse.Namespace) -> int:
    # This replica group's workers: torchrun's RANK / WORLD_SIZE (one agent per group). Several
    # workers train DDP inside the group, on a process group of their own; the quorum (gloo,
    # torchft's) runs across groups, each worker with the same group rank of every other group.
    group = et.DistEnv.from_environ()
    placement = et.choose_placement("cpu", group)
    with contextlib.ExitStack() as stack:
        if group.world_size > 1 or args.parallel == "fsdp":
            stack.enter_context(et.process_group(group, placement, timeout_s=args.group_timeout))
        return quorum_replica(args, group)


def quorum_replica(args: argparse.Namespace, group: et.DistEnv) -> int:
    run = build(args, torch.device("cpu"))
    config = et.ReplicaConfig(
        args.lighthouse,
        args.replica_group,
        collective_timeout_s=args.collective_timeout,
        quorum_timeout_s=args.quorum_timeout,
        peer_silence_s=args.peer_silence,
    )
    # One event file per worker: replica_<g>.jsonl, replica_<g>.rank<r>.jsonl in a group of several.
    name = config.replica_id if group.world_size == 1 else f"{config.replica_id}.rank{group.rank}"
    log = EventLog(args.log_dir / f"{name}.jsonl")
    log.write("start", replica=config.replica_id, group_rank=group.rank, restart_count=group.restart_count)
    with et.Replica(config) as replica:
        schedule = et.QuorumSchedule(len(run.train_set), args.batch_size, args.seed)
        steps = et.QuorumSteps(replica, schedule, parallel=args.parallel)
        run.forward = steps.wrap(run.model)
        if args.parallel == "fsdp":  # the optimizer must hold the sharded parameters
            run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=args.lr)
            run.scheduler = lr_schedule(run.optimizer, run.total_steps)
        # What a healing worker fetches from the same group rank of a live group (a copy taken at
        # the step boundary): under FSDP2 its own shards only.
        steps.register_model("model", run.model)
        steps.register_optimizer("optimizer", run.optimizer)
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in run.model.parameters())
        log.write("model", parallel=args.parallel, elements=sum(p.numel() for p in run.model.parameters()), held=held)
        steps.register_state("scheduler", run.scheduler.load_state_dict, run.scheduler.state_dict)
        steps.register_state("loss_sums", run.sums.load, run.sums.state)

        def after_begin(attempt: et.StepAttempt) -> None:
            if attempt.heal is not None:
                heal = attempt.heal
                log.write("heal", from_step=heal.from_step, to_step=heal.to_step, seconds=heal.seconds)

        def after_commit(attempt: et.StepAttempt, loss: float, seconds: float) -> int | None:
            share = attempt.share
            log.write(
                "commit",
                step=attempt.step,
                world=attempt.world,
                rank=attempt.rank,
                quorum_seconds=attempt.quorum_seconds,
                epoch=share.epoch,
                batch=share.batch,
                indices=list(share.indices),
                loss=loss,
                seconds=seconds,
            )
            return None

        def on_discard(attempt: et.StepAttempt, seconds: float) -> None:
            fields = {"world": attempt.world, "rank": attempt.rank, "quorum_seconds": attempt.quorum_seconds}
            log.write("discarded", step=attempt.step, **fields, seconds=seconds)

        run.after_begin, run.after_commit, run.on_discard = after_begin, after_commit, on_discard
        code = train(steps, run)
        weights = full_weights(run.model)
        digest = weights_sha256(weights)
        save_file(weights, str(args.log_dir / f"{name}.final.safetensors"))
        log.write("done", step=steps.committed_steps, sha256=digest, train_loss=run.sums.mean)
        print(f"final step={steps.committed_steps} train_loss={run.sums.mean:.4f} sha256={digest}", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
