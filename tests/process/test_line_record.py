"""The line record (``elastic_train.quorum.line``) against a real three-member etcd: claims,
voids and pins are compare-and-swaps that etcd itself arbitrates (two claimants racing for one
step: exactly one wins), a claim survives the loss of the member it talks to, and what a claim
costs. Needs Debian's etcd-server; skips without it, unless ELASTIC_TRAIN_REQUIRE_ETCD=1."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_train.quorum.line import LineLedger, Version, on_line
from elastic_train.testing.etcd import EtcdMember, etcd_cluster, leader, require_etcd
from tests.helpers import start_line_now

pytestmark = pytest.mark.timeout(120)
LINEAGE = 0x5EED


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[EtcdMember]]:
    require_etcd()
    with etcd_cluster(tmp_path) as cluster:
        yield cluster


def book(members: list[EtcdMember], job: str = "line-test") -> LineLedger:
    return LineLedger([m.client for m in members], job)


def test_two_quorums_racing_for_one_step_leave_one_version_standing(members: list[EtcdMember]) -> None:
    """Both stand at step 3 and claim step 4 at once, each through its own client and member.
    etcd's compare-and-swap orders them: the first swaps, and the second, finding an unapplied
    claim from where it stands, may void it and take the step (it cannot know the first was
    not applied: the voided version is then off the line). Whatever the order, exactly one
    version of step 4 is standing, and it is the record's head: no update is lost."""
    first = book(members)
    first.start(LINEAGE, Version(3, 0))
    ledgers = [book(members[i:] + members[:i]) for i in (0, 1)]  # each talks to another member first
    results: list[bool] = [False, False]
    barrier = threading.Barrier(2)

    def claim(i: int) -> None:
        barrier.wait()
        results[i] = ledgers[i].claim(LINEAGE, Version(3, 0), Version(4, 10 + i)).ok

    for _ in range(5):  # several rounds: the race is etcd's to decide each time
        start_line_now(first, LINEAGE, Version(3, 0))
        threads = [threading.Thread(target=claim, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        record = first.read()[0]
        assert record is not None
        # Both may succeed only one after the other, the second voiding the first (its claim
        # from the same place found the first's unapplied): then exactly one is not void.
        winners = [Version(4, 10 + i) for i in (0, 1) if results[i]]
        assert winners, "neither claim got through"
        standing = [w for w in winners if w not in record.void]
        assert standing == [record.head], (winners, record)


def test_a_claim_goes_on_when_the_member_it_talks_to_dies(members: list[EtcdMember]) -> None:
    """A follower it talks to first dies: the next claim goes to another member at once."""
    follower = next(m for m in members if m is not leader(members))
    ledger = book([follower, *(m for m in members if m is not follower)])
    ledger.start(LINEAGE, Version(0, 0))
    assert ledger.claim(LINEAGE, Version(0, 0), Version(1, 1)).ok
    follower.kill()
    began = time.monotonic()
    assert ledger.claim(LINEAGE, Version(1, 1), Version(2, 1)).ok
    assert time.monotonic() - began < 5
    assert ledger.check_commit(LINEAGE, Version(1, 1)) is None


def test_a_claim_rides_out_the_leaders_loss(members: list[EtcdMember]) -> None:
    ledger = book(members)
    ledger.start(LINEAGE, Version(0, 0))
    leader(members).kill()
    deadline = time.monotonic() + 20
    while not (claim := ledger.claim(LINEAGE, Version(0, 0), Version(1, 1))).ok:
        assert time.monotonic() < deadline, claim.why  # refused while the election runs, never wrong
        assert claim.found is None or on_line(claim.found, LINEAGE, Version(0, 0))
        time.sleep(0.2)


def test_what_a_claim_costs(members: list[EtcdMember]) -> None:
    """A quorum read and a compare-and-swap (a Raft round with an fsync) per step, on loopback
    here: printed, and bounded loosely (it runs on participant 0's claim thread, overlapped
    with the step's forward and backward)."""
    ledger = book(members)
    ledger.start(LINEAGE, Version(0, 0))
    took = []
    for step in range(40):
        began = time.perf_counter()
        assert ledger.claim(LINEAGE, Version(step, 1 if step else 0), Version(step + 1, 1)).ok
        took.append(time.perf_counter() - began)
    ms = sorted(1000 * t for t in took)
    print(f"\nclaim: median {statistics.median(ms):.1f} ms, p90 {ms[int(0.9 * len(ms))]:.1f} ms, max {ms[-1]:.1f} ms")
    assert statistics.median(ms) < 500
