"""A character-level language model trained by a loop of your own, made elastic by elastic-train.

Not image classification, not the built-in trainer: a plain PyTorch DDP loop that takes five
pieces from the library and gets exact resume, elasticity and clean preemption from them:

* ``GlobalBatchSampler``: each step's global batch is the same whatever the world size, and a
  run resumes from ``(epoch, batches consumed)``: no sample skipped or repeated;
* ``Checkpointer`` + ``capture``/``restore``: sharded, verified, async safetensors checkpoints
  of model, optimizer, scheduler, RNG streams and data position, committed atomically;
* ``StepBoundary``: between steps, every rank takes the same stop / commit / save decision;
* ``PreemptionFlag``: SIGTERM/SIGUSR1/SIGUSR2 -> checkpoint this step, exit 76/75;
* ``StepWatchdog``: a rank that stops making progress exits, so torchrun restarts the group.

Run it like any torchrun script (the text is generated, nothing is downloaded)::

    torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=localhost:29400 --rdzv-id=charlm examples/char_lm.py --checkpoint-dir ckpt/charlm

Kill a worker (``kill -9``) or the whole job and start it again: it continues from the last
checkpoint, and at the same world size ends with the same weights, bit for bit, as a run that
was never interrupted (tests/launch/test_examples.py checks exactly that).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import elastic_train as et

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"
WORDS = "the a model rank step loss node fails and resumes from its last checkpoint while others wait".split()


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


class CharLM(nn.Module):
    """Embedding, dropout (random: the checkpoint must carry the RNG streams), GRU, classifier."""

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


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/char_lm"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (sequences)")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--chars", type=int, default=40_000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=4, help="steps; epoch ends are always saved")
    p.add_argument("--hang-timeout", type=float, default=60.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    env = et.DistEnv.from_environ()  # torchrun's variables, or a world of one
    et.configure_logging(env)
    placement = et.choose_placement("auto", env)  # CUDA + NCCL when there is a GPU, else gloo
    torch.set_num_threads(1)
    flag = et.PreemptionFlag(et.StopGrace(10.0, env.rank))
    flag.install()
    faults = et.FaultInjector.from_environ(env.rank, args.checkpoint_dir / ".faults")  # tests kill workers
    with et.process_group(env, placement, timeout_s=120.0):
        return train(args, env, placement, flag, faults)


def train(
    args: argparse.Namespace,
    env: et.DistEnv,
    placement: et.Placement,
    flag: et.PreemptionFlag,
    faults: et.FaultInjector,
) -> int:
    device = placement.device
    text = make_text(args.chars, seed=1234)
    cut = int(len(text) * 0.9)
    train_set, val_set = Windows(text[:cut], args.context), Windows(text[cut:], args.context)
    sampler = et.GlobalBatchSampler(len(train_set), args.batch_size, env.world_size, env.rank, args.seed)
    # Each DataLoader iterator draws a seed from its generator: the global one by default, which
    # would shift the dropout stream of a run resumed mid-epoch. Private generators keep it exact.
    loader = DataLoader(et.Indexed(train_set), batch_sampler=sampler, generator=torch.Generator())
    val_loader = DataLoader(
        et.Indexed(val_set),
        batch_sampler=et.EvalBatchSampler(len(val_set), args.batch_size, env.world_size, env.rank),
        generator=torch.Generator(),
    )

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = CharLM(len(ALPHABET)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if placement.is_cuda else None)
    torch.manual_seed(args.seed + env.rank)  # then one dropout stream per rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = args.epochs * sampler.batches_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (total_steps + 1))

    # What a resumed run must share with the checkpoint; anything else may change.
    fingerprint = {"example": "char_lm", "seed": args.seed, "batch_size": args.batch_size, "context": args.context}
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
        position = et.Position(step=0)
        loaded = checkpointer.resume()
        if loaded is not None:
            restored = et.restore(
                loaded, model, optimizer, rank=env.rank, world_size=env.world_size, device=device, scheduler=schedule
            )
            position = restored.position
            if not restored.rng_restored:  # another world size: per-rank streams cannot be split
                torch.manual_seed(args.seed + env.rank + 7919 * position.step)
            if env.is_main:
                print(f"resumed from {loaded.folder} at step {position.step}", flush=True)
            if position.finished:
                return 0
        epoch, step, batch_in_epoch = position.epoch, position.step, position.batch_in_epoch
        boundary = et.StepBoundary(
            checkpointer, control, et.SavePolicy(every_steps=args.checkpoint_every), flag, is_main=env.is_main
        )

        def snapshot(finished: bool = False) -> et.Snapshot:
            return et.capture(
                et.Position(step, epoch, batch_in_epoch, finished),
                model,
                optimizer,
                device=device,
                scheduler=schedule,
            )

        watchdog.start()
        while epoch < args.epochs:
            ddp.train()  # type: ignore[no-untyped-call]
            sampler.set_epoch(epoch, batch_in_epoch)
            for codes, targets, _ in loader:
                faults.at_step(step + 1)
                codes, targets = codes.to(device), targets.to(device)
                loss = nn.functional.cross_entropy(ddp(codes), targets)
                optimizer.zero_grad(set_to_none=True)
                # Shares of a global batch may differ by one: weight them so the update is the
                # global batch's mean at any world size.
                (loss * sampler.loss_weight(codes.shape[0])).backward()  # type: ignore[no-untyped-call]
                checkpointer.wait_staged()  # an async save may still be copying the weights
                optimizer.step()
                schedule.step()
                step, batch_in_epoch = step + 1, batch_in_epoch + 1
                watchdog.beat(step)
                last = batch_in_epoch == sampler.batches_per_epoch
                decision = boundary.after_step(step, snapshot, epoch_end=last)
                if decision.stop:
                    return int(decision.stop.exit_code)
            epoch, batch_in_epoch = epoch + 1, 0
            val_loss = evaluate(model, val_loader, device, checkpointer)
            if env.is_main:
                print(f"epoch {epoch}/{args.epochs}: step {step}, val_loss={val_loss:.4f}", flush=True)
            finished = epoch == args.epochs
            decision = boundary.epoch_end(partial(snapshot, finished), finished=finished)
            if decision.stop:
                return int(decision.stop.exit_code)
        if env.is_main:
            print("done", flush=True)
        return 0
    finally:
        watchdog.stop()
        checkpointer.close()


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader[object], device: torch.device, ck: et.Checkpointer) -> float:
    """Mean validation loss per character, exact over ranks (SUM of sums, each sample once)."""
    ck.wait_staged()
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for codes, targets, _ in loader:
        logits = model(codes.to(device))
        loss = nn.functional.cross_entropy(logits, targets.to(device), reduction="sum")
        sums += torch.stack([loss.double(), torch.tensor(float(targets.numel()), device=device)])
    torch.distributed.all_reduce(sums)
    return float(sums[0] / sums[1])


if __name__ == "__main__":
    sys.exit(main())
