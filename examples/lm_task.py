"""A plug-in task: the character-level language model of ``examples/char_lm.py``, run by the
built-in trainer instead of a loop of your own, with an EMA of the weights as extra state.

    torchrun --standalone --nproc-per-node=2 -m elastic_train --task examples.lm_task:task \\
        --epochs 3 --batch-size 32 --target-accuracy 1.0

Everything the trainer does for its image models applies: exactly-once sampling at any world
size, exact metrics (here also bits per character), checkpoints that carry the EMA and resume
bit for bit, preemption, elasticity, the Slurm jobs (``jobs/train.sbatch --task ...``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from torch import nn

import elastic_train as et
from examples.char_lm import ALPHABET, CharLM, Windows, make_text

CONTEXT = 32
CHARS = 40_000


class EMA:
    """An exponential moving average of the parameters, updated after every optimizer step:
    replicated state the task owns (``et.ExtraState``), saved and restored with the checkpoint."""

    def __init__(self, model: nn.Module, decay: float = 0.99) -> None:
        self.model = model
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        del step
        for name, p in self.model.named_parameters():
            self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = self.shadow.keys() - state.keys()
        if missing:
            raise ValueError(f"checkpoint has no EMA for {sorted(missing)[:3]}")
        for name, value in self.shadow.items():
            value.copy_(state[name])


def bits_per_char(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample mean cross-entropy in bits, SUMMED over the batch (a metric is a sum)."""
    nll = nn.functional.cross_entropy(outputs, targets, reduction="none").mean(dim=1)
    return nll.sum() / math.log(2)


def task(cfg: et.TrainConfig) -> et.Task:
    """The ``--task`` entry point: called on every rank with the run's configuration."""
    text = make_text(CHARS, seed=1234)
    cut = int(len(text) * 0.9)

    def data() -> et.TaskData:
        train, val = Windows(text[:cut], CONTEXT), Windows(text[cut:], CONTEXT)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return et.TaskData(
            train=train,
            val=val,
            identity=lambda: {"chars": len(text), "sha256": digest, "context": CONTEXT},
            description=f"generated text ({len(train)} train / {len(val)} val sequences of {CONTEXT} chars)",
        )

    return et.Task(
        name="char-lm",
        data=data,
        model=lambda _: CharLM(len(ALPHABET)),
        metrics={"bits_per_char": bits_per_char},
        extra_state=EMA,
        fingerprint={"vocab": len(ALPHABET)},
    )
