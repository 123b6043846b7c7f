"""The line record (``elastic_train.quorum.line``): what keeps two quorums from committing
different versions of one step, checked against a scripted etcd under arbitrary sequences of
quorums, lost collectives, partitions from etcd and checkpoints."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
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
    next_record,
    on_line,
)
from tests.helpers import start_line_now

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

    hedged = call  # one key space: asking every member at once is asking it once

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
    total = claims_block(None, None) + claims_block(None, None)  # participants that claim nothing add zeros
    for slot, (ok, off, known) in enumerate(flags):
        found = LineRecord(data.draw(st.integers(1, (1 << 48) - 1)), head) if known else None
        sent[slot] = Claim(ok, Version(commits + 1, tip), found, off=off, mine_tip=data.draw(st.integers(0, 2**64 - 1)))
        total += claims_block(sent[slot], slot)
    arrived = decode_claims(total)
    assert {k: (c.ok, c.new, c.found, c.off, c.mine) for k, c in arrived.items()} == {
        k: (c.ok, c.new, c.found, c.off, c.mine) for k, c in sent.items()
    }
    with pytest.raises(ValueError):
        decode_claims(total + claims_block(sent[0], 0))  # a slot written twice: the membership is not what it seems


def test_a_step_commits_when_a_claim_was_taken_and_every_claimant_claimed_the_same() -> None:
    new = Version(5, 9)
    assert agreed({0: Claim(False, new), 1: Claim(True, new)}) == new  # claimant 0 cut off from etcd
    assert agreed({0: Claim(False, new), 1: Claim(False, new)}) is None
    assert agreed({0: Claim(True, new), 1: Claim(True, Version(5, 10))}) is None  # quorum ids differ
    assert agreed({}) is None


def test_a_claim_moves_the_head_one_step_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fixed clock: the record carries the pace between claims (quiet_s), which a loaded
    # machine's real clock would make a millisecond or more.
    monkeypatch.setattr(line.time, "monotonic", lambda: 1000.0)
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
    start_line_now(book, LINEAGE + 1, Version(0, 0))  # every replica restarted: a start from the checkpoint
    refused = book.claim(LINEAGE, Version(1, 1), Version(2, 1))
    assert not refused.ok
    assert not on_line(refused.found, LINEAGE, Version(1, 1))
    assert book.check_commit(LINEAGE, Version(1, 1)) is not None


# ---------------------------------------------------------------------- any sequence of events
REPLICAS = 4
FRESH = (0, Version(0, 0))  # a restarted replica: at step 0, on no line yet
quorums = st.permutations(range(REPLICAS)).flatmap(lambda p: st.integers(1, REPLICAS).map(lambda n: p[:n]))
actions = st.lists(
    st.one_of(
        # a quorum of some replicas (participant 0 first), and which of them apply the step
        st.tuples(st.just("attempt"), quorums, st.sets(st.integers(0, REPLICAS - 1))),
        # two quorums at once (an old Lighthouse's last one and the new one's), their claims
        # interleaved in the drawn order, and which replicas apply
        st.tuples(
            st.just("race"),
            st.tuples(quorums, st.lists(st.booleans(), min_size=2 * CLAIMANTS, max_size=2 * CLAIMANTS)),
            st.sets(st.integers(0, REPLICAS - 1)),
        ),
        # a claim of an earlier attempt landing late (an older quorum id), from where a replica stands
        st.tuples(st.just("late"), st.integers(0, REPLICAS - 1), st.none()),
        st.tuples(st.just("cut"), st.booleans(), st.none()),  # the first claimant cut off from etcd, or back
        st.tuples(st.just("save"), st.integers(0, REPLICAS - 1), st.none()),  # a replica's checkpoint
        st.tuples(st.just("restart"), quorums, st.none()),  # some replicas restart: at step 0
        st.tuples(st.just("start"), st.none(), st.none()),  # the restarted ones' start of a line, tried
        st.tuples(st.just("tick"), st.floats(0, 10), st.none()),  # time passes
    ),
    max_size=40,
)


@settings(max_examples=1500, deadline=None)
@given(actions)
def test_no_two_versions_of_a_step_survive_whatever_happens(script: list[tuple[Any, Any, Any]]) -> None:
    """Replicas of one job, driven through any sequence of quorums (each attempt's collective
    reaching any subset of its participants: a kill, a freeze, a partition), two quorums racing
    with interleaved claims, an older attempt's claim landing late, cuts of the first claimant
    from etcd, checkpoints, restarts and starts of a line. As the strategy does: torchft heals
    a participant behind the quorum's highest step from one at it (whatever its version), the
    first ``CLAIMANTS`` participants claim from where they stand before the positions are
    compared, the step is applied only when a claim was taken, every claimant claimed the same
    version and every position agrees, and a participant ``off_line`` says is off heals from a
    replica on the line. Then: no claim ever extended a voided version, no voided version was
    taken again, of every step at most one claimed version of the record's line is not void,
    and a checkpoint the record let commit is never voided later."""
    clock = [0.0]
    store = ScriptedEtcd()
    book = ledger(store)
    cut_book = ledger(ScriptedEtcd(cut=True))  # the first claimant's view while it is cut off
    cut = False
    quorum_ids = itertools.count(10)
    lineages = itertools.count(2)
    book.start(1, Version(0, 0))
    where = [(1, Version(0, 0))] * REPLICAS  # each replica's (lineage, version)
    claimed: list[tuple[int, Version, Version]] = []  # (lineage, from, to) of every successful claim
    saved: list[tuple[int, Version]] = []
    starter = ledger(store)

    def void_now() -> set[Version]:
        record = store.keys.get(book.key)
        return set(LineRecord.decode(record.value).void) if record is not None else set()

    def claim(slot: int, r: int, new: Version) -> Claim:
        lineage, mine = where[r]
        before = void_now()
        result = (cut_book if cut and slot == 0 else book).claim(lineage, mine, new)
        if result.ok:
            assert mine not in before and new not in before, f"{new} from {mine} taken, one of them void"
            claimed.append((lineage, mine, new))
        return result

    def settle(quorum: Sequence[int], claims: dict[int, Claim], applying: set[int]) -> None:
        version = agreed(claims)
        stands = [where[r] for r in quorum]
        if version is not None and all(w == stands[0] for w in stands):
            for r in quorum:
                if r in applying:
                    where[r] = (where[r][0], version)
            return
        for i, r in enumerate(quorum):
            if line.off_line(claims, stands, lambda slot: slot, i):
                found = book.read()[0]  # Rejoin: a restart that heals from a replica on the line
                holders = [w for w in where if found is not None and w == (found.lineage, found.head)]
                where[r] = holders[0] if holders else FRESH

    with mock.patch.object(line.time, "monotonic", lambda: clock[0]):
        for kind, a, b in script:
            clock[0] += 0.01
            if kind == "cut":
                cut = a
            elif kind == "tick":
                clock[0] += a
            elif kind == "restart":
                for r in a:
                    where[r] = FRESH
            elif kind == "start":
                fresh = [r for r in range(REPLICAS) if where[r] == FRESH]
                if fresh and not cut:
                    lineage = next(lineages)
                    origin = Version(max((v.commits for _lin, v in saved), default=0), 0)  # the newest checkpoint
                    with contextlib.suppress(LineAlive):
                        if starter.start(lineage, origin):
                            for r in fresh:
                                where[r] = (lineage, origin)
            elif kind == "save":
                if where[a] != FRESH and book.check_commit(*where[a]) is None:
                    saved.append(where[a])
            elif kind == "late":
                if where[a] != FRESH:
                    claim(1, a, Version(where[a][1].commits + 1, 1))  # quorum id 1: older than any
            else:
                quorum = a if kind == "attempt" else a[0]
                live = [r for r in quorum if where[r] != FRESH]
                top = max((where[r][1].commits for r in live), default=None)
                if top is None:
                    continue  # all at step 0 on no line: their start of a line comes first
                source = next(where[r] for r in live if where[r][1].commits == top)
                for r in quorum:  # torchft's heal: by step alone
                    if r not in live or where[r][1].commits < top:
                        where[r] = source
                if kind == "attempt":
                    new = Version(top + 1, next(quorum_ids))
                    claims = {slot: claim(slot, r, new) for slot, r in enumerate(quorum[:CLAIMANTS])}
                    settle(quorum, claims, b)
                    continue
                # A race: the quorum split in two at the same place, each with its own quorum id,
                # their claimants' requests in the drawn order.
                half = max(1, len(quorum) // 2)
                sides = [list(quorum[:half]), list(quorum[half:]) or list(quorum[:half])]
                news = [Version(top + 1, next(quorum_ids)) for _ in sides]
                pending = [(side, slot, r) for side in (0, 1) for slot, r in enumerate(sides[side][:CLAIMANTS])]
                order = sorted(range(len(pending)), key=lambda i: (a[1][i], i))
                results: list[dict[int, Claim]] = [{}, {}]
                for i in order:
                    side, slot, r = pending[i]
                    results[side][slot] = claim(slot, r, news[side])
                for side in (0, 1):
                    settle(sides[side], results[side], b)
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


def test_a_start_watches_a_line_ahead_of_it_and_leaves_a_moving_one_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas at step 0 (their node restarted) form a quorum of their own while a live one is
    mid-step on the line: the start watches the line, across attempts, for twice its quiet time
    and, seeing it move, leaves it alone (the live replica heals them). A line that does not
    move for that long is ended. An evaluation round's claim records the round's bound."""
    clock = [1000.0]
    monkeypatch.setattr(line.time, "monotonic", lambda: clock[0])
    store = ScriptedEtcd()
    book = ledger(store)
    book.start(LINEAGE, Version(10, 0))
    assert book.claim(LINEAGE, Version(10, 0), Version(11, 1)).ok
    clock[0] += 0.3
    assert book.claim(LINEAGE, Version(11, 1), Version(12, 1)).ok
    assert book.read()[0].quiet_s == pytest.approx(0.3)  # type: ignore[union-attr]
    assert book.claim(LINEAGE, Version(12, 1), Version(13, 1), quiet_s=30.0).ok  # an evaluation round
    assert book.read()[0].quiet_s == 30.0  # type: ignore[union-attr]
    starter = ledger(store)
    assert not starter.start(LINEAGE + 1, Version(10, 0))  # watching begins
    clock[0] += 59.0
    assert not starter.start(LINEAGE + 1, Version(10, 0))  # 2 x 30 s not over yet
    assert book.claim(LINEAGE, Version(13, 1), Version(14, 1)).ok  # the live replica's next claim
    with pytest.raises(LineAlive):
        starter.start(LINEAGE + 1, Version(10, 0))
    assert book.read()[0].head == Version(14, 1)  # type: ignore[union-attr]
    # Still now (its quiet time is the pace, 59 s): ended after twice that.
    assert not starter.start(LINEAGE + 1, Version(10, 0))
    clock[0] += 2 * 59.0 + 0.1
    assert starter.start(LINEAGE + 1, Version(10, 0))
    assert book.read()[0] == LineRecord(LINEAGE + 1, Version(10, 0))
    # At the checkpoint's own step (a requeue after a preemption's save) nothing is watched.
    assert starter.start(LINEAGE + 2, Version(10, 0))


