"""The line record (``elastic_train.quorum.line``): what keeps two quorums from committing
different versions of one step, checked against a scripted etcd under arbitrary sequences of
quorums, lost collectives, partitions from etcd and checkpoints."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import etcd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.quorum import line
from elastic_train.quorum.line import (
    CLAIMANTS,
    Claim,
    LineAlive,
    LineLedger,
    LineRecord,
    Version,
    agreed,
    claims_block,
    confirmed,
    decode_claims,
    empty_claim,
    next_record,
    on_line,
)

LINEAGE = 0xABC


@dataclass
class _Node:
    value: str
    modifiedIndex: int  # python-etcd's attribute name


@dataclass
class ScriptedEtcd:
    """One key space with etcd v2's compare-and-swap answers; ``cut`` makes every request fail
    as a member out of reach does, ``lose_reply`` applies the next write and then fails it."""

    keys: dict[str, _Node] = field(default_factory=dict)
    index: int = 0
    cut: bool = False
    lose_reply: bool = False

    def call(self, request: Any) -> Any:
        if self.cut:
            raise etcd.EtcdConnectionFailed("cut off")
        return request(self)

    def read(self, key: str, quorum: bool = False) -> _Node:
        assert quorum, "the record is read with quorum reads"
        if key not in self.keys:
            raise etcd.EtcdKeyNotFound("no key")
        return self.keys[key]

    def write(self, key: str, value: str, prevExist: bool | None = None, prevIndex: int | None = None) -> _Node:
        node = self.keys.get(key)
        if prevExist is False and node is not None:
            raise etcd.EtcdAlreadyExist("exists")
        if prevIndex is not None and (node is None or node.modifiedIndex != prevIndex):
            raise etcd.EtcdCompareFailed("changed")
        self.index += 1
        self.keys[key] = _Node(value, self.index)
        if self.lose_reply:
            self.lose_reply = False
            raise etcd.EtcdConnectionFailed("reply lost")
        return self.keys[key]


def ledger(store: ScriptedEtcd) -> LineLedger:
    return LineLedger(["127.0.0.1:1"], "job", members=store)


def test_a_record_travels_as_json_and_nothing_else_is_taken_for_one() -> None:
    record = LineRecord(LINEAGE, Version(7, 1 << 40), Version(6, 3), (Version(7, 5),), Version(7, 1 << 40))
    assert LineRecord.decode(record.encode()) == record
    for bad in ('{"lineage": "x"}', "[1, 2]", '{"lineage": 1, "head": [1]}', '{"lineage": 1, "head": [1, -2]}'):
        with pytest.raises(ValueError):
            LineRecord.decode(bad)


@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=CLAIMANTS),
    st.integers(0, 1 << 52),
    st.integers(0, (1 << 64) - 1),
    st.data(),
)
def test_the_claims_reach_every_participant_exactly(
    flags: list[tuple[bool, bool, bool]], commits: int, tip: int, data: st.DataObject
) -> None:
    head = Version(data.draw(st.integers(0, 1 << 52)), data.draw(st.integers(0, (1 << 64) - 1)))
    sent = {}
    total = empty_claim() + empty_claim()  # participants that claim nothing add zeros
    for slot, (ok, off, known) in enumerate(flags):
        found = LineRecord(data.draw(st.integers(1, (1 << 48) - 1)), head) if known else None
        sent[slot] = Claim(ok, Version(commits, tip), found, off=off)
        total += claims_block(sent[slot], slot)
    arrived = decode_claims(total)
    assert {k: (c.ok, c.new, c.found, c.off) for k, c in arrived.items()} == {
        k: (c.ok, c.new, c.found, c.off) for k, c in sent.items()
    }
    with pytest.raises(ValueError):
        decode_claims(total + claims_block(sent[0], 0))  # a slot written twice: the membership is not what it seems


def test_a_step_commits_when_a_claim_was_taken_and_every_claimant_claimed_the_same() -> None:
    new = Version(5, 9)
    assert agreed({0: Claim(False, new), 1: Claim(True, new)}) == new  # claimant 0 cut off from etcd
    assert agreed({0: Claim(False, new), 1: Claim(False, new)}) is None
    assert agreed({0: Claim(True, new), 1: Claim(True, Version(5, 10))}) is None  # quorum ids differ
    assert agreed({}) is None


def test_a_claim_moves_the_head_one_step_and_is_idempotent() -> None:
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(0, 0))
    assert book.claim(LINEAGE, Version(0, 0), Version(1, 5)).ok
    store.lose_reply = True  # the swap is applied, its reply lost: the retry reads it and agrees
    assert book.claim(LINEAGE, Version(1, 5), Version(2, 5)).ok
    assert book.read()[0] == LineRecord(LINEAGE, Version(2, 5), Version(1, 5))
    # A quorum standing behind the head cannot claim: it waits for a replica holding the head.
    refused = book.claim(LINEAGE, Version(0, 0), Version(1, 9))
    assert not refused.ok and refused.found is not None and refused.found.head == Version(2, 5)


def test_an_unapplied_claim_is_voided_and_its_version_is_off_the_line() -> None:
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(4, 0))
    assert book.claim(LINEAGE, Version(4, 0), Version(5, 1)).ok  # participant 0 of quorum 1 dies
    assert book.claim(LINEAGE, Version(4, 0), Version(5, 2)).ok  # the survivors' quorum 2 takes step 5
    record = book.read()[0]
    assert record is not None and record.void == (Version(5, 1),)
    assert not on_line(record, LINEAGE, Version(5, 1))  # a replica that applied it heals
    assert on_line(record, LINEAGE, Version(5, 2)) and on_line(record, LINEAGE, Version(4, 0))
    # Its replica, back, can neither extend it nor checkpoint it.
    assert not book.claim(LINEAGE, Version(5, 1), Version(6, 1)).ok
    assert book.check_commit(LINEAGE, Version(5, 1)) is not None


def test_a_side_cut_off_from_etcd_commits_nothing() -> None:
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(0, 0))
    store.cut = True
    claim = book.claim(LINEAGE, Version(0, 0), Version(1, 1))
    assert not claim.ok and claim.found is None and "EtcdConnectionFailed" in claim.why
    assert book.check_commit(LINEAGE, Version(0, 0)) is not None


def test_a_checkpoint_of_the_head_pins_it_and_a_pinned_head_is_never_voided() -> None:
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(0, 0))
    assert book.claim(LINEAGE, Version(0, 0), Version(1, 1)).ok
    assert book.check_commit(LINEAGE, Version(1, 1)) is None  # the head: pinned, then it may commit
    assert not book.claim(LINEAGE, Version(0, 0), Version(1, 2)).ok  # so it cannot be voided
    assert book.claim(LINEAGE, Version(1, 1), Version(2, 1)).ok
    assert book.check_commit(LINEAGE, Version(1, 1)) is None  # confirmed: the line went on from it


def test_a_new_line_ends_the_old_one() -> None:
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(0, 0))
    assert book.claim(LINEAGE, Version(0, 0), Version(1, 1)).ok
    book.start(LINEAGE + 1, Version(0, 0))  # every replica restarted: a start from the checkpoint
    refused = book.claim(LINEAGE, Version(1, 1), Version(2, 1))
    assert not refused.ok
    assert not on_line(refused.found, LINEAGE, Version(1, 1))
    assert book.check_commit(LINEAGE, Version(1, 1)) is not None


# ---------------------------------------------------------------------- any sequence of events
REPLICAS = 3
quorums = st.permutations(range(REPLICAS)).flatmap(lambda p: st.integers(1, REPLICAS).map(lambda n: p[:n]))
actions = st.lists(
    st.one_of(
        # a quorum of some replicas (participant 0 first), and which of them apply the step
        st.tuples(st.just("attempt"), quorums, st.sets(st.integers(0, REPLICAS - 1))),
        st.tuples(st.just("cut"), st.booleans(), st.none()),  # the first claimant cut off from etcd, or back
        st.tuples(st.just("save"), st.integers(0, REPLICAS - 1), st.none()),  # a replica's checkpoint
        # some replicas restart together, all at step 0: a start line from the newest checkpoint
        # (the others, cut off meanwhile, keep the line they were on)
        st.tuples(st.just("restart"), quorums, st.none()),
    ),
    max_size=40,
)


@settings(max_examples=1500, deadline=None)
@given(actions)
def test_no_two_versions_of_a_step_survive_whatever_happens(script: list[tuple[Any, Any, Any]]) -> None:
    """Replicas of one job, driven through any sequence of quorums (each attempt's collective
    reaching any subset of its participants: a kill, a freeze, a partition), cuts of the first
    claimant from etcd, checkpoints and restarts. As the strategy does: torchft heals a
    participant behind the quorum's highest step from one at it (whatever its version), the
    first ``CLAIMANTS`` participants claim from where they stand before the positions are
    compared, the step is applied only when a claim was taken, every claimant claimed the same
    version and every position agrees, and a participant the claims show off the line heals
    from a replica on it. Then: no claim ever extended a voided version, of every step at most
    one claimed version of the record's line is not void, and a checkpoint the record let
    commit is never voided later."""
    store = ScriptedEtcd()
    book = ledger(store)
    cut_book = ledger(ScriptedEtcd(cut=True))  # the first claimant's view while it is cut off
    cut = False
    quorum_ids = itertools.count(1)
    lineages = itertools.count(2)
    book.start(1, Version(0, 0))
    where = [(1, Version(0, 0))] * REPLICAS  # each replica's (lineage, version)
    claimed: list[tuple[int, Version, Version]] = []  # (lineage, from, to) of every successful claim
    saved: list[tuple[int, Version]] = []
    for kind, a, b in script:
        if kind == "cut":
            cut = a
        elif kind == "restart":
            lineage = next(lineages)
            origin = Version(max((v.commits for _lin, v in saved), default=0), 0)  # the newest checkpoint
            with mock.patch.object(line.time, "sleep"):  # nothing moves the line while it is watched here
                book.start(lineage, origin)
            for r in a:
                where[r] = (lineage, origin)
        elif kind == "save":
            if book.check_commit(*where[a]) is None:
                saved.append(where[a])
        else:
            quorum, applying = a, b
            top = max(where[r][1].commits for r in quorum)
            source = next(where[r] for r in quorum if where[r][1].commits == top)
            for r in quorum:  # torchft's heal: by step alone
                if where[r][1].commits < top:
                    where[r] = source
            new = Version(top + 1, next(quorum_ids))
            claims = {}
            for slot, r in enumerate(quorum[:CLAIMANTS]):
                claimant = cut_book if cut and slot == 0 else book
                claims[slot] = claimant.claim(where[r][0], where[r][1], new)
                if claims[slot].ok:
                    claimed.append((where[r][0], where[r][1], new))
            version = agreed(claims)
            positions_agree = all(where[r] == where[quorum[0]] for r in quorum)
            if version is not None and positions_agree:
                for r in quorum:
                    if r in applying:
                        where[r] = (where[r][0], version)
                continue
            if version is not None:
                continue  # the position check refuses the attempt (its differing ones heal: not modelled)
            found = next((c.found for c in claims.values() if c.found is not None), None)
            for r in quorum:
                off = any(c.off and where[quorum[slot]] == where[r] for slot, c in claims.items())
                if off or not on_line(found, *where[r]):
                    holders = [w for w in where if found is not None and w == (found.lineage, found.head)]
                    if holders:  # Rejoin: a restart that heals from a replica on the line
                        where[r] = holders[0]
        record = store.keys.get(book.key)
        final = LineRecord.decode(record.value) if record is not None else None
        for lin, version in saved:  # a committed checkpoint is never voided afterwards
            assert final is None or final.lineage != lin or version not in final.void
    record = store.keys.get(book.key)
    assert record is not None
    final = LineRecord.decode(record.value)
    void = set(final.void)
    alive: dict[int, set[Version]] = {}
    for lin, old, new in claimed:
        if lin == final.lineage:
            assert old not in void, f"{new} was claimed from {old}, a voided version"
            if new not in void:
                alive.setdefault(new.commits, set()).add(new)
    assert all(len(v) == 1 for v in alive.values()), alive


def test_a_replica_on_a_voided_version_cannot_void_the_line() -> None:
    """Replica x applied step 1 of quorum 1 alone (its peer's collective failed); the peer's
    quorum 2 voided it and went on. x, back on its own, must not take the line over."""
    book = ledger(ScriptedEtcd())
    book.start(LINEAGE, Version(0, 0))
    assert book.claim(LINEAGE, Version(0, 0), Version(1, 1)).ok  # x applies it
    assert book.claim(LINEAGE, Version(0, 0), Version(1, 2)).ok  # the peer voids it
    assert book.claim(LINEAGE, Version(1, 2), Version(2, 2)).ok
    refused = book.claim(LINEAGE, Version(1, 1), Version(2, 3))
    assert not refused.ok and not on_line(refused.found, LINEAGE, Version(1, 1))
    record = book.read()[0]
    assert record is not None and record.head == Version(2, 2)


def test_an_old_lines_replica_cannot_claim_on_the_new_line_at_the_same_place() -> None:
    book = ledger(ScriptedEtcd())
    book.start(LINEAGE, Version(10, 0))
    book.start(LINEAGE + 1, Version(10, 0))  # the same checkpoint, a new line
    assert not book.claim(LINEAGE, Version(10, 0), Version(11, 1)).ok
    assert book.claim(LINEAGE + 1, Version(10, 0), Version(11, 1)).ok


def test_confirmed_needs_the_line_to_have_gone_on_or_a_pin() -> None:
    record = LineRecord(LINEAGE, Version(3, 2), Version(2, 2), (Version(2, 1),))
    assert confirmed(record, LINEAGE, Version(2, 2))
    assert not confirmed(record, LINEAGE, Version(2, 1))  # voided
    assert not confirmed(record, LINEAGE, Version(3, 2))  # the head, unpinned
    assert not confirmed(record, LINEAGE + 1, Version(2, 2))
    # Another version at the head's step is off the line, voided or not (a claim never made).
    assert not on_line(record, LINEAGE, Version(3, 9)) and on_line(record, LINEAGE, Version(1, 1))
    assert next_record(record, LINEAGE, Version(3, 2), Version(4, 7)) == LineRecord(
        LINEAGE, Version(4, 7), Version(3, 2), (Version(2, 1),)
    )
    with pytest.raises(ValueError):
        next_record(record, LINEAGE, Version(3, 2), Version(5, 7))


def test_a_start_waits_for_a_line_that_still_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas at step 0 (their node restarted) start a quorum of their own while a live one
    is mid-step on the line: the start watches the line (two of its steps) and, seeing it move,
    leaves it alone (the live replica heals them). A line that does not move is ended."""
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(10, 0))
    for step in range(10, 14):  # the live line's claims: its pace is recorded
        assert book.claim(LINEAGE, Version(step, 1 if step > 10 else 0), Version(step + 1, 1)).ok
    record = book.read()[0]
    assert record is not None and 0 <= record.pace_s < 1
    watched: list[float] = []

    def claim_meanwhile(seconds: float) -> None:  # the live replica claims its next step meanwhile
        watched.append(seconds)
        assert book.claim(LINEAGE, Version(14, 1), Version(15, 1)).ok

    monkeypatch.setattr(line.time, "sleep", claim_meanwhile)
    with pytest.raises(LineAlive):
        book.start(LINEAGE + 1, Version(10, 0))
    assert watched == [line.MIN_WATCH_S]
    assert book.read()[0] == LineRecord(LINEAGE, Version(15, 1), Version(14, 1), pace_s=book.read()[0].pace_s)  # type: ignore[union-attr]
    monkeypatch.setattr(line.time, "sleep", watched.append)  # now it is still
    book.start(LINEAGE + 1, Version(10, 0))
    assert book.read()[0] == LineRecord(LINEAGE + 1, Version(10, 0))
    # At the checkpoint's own step (a requeue after a preemption's save) nothing is watched.
    watched.clear()
    book.start(LINEAGE + 2, Version(10, 0))
    assert watched == []
