"""What the participants of a quorum attempt must agree on, checked inside the attempt's first
collective instead of assumed.

torchft orders replicas by its Manager step alone: it heals a replica whose step is lower than
the quorum's highest and trusts equal steps to mean equal state. Two facts make that a
convention rather than a check: each replica cuts its share of the global batch from its OWN
training position, and a quorum that resumes from a checkpoint starts a new line of training
from an older state while a replica that was busy elsewhere kept the old line. So every
attempt carries each participant's ``QuorumPosition`` and nothing commits unless they are equal.

The exchange rides in a SUM all-reduce (the only reduction every transport offers, and the
attempt's exact-sums collective runs anyway): participant ``r`` writes its fields into row
``r`` of a ``world x FIELDS`` float64 block of zeros, so the sum holds every row unchanged.
Each field is an integer below 2^53 (the timeline's 64 bits travel as four 16-bit pieces), so
float64 carries it exactly. ``decode`` refuses a block whose rows are not exactly one
participant's (a row of zeros: a participant did not write; a flag other than 1: two did).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

MAX_EXACT = 1 << 53  # float64 represents every integer below this exactly
# present flag (and timeline length), commits, train step, epoch, evaluating, lineage, tip in two
# 32-bit pieces, timeline in four 16-bit pieces
FIELDS = 12
_TIMELINE_PIECES = 4


def mint_lineage() -> int:
    """A new line of training's id (48 random bits, exact in float64; never 0)."""
    return secrets.randbits(48) | 1


def expected_commits(train_step: int, epoch: int) -> int:
    """The Manager step a continuous run reaches at this position: one commit per global batch
    and one per evaluation round (the epoch end). Every replica, restarted or not, derives its
    Manager step from its position with this, so equal steps mean equal positions."""
    return train_step + epoch


def timeline_key(timeline: str) -> str:
    """The timeline as it travels: itself when it is up to 16 hex digits (``new_timeline``),
    else the first 16 hex digits of its sha256 (a timeline written by something else)."""
    if len(timeline) <= 16 and all(c in "0123456789abcdef" for c in timeline):
        return timeline
    return hashlib.sha256(timeline.encode()).hexdigest()[:16]


def _timeline_pieces(timeline: str) -> list[int]:
    if not timeline:
        return [0] * _TIMELINE_PIECES
    try:
        value = int(timeline, 16)
    except ValueError:
        raise ValueError(f"timeline {timeline!r} is not hexadecimal") from None
    if value >= 1 << (16 * _TIMELINE_PIECES) or len(timeline) > 16:
        raise ValueError(f"timeline {timeline!r} is longer than 64 bits")
    return [(value >> (16 * i)) & 0xFFFF for i in range(_TIMELINE_PIECES)]


def _timeline_text(pieces: Sequence[int], length: int) -> str:
    value = sum(int(p) << (16 * i) for i, p in enumerate(pieces))
    return "" if length == 0 else f"{value:0{length}x}"


@dataclass(frozen=True)
class QuorumPosition:
    """One participant's training position at the start of an attempt."""

    commits: int  # its Manager step (what torchft compares)
    train_step: int  # global batches committed, across epochs
    epoch: int  # epochs completed (evaluation rounds committed)
    evaluating: bool  # the epoch's batches are done, its evaluation round is not
    lineage: int  # the line of training: minted when a quorum starts from a checkpoint or seed
    timeline: str  # the checkpoints' timeline (``Checkpointer.timeline``), 16 hex digits or ""
    # The quorum id that committed its last step (0 at its line's start): replicas at one step
    # of one lineage differ here when two quorums committed that step (``quorum.line``).
    tip: int = 0

    def __post_init__(self) -> None:
        for name in ("commits", "train_step", "epoch", "lineage"):
            value = getattr(self, name)
            if not 0 <= value < MAX_EXACT:
                raise ValueError(f"{name}={value} cannot travel exactly in float64 (0 <= value < 2^53)")
        if not 0 <= self.tip < 1 << 64:
            raise ValueError(f"tip={self.tip} is not a 64-bit quorum id")
        _timeline_pieces(self.timeline)

    def row(self) -> list[float]:
        # The timeline's length travels in the flag's place value (present = 1 + 2 * length):
        # the pieces alone cannot tell "0ab" from "ab".
        flag = 1 + 2 * len(self.timeline)
        fields = [flag, self.commits, self.train_step, self.epoch, int(self.evaluating), self.lineage]
        tip = divmod(self.tip, 1 << 32)
        return [float(v) for v in (*fields, *tip, *_timeline_pieces(self.timeline))]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> QuorumPosition:
        values = [int(v) for v in row]
        if any(float(v) != r for v, r in zip(values, row, strict=True)):
            raise ValueError(f"a position row holds a non-integer: {list(row)}")
        flag, commits, train_step, epoch, evaluating, lineage = values[:6]
        length, odd = divmod(flag - 1, 2)
        if odd or not 0 <= length <= 16 or evaluating not in (0, 1):
            raise ValueError(f"a position row was written by no participant or by two: {list(row)}")
        tip = (values[6] << 32) + values[7]
        return cls(commits, train_step, epoch, bool(evaluating), lineage, _timeline_text(values[8:], length), tip)

    def describe(self) -> str:
        what = "evaluating epoch" if self.evaluating else "training after step"
        return (
            f"{what} {self.epoch + 1 if self.evaluating else self.train_step} "
            f"(manager step {self.commits}, lineage {self.lineage:x}, timeline {self.timeline or '-'}, "
            f"committed by quorum {self.tip})"
        )


