"""The Lighthouse's seat (``elastic_train.quorum.seat``) against a real three-member etcd: one
holder at a time, every agent knows it, a holder that stops refreshing (or is frozen) is fenced
before another takes the seat, and the loss of the etcd member the holder talks to costs
nothing. Needs Debian's etcd-server; skips without it, unless ELASTIC_TRAIN_REQUIRE_ETCD=1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from elastic_train.etcd_member import split_endpoint
from elastic_train.quorum.seat import Seat, SeatConfig, now
from elastic_train.testing.etcd import EtcdMember, etcd_cluster, leader, require_etcd
from elastic_train.testing.processes import ROOT, base_env, kill_group

pytestmark = pytest.mark.timeout(120)
TTL = 3
DEFAULT_TTL = SeatConfig.ttl_s  # what must ride out an etcd leader election (~1-2 s here)


@pytest.fixture(autouse=True)
def etcd_here() -> None:
    require_etcd()


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[EtcdMember]]:
    with etcd_cluster(tmp_path) as cluster:
        yield cluster


def config(members: list[EtcdMember], name: str, job: str = "seat-test", ttl: int = TTL) -> SeatConfig:
    return SeatConfig(tuple(m.client for m in members), job, f"http://127.0.0.1:{name}", ttl_s=ttl)


@contextmanager
def seats(members: list[EtcdMember], *names: str, ttl: int = TTL) -> Iterator[list[Seat]]:
    started = [Seat(config(members, name, ttl=ttl)) for name in names]
    for seat in started:
        seat.start()
    try:
        yield started
    finally:
        for seat in started:
            seat.stop(release=True)


def until(what: str, condition: Callable[[], bool], timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)
    return now()


def test_one_agent_holds_the_seat_and_every_agent_knows_which(members: list[EtcdMember]) -> None:
    with seats(members, "1001", "1002", "1003") as started:
        until("a holder known to all", lambda: all(s.holder() is not None for s in started))
        holders = [s for s in started if s.mine()]
        assert len(holders) == 1, [s.config.address for s in holders]
        assert {s.holder() for s in started} == {holders[0].holder()}
        assert holders[0].holder().address == holders[0].config.address  # type: ignore[union-attr]


def test_a_holder_that_stops_refreshing_is_fenced_before_another_takes_the_seat(members: list[EtcdMember]) -> None:
    with seats(members, "1001", "1002") as (a, b):
        until("a holder", lambda: a.holder() is not None and b.holder() is not None)
        old, new = (a, b) if a.mine() else (b, a)
        term = old.holder().term  # type: ignore[union-attr]
        old.stop(release=False)  # as its host dying: no refresh, no release
        deadline = old.lease_end()
        while not new.mine():
            assert not old.mine() or not new.mine(), "two agents held the seat at once"
            assert now() < deadline + TTL + 5, "the other agent never took the seat"
            time.sleep(0.005)
        # The old holder's Lighthouse is dead by its deadline; the new one's create was sent after it.
        assert new.taken_at is not None and deadline < new.taken_at, (deadline, new.taken_at)
        assert new.holder().term > term  # type: ignore[union-attr]
        moved = new.taken_at - deadline
        print(f"\nthe seat was taken {moved:.2f} s after the old holder's fence (TTL {TTL} s, margin 1 s)")
        assert moved < 3.0


def test_a_released_seat_is_taken_at_the_next_read(members: list[EtcdMember]) -> None:
    with seats(members, "1001", "1002") as (a, b):
        until("a holder", lambda: a.holder() is not None and b.holder() is not None)
        old, new = (a, b) if a.mine() else (b, a)
        released = now()
        old.stop(release=True)
        taken = until("the other holder", new.mine, timeout=TTL)
        # Well before the TTL's expiry could hand it over (TTL s after the last refresh, plus etcd's tick).
        assert taken - released < 2.0, taken - released


def test_an_agent_that_abdicates_leaves_the_seat_for_good(members: list[EtcdMember]) -> None:
    with seats(members, "1001", "1002") as (a, b):
        until("a holder", lambda: a.holder() is not None and b.holder() is not None)
        old, new = (a, b) if a.mine() else (b, a)
        old.abdicate()
        assert not old.mine()
        until("the other holder", new.mine, timeout=TTL)
        new.stop(release=True)
        deadline = time.monotonic() + TTL
        while time.monotonic() < deadline:
            assert not old.mine(), "an agent that gave the seat up took it again"
            time.sleep(0.01)
        assert old.holder() is None


def test_etcd_refuses_a_late_copy_of_the_holders_earlier_refresh(members: list[EtcdMember]) -> None:
    """A copy of an earlier refresh that a member applies late must not move the key's expiry
    (etcd counts it from when that member parsed the copy, before the holder's later send): the
    holder's refreshes compare the key's index, so a copy of an earlier one fails its compare."""
    import etcd

    seat = Seat(config(members, "1001"))
    sent: list[Callable[[Any], Any]] = []
    gate = threading.Event()  # the holder's fourth refresh waits for it: nothing else writes the key
    keep_sending = seat._members.keep_sending

    def recorded(request: Callable[[Any], Any], *args: Any, **kwargs: Any) -> Any:
        sent.append(request)
        if len(sent) == 4:
            assert gate.wait(10)
        return keep_sending(request, *args, **kwargs)

    seat._members.keep_sending = recorded  # type: ignore[method-assign]
    seat.start()
    try:
        until("three refreshes done", lambda: seat.mine() and len(sent) >= 4)
        host, port = split_endpoint(members[1].client, "etcd member")
        client = etcd.Client(host=host, port=port)
        before = client.read(seat.config.key, quorum=True)
        with pytest.raises(etcd.EtcdCompareFailed):
            sent[0](client)  # the first refresh, again: a copy that reached etcd two refreshes late
        after = client.read(seat.config.key, quorum=True)
        assert (after.modifiedIndex, after.expiration) == (before.modifiedIndex, before.expiration)
        gate.set()
        until("the holder's next refresh", lambda: len(sent) >= 6)
        assert seat.mine(), "a refused copy cost the holder its seat"
    finally:
        gate.set()
        seat.stop(release=True)


@pytest.mark.parametrize(
    ("fault", "which"), [("kill", "first"), ("freeze", "first"), ("kill", "leader"), ("freeze", "leader")]
)
def test_the_seat_survives_the_loss_of_one_etcd_member(members: list[EtcdMember], fault: str, which: str) -> None:
    # Every agent lists member 0 first: its creates and deletes go there until it fails (its
    # refreshes and reads go to every member). Frozen, it answers nothing and closes nothing:
    # each request to it waits out the read timeout. The leader's loss also stops every write
    # and quorum read until the others elect a new one, which the holder must ride out.
    with seats(members, "1001", "1002", ttl=DEFAULT_TTL) as (a, b):
        until("a holder", lambda: a.holder() is not None and b.holder() is not None)
        holder = a.holder()
        victim = members[0] if which == "first" else leader(members)
        victim.kill() if fault == "kill" else victim.freeze()
        deadline = time.monotonic() + 3 * DEFAULT_TTL
        while time.monotonic() < deadline:
            assert a.holder() == holder or b.holder() == holder, "the seat moved although its holder lived"
            assert a.mine() or b.mine(), "the holder lost its seat to the loss of one etcd member"
            assert not (a.mine() and b.mine()), "two agents held the seat at once"
            time.sleep(0.02)
        kept = a if a.mine() else b
        print(f"\nthe holder's least lease left at a refresh: {kept.least_left_s:.2f} s (fence {DEFAULT_TTL - 1} s)")


# A holder in a process of its own, frozen with SIGSTOP: its first look at the clock after the
# thaw must find the seat lost (CLOCK_BOOTTIME counts while it is stopped).
HOLDER = """
import json, sys, time
from elastic_train.quorum.seat import Seat, SeatConfig
seat = Seat(SeatConfig(tuple(sys.argv[1].split(",")), "seat-test", "http://127.0.0.1:1009", ttl_s=int(sys.argv[2])))
seat.start()
while True:
    print(json.dumps({"mine": seat.mine(), "wall": time.time()}), flush=True)
    time.sleep(0.01)
"""


def test_a_frozen_holder_finds_its_seat_lost_when_it_thaws(members: list[EtcdMember], tmp_path: Path) -> None:
    out = tmp_path / "holder.out"
    endpoints = ",".join(m.client for m in members)
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, endpoints, str(TTL)], env=base_env(), cwd=ROOT, stdout=sink,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]

    try:
        until("the child holding the seat", lambda: any(r["mine"] for r in lines()), timeout=60)
        with seats(members, "1002") as (other,):
            proc.send_signal(signal.SIGSTOP)
            until("the other agent holding the seat", other.mine, timeout=TTL + 5)
            assert other.holder().address.endswith(":1002")  # type: ignore[union-attr]
            thawed = time.time()  # every line stamped later was written after the thaw
            proc.send_signal(signal.SIGCONT)
            until("the thawed holder's first look", lambda: lines()[-1]["wall"] > thawed + 0.5, timeout=10)
            after = [r for r in lines() if r["wall"] > thawed]
            assert after and not any(r["mine"] for r in after), after[:3]
    finally:
        kill_group(proc)
        proc.wait()
