"""The character-level LM of char_lm.py, trained in quorum mode: survivors keep training.

Each replica group is one worker under its own torchrun agent; a torchft Lighthouse forms the
quorum of live replicas every step. Kill a worker and the others go on at the smaller size after
one discarded attempt (about the Lighthouse's heartbeat timeout); its agent restarts it, and the
new worker fetches the current state from a live peer (no checkpoint) and rejoins. Every step
trains the same global batch whatever the membership (``QuorumSchedule``), so each epoch's
samples are trained exactly once and the final weights equal those of a run without failures,
up to float reduction order.

Launch (two replica groups on one host; on several, give the Lighthouse's host)::

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --heartbeat_timeout_ms 400 \\
        --join_timeout_ms 100 &
    # One job id and one secret for every replica (it signs the weights a restarted one fetches).
    export ELASTIC_TRAIN_QUORUM_JOB=quorum-lm ELASTIC_TRAIN_QUORUM_SECRET=$(openssl rand -hex 16)
    for g in 0 1; do
        REPLICA_GROUP_ID=$g TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 torchrun --standalone \\
            --nproc-per-node=1 --max-restarts=3 examples/quorum_lm.py --log-dir logs/quorum_lm &
    done; wait

Each replica appends one JSON line per event to ``<log-dir>/replica_<g>.jsonl`` (``start``,
``heal``, ``commit`` with the step's membership and samples, ``discarded``, ``done``) and prints
``final step=<n> sha256=<weights>`` at the end (tests/launch/test_quorum.py reads both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors.torch import save_file
from torch import nn

from elastic_train.quorum.replica import Replica, ReplicaConfig, StepAttempt
from elastic_train.quorum.schedule import QuorumSchedule

if __package__ in (None, ""):  # run as a script (torchrun examples/quorum_lm.py): find `examples`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.char_lm import ALPHABET, CharLM, Windows, make_text


class SampleDropout(nn.Dropout):
    """Dropout whose mask for a sample depends only on ``(seed, step, sample index)``.

    ``nn.Dropout`` draws from the process's RNG stream, so a sample's mask would depend on
    which replica trains it and what that replica drew before: on the membership. Keyed masks
    make a step's update the same for any quorum, so a run with failures can end with the
    weights of a run without. ``step`` and ``indices`` must be set before each training forward.
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
    """The run's exact training loss: sums over committed global batches, replicated on every
    replica (a healing replica fetches them with the weights)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.samples = 0

    def state(self) -> dict[str, float]:
        return {"loss": self.loss, "samples": float(self.samples)}

    def load(self, state: dict[str, float]) -> None:
        self.loss, self.samples = state["loss"], int(state["samples"])


class EventLog:
    """One JSON object per line, appended (a restarted worker continues its replica's file)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO = path.open("a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields}) + "\n")


def weights_sha256(model: nn.Module) -> str:
    """sha256 of the weights (name, dtype, shape, bytes, by name): equal means bitwise equal."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), help="http://host:port")
    p.add_argument("--replica-group", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", "0")))
    p.add_argument("--log-dir", type=Path, default=Path("logs/quorum_lm"))
    p.add_argument("--steps", type=int, default=60, help="global steps in all")
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch (sequences)")
    p.add_argument("--max-steps-per-epoch", type=int, default=None)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--chars", type=int, default=20_000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="pad each attempt's forward and backward to at least this many seconds (sleeping): stands in "
        "for a larger model, "
        "so that a short run outlasts a killed worker's restart",
    )
    p.add_argument("--collective-timeout", type=float, default=2.0, help="seconds a collective waits for a peer")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds a step waits for a quorum")
    args = p.parse_args(argv)
    if not args.lighthouse:
        p.error("no Lighthouse: pass --lighthouse http://host:port or set TORCHFT_LIGHTHOUSE")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)  # one worker per replica, several replicas per host
    data = Windows(make_text(args.chars, seed=1234), args.context)
    schedule = QuorumSchedule(len(data), args.batch_size, args.seed, args.max_steps_per_epoch)

    torch.manual_seed(args.seed)  # the same initial weights on every replica: no start-up transfer
    model = CharLM(len(ALPHABET))
    dropout = SampleDropout(0.1, args.seed)
    model.drop = dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (args.steps + 1))
    sums = LossSums()

    config = ReplicaConfig(
        args.lighthouse,
        args.replica_group,
        collective_timeout_s=args.collective_timeout,
        quorum_timeout_s=args.quorum_timeout,
    )
    log = EventLog(args.log_dir / f"{config.replica_id}.jsonl")
    log.write("start", replica=config.replica_id, restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    with Replica(config) as replica:
        replica.register_state("model", model.load_state_dict, model.state_dict)
        replica.register_state("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        replica.register_state("scheduler", scheduler.load_state_dict, scheduler.state_dict)
        replica.register_state("loss_sums", sums.load, sums.state)
        model.train()
        while replica.committed_steps < args.steps:
            started = time.monotonic()
            attempt = replica.begin_step(schedule)
            if attempt.heal is not None:
                heal = attempt.heal
                log.write("heal", from_step=heal.from_step, to_step=heal.to_step, seconds=heal.seconds)
            if attempt.step >= args.steps:
                break
            computing = time.monotonic()
            loss_sum = train_share(model, dropout, data, attempt)
            if args.step_time > 0:
                time.sleep(max(0.0, args.step_time - (time.monotonic() - computing)))
            replica.average_gradients(model.parameters(), extras=[loss_sum])
            # The global batch's mean loss: the participants' average of share sums, times W, over G.
            loss = float(loss_sum) * attempt.world / args.batch_size

            fields = {
                "step": attempt.step,
                "world": attempt.world,
                "rank": attempt.rank,
                "quorum_seconds": attempt.quorum_seconds,
            }
            if replica.commit(partial(apply_update, optimizer, scheduler, sums, loss, args.batch_size)):
                share = attempt.share
                log.write(
                    "commit",
                    **fields,
                    epoch=share.epoch,
                    batch=share.batch,
                    indices=list(share.indices),
                    loss=loss,
                    seconds=time.monotonic() - started,
                )
            else:
                log.write("discarded", **fields, seconds=time.monotonic() - started)
        digest = weights_sha256(model)
        save_file(model.state_dict(), str(args.log_dir / f"{config.replica_id}.final.safetensors"))
        mean = sums.loss / max(sums.samples, 1)
        log.write("done", step=replica.committed_steps, sha256=digest, train_loss=mean)
        print(f"final step={replica.committed_steps} train_loss={mean:.4f} sha256={digest}", flush=True)
    return 0


def apply_update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sums: LossSums,
    loss: float,
    batch_size: int,
) -> None:
    """Everything a committed step changes (``Replica.commit`` runs it only after the vote)."""
    optimizer.step()
    scheduler.step()
    sums.loss += loss * batch_size
    sums.samples += batch_size


def train_share(model: nn.Module, dropout: SampleDropout, data: Windows, attempt: StepAttempt) -> torch.Tensor:
    """Forward and backward on this replica's share; returns the share's summed loss (for the
    exact global mean). The gradient is weighted so the average over participants is the global
    batch's mean gradient, whatever the split."""
    share = attempt.share
    codes = torch.stack([data[i][0] for i in share.indices])
    targets = torch.stack([data[i][1] for i in share.indices])
    dropout.step, dropout.indices = attempt.step, share.indices
    for p in model.parameters():
        p.grad = None
    loss = nn.functional.cross_entropy(model(codes), targets)
    (loss * share.weight).backward()  # type: ignore[no-untyped-call]
    return loss.detach() * len(share.indices)


if __name__ == "__main__":
    sys.exit(main())