def test_only_a_later_quorum_voids_and_a_voided_version_never_comes_back() -> None:
    """Two quorums claiming one step from one place (an old Lighthouse's last quorum overlapping
    the new one's, or an older attempt's claim landing late), their claims interleaved: the
    later quorum's claim may void the earlier one's, never the reverse, and a voided version is
    never claimed again, extended or pinned."""
    book = ledger(ScriptedEtcd())
    book.start(LINEAGE, Version(5, 0))
    old, new = Version(6, 101), Version(6, 102)
    assert book.claim(LINEAGE, Version(5, 0), old).ok
    assert book.claim(LINEAGE, Version(5, 0), new).ok  # voids the older quorum's claim
    assert not book.claim(LINEAGE, Version(5, 0), old).ok  # its second claimant: no coming back
    assert book.claim(LINEAGE, Version(5, 0), new).ok  # the later quorum's second claimant: done already
    assert not book.claim(LINEAGE, old, Version(7, 103)).ok
    assert book.check_commit(LINEAGE, old) is not None
    book2 = ledger(ScriptedEtcd())
    book2.start(LINEAGE, Version(5, 0))
    assert book2.claim(LINEAGE, Version(5, 0), new).ok
    assert not book2.claim(LINEAGE, Version(5, 0), old).ok  # late and older: refused, not voiding


