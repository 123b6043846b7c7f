"""The line record: which quorum committed each step, kept in etcd, so that the job's line holds
one version of each step, whatever the partitions (quorum mode with ``--lighthouse-etcd``).

The Lighthouse's seat (``quorum.seat``) keeps two Lighthouses from serving at once, but not two
lines of training from forming one after the other: a holder cut off from etcd and from the
other replicas between two steps forms quorums of its own side and commits until its fence,
and the other side, once it holds the seat, commits the same steps again from where it stood.
The record closes that: one key per job, ``/elastic-train/<job>/line``, whose value names the
line's head, the ``Version`` (Manager step, quorum id) of its last claimed commit.

* A step is claimed before it commits. The attempt's first ``CLAIMANTS`` participants each
  compare-and-swap the record from their own version (the head) to the attempt's
  (``next_record``; the same swap from each, so all but the first find it done), while the
  step's forward and backward run; the claims travel in the attempt's first collective
  (``claims_block``), and no participant applies the step unless a swap succeeded and every
  claimant claimed the same version (``agreed``). A side cut off from etcd's majority cannot
  swap, so it commits nothing; one claimant cut off alone stalls nothing.
* A claim whose step never committed anywhere (its claimant died after the swap, its
  collective failed) is the head but nobody stands on it. The next quorum, standing on the
  head's predecessor, swaps it out and lists it as void (``void``); only a later quorum may
  (quorum ids grow), so a late claim of an older attempt voids nothing. A replica that did
  apply a voided step (its collective succeeded where a peer's failed, and it then lost the
  others) is off the line: the version is never claimed again nor extended, and its replica
  heals (``Rejoin``; who leaves is the record's call, ``off_line``). A checkpoint commits only
  for a version the record confirms, and a checkpoint of the head pins it first (``pin``): a
  pinned head is never voided.
* The start of a line (every replica of the quorum at step 0: a launch, a requeue, every replica
  lost) writes a new record with its new lineage (``LineLedger.start``): a replica still holding
  the previous line (cut off when the others all restarted) can never claim on it again. A
  line ahead of the start's checkpoint is watched first: one that still moves has a live
  replica, which heals the ones at step 0 (``LineAlive``).

The price is availability in the case nobody can decide: when the head is more than one step
ahead of every live replica's version, or is pinned, the survivors cannot tell whether its
replicas are dead or cut off, and wait (the attempts are discarded until their bound; a whole
restart then starts a new line from the newest checkpoint). And every commit waits for a swap
in etcd (a Raft round), overlapped with the forward and backward. docs/fault-tolerance.md,
"The coordinator", has the measurements.

The record is JSON, read from etcd; nothing from the network is unpickled.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from elastic_train.quorum.names import LINE_VAR

KEY = "/elastic-train/{job}/line"
MAX_VOID = 256  # voided versions kept: voids are per participant-0 failure, a handful per job
MIN_WATCH_S = 2.0  # a start of a line watches a line ahead of it at least this long
MAX_QUIET_S = 3600.0  # a longer pause between claims is recorded as this
_LOW = 1 << 32


@dataclass(frozen=True, order=True)
class Version:
    """A replica's place on its line: the Manager step it has committed, and the quorum id
    (term-carrying, ``quorum.term``) of the quorum that committed it; 0 at the line's start."""

    commits: int
    tip: int

    def to_json(self) -> list[int]:
        return [self.commits, self.tip]

    @classmethod
    def from_json(cls, value: Any) -> Version:
        if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
            raise ValueError(f"a version is [commits, tip] of non-negative integers, got {value!r}")
        return cls(value[0], value[1])

    def __str__(self) -> str:
        return f"step {self.commits} of quorum {self.tip}"