def position_block(position: QuorumPosition, rank: int, world: int) -> torch.Tensor:
    """This participant's addend: its row at ``rank``, zeros elsewhere (float64, CPU)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a quorum of {world}")
    block = torch.zeros(world, FIELDS, dtype=torch.float64)
    block[rank] = torch.tensor(position.row(), dtype=torch.float64)
    return block.reshape(-1)


def decode(summed: torch.Tensor, world: int) -> list[QuorumPosition]:
    """Every participant's position from the summed blocks."""
    rows = summed.to(torch.float64).reshape(world, FIELDS).tolist()
    return [QuorumPosition.from_row(row) for row in rows]


@dataclass(frozen=True)
class Disagreement:
    """The participants do not stand at the same place: the attempt must not commit."""

    reference: QuorumPosition  # participant 0's
    differing: tuple[int, ...]  # participants whose position differs from participant 0's
    mine: QuorumPosition

    def explain(self, rank: int) -> str:
        return (
            f"quorum participants disagree on the training position: participant 0 is "
            f"{self.reference.describe()}, participant(s) {list(self.differing)} differ; "
            f"this replica (participant {rank}) is {self.mine.describe()}"
        )


def check(positions: Sequence[QuorumPosition], rank: int) -> Disagreement | None:
    """None when every participant stands where participant 0 does."""
    reference = positions[0]
    differing = tuple(r for r, p in enumerate(positions) if p != reference)
    return Disagreement(reference, differing, positions[rank]) if differing else None


@dataclass(frozen=True)
class LineChoice:
    """Participant 0's answer when a quorum stands at step 0: where its line of training starts.

    Only participant 0 chooses (and settles the checkpoint directory, under the lock); the
    others load what it chose. ``checkpoint`` is the chosen folder's ``(step, version)``, None
    for a start from the seed."""

    checkpoint: tuple[int, int] | None
    lineage: int
    timeline: str

    SIZE: ClassVar[int] = 10  # present, has checkpoint, step, version, lineage, timeline length, 4 pieces

    def block(self) -> torch.Tensor:
        """Participant 0's addend; every other participant adds ``empty_block()``."""
        step, version = self.checkpoint or (0, 0)
        head = [1, int(self.checkpoint is not None), step, version, self.lineage, len(self.timeline)]
        block = empty_block()
        block[:10] = torch.tensor([*head, *_timeline_pieces(self.timeline)], dtype=torch.float64)
        return block

    @classmethod
    def from_block(cls, summed: torch.Tensor) -> LineChoice | None:
        """The choice, or None when participant 0 made none this attempt (it retries)."""
        values = [int(v) for v in summed.tolist()]
        present, has, step, version, lineage, length = values[:6]
        if present == 0 and not any(values):
            return None
        if present != 1 or has not in (0, 1) or not 0 <= length <= 16:
            raise ValueError(f"participant 0's choice did not arrive intact: {values}")
        return cls((step, version) if has else None, lineage, _timeline_text(values[6:10], length))


def empty_block() -> torch.Tensor:
    """A ``LineChoice`` addend of zeros: no choice."""
    return torch.zeros(LineChoice.SIZE, dtype=torch.float64)