def test_a_record_naming_a_voided_head_extends_and_pins_nothing() -> None:
    """Defence in depth (the tip order already keeps a voided version from coming back): a
    record whose head is on its own void list is a dead end."""
    record = LineRecord(LINEAGE, Version(6, 101), Version(5, 0), (Version(6, 101),))
    assert next_record(record, LINEAGE, Version(6, 101), Version(7, 120)) is None
    assert next_record(record, LINEAGE, Version(5, 0), Version(6, 101)) is None
    assert line.pinned(record, LINEAGE, Version(6, 101)) is None


def test_who_leaves_is_decided_by_the_record_not_by_participant_0() -> None:
    """Participant 0 (group 0) applied a step later voided; participant 1 stands on the line and
    its claim is taken: participant 0 leaves, participant 1 stays, whatever the ranks."""
    voided, line_version = Version(6, 101), Version(6, 102)
    stands = [(LINEAGE, voided), (LINEAGE, line_version)]
    found = LineRecord(LINEAGE, line_version)
    after = LineRecord(LINEAGE, Version(7, 110), line_version)  # what the taken claim read back
    claims = {
        0: Claim(False, Version(7, 110), found, off=True, mine_tip=voided.tip),
        1: Claim(True, Version(7, 110), after, mine_tip=line_version.tip),
    }
    assert line.off_line(claims, stands, lambda slot: slot, 0)
    assert not line.off_line(claims, stands, lambda slot: slot, 1)
    # Participant 0 not a claimant at all (only the taken claim says where the line is).
    assert line.off_line({1: claims[1]}, stands, lambda slot: slot, 0)
    # No claim taken: the claimant that read the void list takes those standing with it along.
    refused = {0: Claim(False, Version(7, 110), found, off=True, mine_tip=voided.tip)}
    assert line.off_line(refused, [(LINEAGE, voided), (LINEAGE, voided)], lambda slot: slot, 1)
    # Behind the head, nobody knows more: stay and wait for a replica holding it.
    behind = {0: Claim(False, Version(6, 110), LineRecord(LINEAGE, Version(9, 3)), mine_tip=2)}
    assert not line.off_line(behind, [(LINEAGE, Version(5, 2))], lambda slot: slot, 0)
    # Groups of K workers: claimant slot g is participant g x K.
    wide = [(LINEAGE, voided), (LINEAGE, voided), (LINEAGE, line_version), (LINEAGE, line_version)]
    assert line.off_line(claims, wide, lambda slot: 2 * slot, 1)
    assert not line.off_line(claims, wide, lambda slot: 2 * slot, 3)