@dataclass(frozen=True)
class LineRecord:
    """The record's value: the line's lineage and head, the head's predecessor (None at the
    line's start), the versions voided, and the head when a checkpoint pinned it."""

    lineage: int
    head: Version
    prev: Version | None = None
    void: tuple[Version, ...] = ()
    pin: Version | None = None
    # How long the line may be quiet before its next claim, by the claimant's own clock (its
    # rate only): the time since its previous claim, or an evaluation round's bound; a start of a
    # line watches a line ahead of it twice that long (``LineLedger.start``).
    quiet_s: float = 0.0

    def encode(self) -> str:
        return json.dumps(
            {
                "lineage": self.lineage,
                "head": self.head.to_json(),
                "prev": self.prev.to_json() if self.prev is not None else None,
                "void": [v.to_json() for v in self.void],
                "pin": self.pin.to_json() if self.pin is not None else None,
                "quiet_s": round(min(self.quiet_s, MAX_QUIET_S), 3),
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: str) -> LineRecord:
        """ValueError for anything but a record this module wrote."""
        fields = json.loads(text)
        if not isinstance(fields, dict) or type(fields.get("lineage")) is not int:
            raise ValueError(f"not a line record: {text[:200]!r}")
        void = fields.get("void", [])
        if not isinstance(void, list):
            raise ValueError(f"a line record's void is a list, got {void!r}")
        optional = {k: Version.from_json(fields[k]) if fields.get(k) is not None else None for k in ("prev", "pin")}
        quiet = fields.get("quiet_s", 0.0)
        if type(quiet) not in (int, float) or not 0 <= quiet <= MAX_QUIET_S:
            raise ValueError(f"a line record's quiet_s is seconds, got {quiet!r}")
        return cls(
            fields["lineage"],
            Version.from_json(fields.get("head")),
            optional["prev"],
            tuple(Version.from_json(v) for v in void),
            optional["pin"],
            float(quiet),
        )


def next_record(
    found: LineRecord | None, lineage: int, mine: Version, new: Version, quiet_s: float | None = None
) -> LineRecord | None:
    """The record once a quorum standing at ``mine`` has claimed ``new`` (one step on), or None
    when the record refuses the claim. ``found`` is the record read (None: there is none, i.e.
    etcd lost its data: the claim recreates it). A returned record equal to ``found`` means the
    claim is already there (a retry whose first swap succeeded but whose reply was lost, or
    another claimant of the same attempt).

    A head is voided only by a claim from its predecessor by a LATER quorum (quorum ids grow:
    they carry the Lighthouse's term): an older quorum's claim that lands late, or a quorum of a
    Lighthouse just fenced, never voids a newer one's step. A voided version is never claimed
    again nor extended."""
    if new.commits != mine.commits + 1:
        raise ValueError(f"a claim is one step on: {mine} to {new}")
    if found is None:
        return LineRecord(lineage, new, mine, quiet_s=quiet_s or 0.0)
    quiet = found.quiet_s if quiet_s is None else quiet_s
    if found.lineage != lineage or new in found.void or mine in found.void:
        return None  # another line started since, or a voided version: this replica is off the line
    if found.head == new and found.prev == mine:
        return found
    if found.head == mine:
        return replace(found, head=new, prev=mine, quiet_s=quiet)
    head = found.head
    unapplied = found.prev == mine and head.commits == new.commits and found.pin != head and head.tip < new.tip
    if unapplied:  # a claim from where this quorum stands that no live replica applied: void it
        return replace(found, head=new, prev=mine, void=(*found.void, head)[-MAX_VOID:], quiet_s=quiet)
    return None


def confirmed(found: LineRecord | None, lineage: int, version: Version) -> bool:
    """Whether a version whose claim succeeded is on the line for good: the line went on from
    it (or it is the pinned head), and it was not voided."""
    if found is None or found.lineage != lineage or version in found.void:
        return False
    return found.head.commits > version.commits or found.pin == version


def pinned(found: LineRecord | None, lineage: int, version: Version) -> LineRecord | None:
    """The record with ``version`` pinned, when it is the head (a checkpoint of it may then
    commit, and it is never voided); None when it is not the head."""
    if found is None or found.lineage != lineage or found.head != version or version in found.void:
        return None
    return replace(found, pin=version)


def on_line(found: LineRecord | None, lineage: int, version: Version) -> bool:
    """False when the record says this replica's state is not the line's: another line started,
    or the line holds another version at its step (its own was voided, or never claimed)."""
    if found is None:
        return True
    if found.lineage != lineage or version in found.void:
        return False
    return not (found.head.commits == version.commits and found.head != version)


# Participants that claim each step (the first groups' first workers): one cut off from etcd
# while it reaches its peers stalls nothing.
CLAIMANTS = 3


@dataclass(frozen=True)
class Claim:
    """One claimant's claim as it travels in the attempt's first collective: whether the record
    took it, the version the step commits as (every participant's next ``tip``), whether the
    claimant's own version is off the line (``off``: the whole record said so, void list
    included), and what the record held (``found``, None when etcd did not answer; the
    receivers get its lineage and head only)."""

    ok: bool
    new: Version
    found: LineRecord | None = None
    why: str = ""
    voided: Version | None = None  # the claimant only: the unapplied head this claim voided
    off: bool = False
    mine_tip: int = 0  # where the claimant stood: (new.commits - 1, mine_tip)

    # written, ok, off, new commits, new tip (2 pieces), mine's tip (2 pieces), record known,
    # lineage, head commits, head tip (2 pieces)
    SIZE: ClassVar[int] = 13

    @property
    def mine(self) -> Version:
        return Version(self.new.commits - 1, self.mine_tip)

    def row(self) -> list[int]:
        """Each field an integer below 2^53 (float64 carries it exactly): the tips (up to 2^63)
        travel as two 32-bit pieces."""
        known = self.found is not None
        head = self.found.head if self.found is not None else Version(0, 0)
        lineage = self.found.lineage if self.found is not None else 0
        return [
            1, int(self.ok), int(self.off), self.new.commits, *divmod(self.new.tip, _LOW), *divmod(self.mine_tip, _LOW),
            int(known), lineage, head.commits, *divmod(head.tip, _LOW),
        ]  # fmt: skip

    @classmethod
    def from_row(cls, row: Sequence[float]) -> Claim | None:
        """The claim in a summed row; None when no claimant wrote it."""
        values = [int(v) for v in row]
        if any(float(v) != r for v, r in zip(values, row, strict=True)):
            raise ValueError(f"a claim did not arrive intact: {list(row)}")
        if not any(values):
            return None
        written, ok, off, commits, tip_hi, tip_lo, mine_hi, mine_lo, known, lineage, head_commits, *head = values
        if written != 1 or ok not in (0, 1) or off not in (0, 1) or known not in (0, 1) or commits < 1:
            raise ValueError(f"a claim was written by two participants: {values}")
        found = LineRecord(lineage, Version(head_commits, head[0] * _LOW + head[1])) if known else None
        new = Version(commits, tip_hi * _LOW + tip_lo)
        return cls(bool(ok), new, found, off=bool(off), mine_tip=mine_hi * _LOW + mine_lo)


def claims_block(claim: Claim | None, slot: int | None) -> torch.Tensor:
    """A participant's addend for the claims: its claim in row ``slot``, zeros elsewhere."""
    block = torch.zeros(CLAIMANTS, Claim.SIZE, dtype=torch.float64)
    if claim is not None and slot is not None:
        block[slot] = torch.tensor(claim.row(), dtype=torch.float64)
    return block.reshape(-1)


def decode_claims(summed: torch.Tensor) -> dict[int, Claim]:
    """The claims in the summed block, by claimant slot."""
    rows = summed.to(torch.float64).reshape(CLAIMANTS, Claim.SIZE).tolist()
    return {slot: claim for slot, row in enumerate(rows) if (claim := Claim.from_row(row)) is not None}


def agreed(claims: dict[int, Claim]) -> Version | None:
    """The version the step commits as: the record took a claim, and every claimant claimed
    that same version (claimants whose quorum ids differ are in an attempt that cannot commit:
    their claims may void each other). None: the step must not commit."""
    if not claims or len({c.new for c in claims.values()}) != 1:
        return None
    return next(iter(claims.values())).new if any(c.ok for c in claims.values()) else None


def off_line(
    claims: dict[int, Claim], stands: Sequence[tuple[int, Version]], claimant_index: Callable[[int], int], me: int
) -> bool:
    """Whether participant ``me`` must leave and heal, from the attempt's claims and where every
    participant stands (``stands``: (lineage, version) by participant; ``claimant_index``: the
    participant of a claimant slot). When a claim was taken, the record says where the line is:
    the taken claim's starting point, whatever participant 0 holds. When none was, a claimant
    that read the whole record (its void list included) and found its own version off the line
    takes every participant standing where it stands with it; the others compare with the
    record's lineage and head."""
    lineage, mine = stands[me]
    taken = [c for c in claims.values() if c.ok]
    if taken and agreed(claims) is not None:
        return (lineage, mine) != (stands[claimant_index(next(s for s, c in claims.items() if c.ok))][0], taken[0].mine)
    for slot, claim in claims.items():
        if claim.off and claimant_index(slot) < len(stands) and stands[claimant_index(slot)] == (lineage, mine):
            return True
    found = next((c.found for c in claims.values() if c.found is not None), None)
    return not on_line(found, lineage, mine)


class LineAlive(RuntimeError):
    """A start of a line found the record's line still moving: a live replica holds it, and the
    replicas at step 0 heal from it instead of starting over from an older checkpoint."""


class LineLedger:
    """One worker's access to the record (participant 0 claims; a saver confirms). Each call is
    a quorum read and, when it changes the record, a compare-and-swap on the index it read:
    idempotent, so a request whose reply was lost is retried (the next read shows its result)."""

    ROUNDS = 3  # read-and-swap rounds before a claim gives up (another writer raced each one)

    def __init__(self, endpoints: Sequence[str], job: str, read_timeout_s: float = 1.0, members: Any = None) -> None:
        from elastic_train.quorum.seat import Members

        if not job or "/" in job:
            raise ValueError(f"job id {job!r} must be non-empty and free of '/'")
        self.key = KEY.format(job=job)
        self.endpoints = tuple(endpoints)
        self._members = members if members is not None else Members(self.endpoints, read_timeout_s)
        self._last_claim: tuple[int, float] | None = None  # (step claimed, when): the line's pace
        self._watch: tuple[int | None, float] | None = None  # a start's watch: (index seen, since)

    def read(self) -> tuple[LineRecord | None, int | None]:
        """The record and its modified index; (None, None) when there is none. Raises when no
        member answers, ValueError when the key holds something else."""
        import etcd

        try:
            found = self._members.hedged(lambda c: c.read(self.key, quorum=True))
        except etcd.EtcdKeyNotFound:
            return None, None
        return LineRecord.decode(found.value), int(found.modifiedIndex)

    def _swap(self, record: LineRecord, index: int | None) -> bool:
        """Write ``record`` if the key is still at ``index`` (absent when None); False when it
        changed meanwhile, or when no answer came: the write may have been applied, and the
        next read tells (``update``)."""
        import etcd

        from elastic_train.quorum.seat import unreachable

        value = record.encode()
        try:
            if index is None:
                self._members.call(lambda c: c.write(self.key, value, prevExist=False))
            else:
                self._members.call(lambda c: c.write(self.key, value, prevIndex=index))
        except (etcd.EtcdCompareFailed, etcd.EtcdAlreadyExist, etcd.EtcdKeyNotFound, *unreachable()):
            return False
        return True

    def update(self, change: Callable[[LineRecord | None], LineRecord | None]) -> tuple[bool, LineRecord | None]:
        """Read, ``change``, swap, until a swap succeeds or ``change`` refuses (None). Returns
        (written or already so, the record last read or written). Raises when etcd does not
        answer or the rounds run out (other writers)."""
        for _ in range(self.ROUNDS):
            found, index = self.read()
            wanted = change(found)
            if wanted is None:
                return False, found
            if wanted == found or self._swap(wanted, index):
                return True, wanted
        raise RuntimeError(f"the line record {self.key} changed under {self.ROUNDS} swaps in a row")

    def claim(self, lineage: int, mine: Version, new: Version, quiet_s: float = 0.0) -> Claim:
        """May the attempt commit ``new``? ``quiet_s``: how long the line may be quiet after
        this claim besides the pace of claims (an evaluation round's bound). Never raises: etcd
        out of reach is a refused claim (the attempt is discarded and tried again)."""
        began = time.monotonic()
        last = self._last_claim
        pace = began - last[1] if last is not None and last[0] == mine.commits else 0.0
        try:
            ok, record = self.update(lambda found: next_record(found, lineage, mine, new, max(pace, quiet_s)))
        except Exception as exc:  # any failure to reach a verdict refuses the claim
            why = f"the line record could not be swapped: {type(exc).__name__}: {exc}"
            return Claim(False, new, None, why, mine_tip=mine.tip)
        if ok:
            assert record is not None
            self._last_claim = (new.commits, began)
            voided = record.void[-1] if record.void and record.void[-1].commits == new.commits else None
            return Claim(True, new, record, voided=voided if record.prev == mine else None, mine_tip=mine.tip)
        why = f"the line record refuses {new} from {mine}: " + (
            f"its head is {record.head} (lineage {record.lineage:x})" if record is not None else "it is missing"
        )
        off = record is not None and not on_line(record, lineage, mine)
        return Claim(False, new, record, why, off=off, mine_tip=mine.tip)

    def start(self, lineage: int, origin: Version) -> bool:
        """A new line from ``origin`` (the start of a quorum at step 0): True once written. When
        the record's line is ahead of the origin, it is watched first, across calls, for twice
        its ``quiet_s`` (at least ``MIN_WATCH_S``): False while watching; ``LineAlive`` when
        it moved meanwhile (a live replica holds it, and heals the replicas at step 0 once it
        shares a quorum with them). Raises when etcd does not answer."""
        found, index = self.read()
        if found is not None and found.head.commits > origin.commits:
            watching, self._watch = self._watch, None
            if watching is not None and watching[0] != index:
                raise LineAlive(f"the line record moved on to {found.head} while watched")
            if watching is None or time.monotonic() - watching[1] < max(MIN_WATCH_S, 2 * found.quiet_s):
                self._watch = watching or (index, time.monotonic())
                return False
        self._watch = None
        wanted = LineRecord(lineage, origin)  # a new line: every earlier one ends here
        if not self._swap(wanted, index) and self.read()[0] != wanted:
            raise LineAlive("the line record changed while a new line was written")
        return True

    def check_commit(self, lineage: int, version: Version) -> str | None:
        """Before a checkpoint of ``version`` commits: None when the record confirms it (pinning
        it when it is the head), else why not."""
        try:
            found, _ = self.read()
            if confirmed(found, lineage, version):
                return None
            ok, found = self.update(lambda f: f if confirmed(f, lineage, version) else pinned(f, lineage, version))
        except Exception as exc:  # no verdict: the checkpoint must not commit
            return f"the line record could not be read: {type(exc).__name__}: {exc}"
        if ok:
            return None
        head = f"its head is {found.head} of lineage {found.lineage:x}" if found is not None else "it is missing"
        return f"the line record does not hold {version} of lineage {lineage:x} ({head})"


def ledger_from_env(job: str) -> LineLedger | None:
    """The worker's ledger when its agent gave it etcd's members (``LINE_VAR``), else None."""
    endpoints = tuple(filter(None, os.environ.get(LINE_VAR, "").split(",")))
    return LineLedger(endpoints, job) if endpoints else None
