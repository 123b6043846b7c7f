"""The Lighthouse relay (``quorum.forward``), the seat's settings and the agent's flags for it."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_train.etcd_member import EtcdError
from elastic_train.quorum.forward import Forwarder, Route
from elastic_train.quorum.launch import parse
from elastic_train.quorum.seat import Members, Seat, SeatConfig, now
from elastic_train.quorum.term import SHIFT, TermedClient, read_term, write_term

pytestmark = pytest.mark.timeout(60)


@contextmanager
def echo_server(tag: bytes) -> Iterator[tuple[str, list[socket.socket]]]:
    """A server that answers every chunk with ``tag + chunk``; yields its URL and its connections."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(tag + data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.close()


def ask(relay: Forwarder, payload: bytes) -> tuple[socket.socket, bytes]:
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    conn.sendall(payload)
    return conn, conn.recv(4096)


def test_the_relay_passes_bytes_both_ways_to_its_target() -> None:
    with echo_server(b"a:") as (url, _), Forwarder() as relay:
        relay.retarget(Route(url))
        conn, reply = ask(relay, b"hello")
        assert reply == b"a:hello"
        conn.sendall(b"again")
        assert conn.recv(4096) == b"a:again"
        conn.close()


def test_a_new_target_closes_the_relayed_connections_and_takes_the_next_ones() -> None:
    with echo_server(b"a:") as (first, _), echo_server(b"b:") as (second, _), Forwarder() as relay:
        relay.retarget(Route(first))
        old, reply = ask(relay, b"x")
        assert reply == b"a:x"
        relay.retarget(Route(second))
        old.settimeout(5)
        assert old.recv(4096) == b"", "a connection to the old Lighthouse stayed open"
        new, reply = ask(relay, b"y")
        assert reply == b"b:y"
        old.close()
        new.close()


def test_without_a_target_a_connection_is_closed_at_once() -> None:
    with Forwarder() as relay:
        started = time.monotonic()
        conn = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        assert conn.recv(4096) == b""
        assert time.monotonic() - started < 2
        conn.close()


def test_the_lighthouse_closing_its_side_closes_the_workers_side() -> None:
    with echo_server(b"a:") as (url, accepted), Forwarder() as relay:
        relay.retarget(Route(url))
        conn, _ = ask(relay, b"x")
        accepted[0].shutdown(socket.SHUT_RDWR)
        conn.settimeout(5)
        assert conn.recv(4096) == b""
        conn.close()


def test_a_bad_target_is_refused() -> None:
    with pytest.raises(ValueError, match="not http://HOST:PORT"):
        Route("lighthouse")


@given(ttl=st.integers(-3, 30), margin=st.floats(-1, 40), refresh=st.floats(0.01, 5), read=st.floats(0.01, 5))
def test_seat_settings_are_accepted_only_when_a_refresh_fits_before_the_fence(
    ttl: int, margin: float, refresh: float, read: float
) -> None:
    fits = ttl >= 2 and 0 < margin < ttl and refresh + read <= ttl - margin
    try:
        SeatConfig(("h:2379",), "job", "http://h:29510", ttl, refresh, margin, read)
    except ValueError:
        assert not fits
    else:
        assert fits


@pytest.mark.parametrize(
    ("endpoints", "job", "problem"),
    [((), "j", "is empty"), (("h",), "j", "not HOST:PORT"), (("h:1",), "", "job id"), (("h:1",), "a/b", "job id")],
)
def test_seat_settings_name_what_is_wrong(endpoints: tuple[str, ...], job: str, problem: str) -> None:
    with pytest.raises((ValueError, EtcdError), match=problem):
        SeatConfig(endpoints, job, "http://h:1")


def test_the_agent_refuses_a_lighthouse_and_a_seat_together(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--lighthouse", "http://h:1", "--lighthouse-etcd", "h:2379", "--run-id", "r", "-m", "elastic_train"])
    assert "exclude each other" in capsys.readouterr().err


def test_a_seat_needs_the_jobs_id(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit):
        parse(["--lighthouse-etcd", "h:2379", "-m", "elastic_train"])
    assert "--run-id" in capsys.readouterr().err


def test_with_a_seat_any_node_may_start_without_a_lighthouse_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TRAIN_QUORUM_SECRET", "s" * 32)
    args, trainer = parse(
        ["--nnodes", "2", "--node-rank", "1", "--lighthouse-etcd", "h:2379", "--run-id", "r", "-m", "elastic_train"]
    )
    assert args.lighthouse is None and args.lighthouse_etcd == "h:2379" and trainer == []


class FakeClient:
    """An etcd client whose answers the test scripts: ``down`` raises a connection failure."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.down = False
        self.calls = 0
        self.in_refresh = threading.Event()
        self.release_refresh = threading.Event()
        self.hold_refresh = False

    def _check(self) -> None:
        import etcd

        self.calls += 1
        if self.down:
            raise etcd.EtcdConnectionFailed(f"{self.name} is down")

    def write(self, key: str, value: str, ttl: int, prevExist: bool) -> Any:
        self._check()
        return SimpleNamespace(createdIndex=7, modifiedIndex=7)

    def refresh(self, key: str, ttl: int, prevIndex: int) -> Any:
        self._check()
        if self.hold_refresh:
            self.in_refresh.set()
            self.release_refresh.wait(5)
        return SimpleNamespace(modifiedIndex=prevIndex + 1)

    def delete(self, key: str, prevIndex: int) -> Any:
        self._check()
        return SimpleNamespace()

    def read(self, key: str, quorum: bool) -> Any:
        import etcd

        self._check()
        raise etcd.EtcdKeyNotFound("deleted")  # as abdicate left it

    def name_of(self) -> str:
        self._check()
        return self.name


def fake_members(*clients: FakeClient) -> Members:
    members = Members.__new__(Members)
    members.clients = list(clients)
    members.current = 0
    members.read_timeout_s = 1.0
    return members


def test_members_move_on_from_a_member_that_is_down_and_come_back_to_it() -> None:
    a, b = FakeClient("a"), FakeClient("b")
    members = fake_members(a, b)
    a.down = True
    assert members.call(FakeClient.name_of) == "b"
    b.down, a.down = True, False
    assert members.call(FakeClient.name_of) == "a"  # not stuck: python-etcd's own list would be empty here
    a.down = True
    with pytest.raises(Exception, match="is down"):
        members.call(FakeClient.name_of)
    a.down = b.down = False
    assert members.call(FakeClient.name_of) in ("a", "b")


def test_a_hedged_request_takes_the_first_answer_and_fails_only_when_no_member_answers() -> None:
    import etcd

    a, b, c = FakeClient("a"), FakeClient("b"), FakeClient("c")
    members = fake_members(a, b, c)
    a.hold_refresh = True  # a frozen member: it holds the request until its read timeout
    began = time.monotonic()
    assert members.hedged(lambda client: (client.refresh("k", 3, 7), client.name)[1]) in ("b", "c")
    assert time.monotonic() - began < 1.0, "the answer waited for the frozen member"
    a.release_refresh.set()
    b.down = c.down = True
    a.hold_refresh = False
    assert members.hedged(FakeClient.name_of) == "a"  # one member is enough
    a.down = True
    with pytest.raises(etcd.EtcdConnectionFailed, match="is down"):
        members.hedged(FakeClient.name_of)
    a.down = False

    def without_a_leader(client: FakeClient) -> str:  # etcd's reply while its members elect one
        if client.name != "c":
            raise etcd.EtcdLeaderElectionInProgress("no leader")
        time.sleep(0.05)
        return client.name

    assert members.hedged(without_a_leader) == "c", "a member without a leader was taken for an answer"
    c.name = "also without"
    with pytest.raises(etcd.EtcdLeaderElectionInProgress):
        members.hedged(without_a_leader)
    release = threading.Event()

    def one_answers(client: FakeClient) -> Any:  # the others are frozen
        if client is not a:
            release.wait(5)
        return client.read("k", quorum=True)

    began = time.monotonic()
    with pytest.raises(etcd.EtcdKeyNotFound):  # etcd's answer about the key: raised, not waited on
        members.hedged(one_answers)
    release.set()
    assert time.monotonic() - began < 1.0, "etcd's answer about the key waited for the frozen members"


def test_a_refresh_sent_again_while_none_is_answered_goes_through_soon_after_an_election_ends() -> None:
    """A send made during the election waits out its read timeout (``held`` here); one sent
    every ``every_s`` reaches the new leader within ``every_s`` of the election's end."""
    import etcd

    held = 2.0  # generous: the bound below must hold on a loaded 2-core host too

    elected = threading.Event()
    frozen = threading.Event()  # never set: the old leader

    def refresh(client: FakeClient) -> str:
        if client.name == "leader":
            frozen.wait(2)
            raise etcd.EtcdConnectionFailed("read timed out")
        if not elected.is_set():  # no leader: the request is held until the client gives up
            time.sleep(held)
            raise etcd.EtcdConnectionFailed("read timed out")
        return client.name

    members = fake_members(FakeClient("leader"), FakeClient("b"), FakeClient("c"))
    began = time.monotonic()
    threading.Timer(0.2, elected.set).start()
    sent, answer = members.keep_sending(refresh, time.monotonic, lambda: time.monotonic() > began + 5, every_s=0.05)
    took = time.monotonic() - began
    # (> 0.1, not >= 0.2: a send stamped just before the election's end may reach its member after it)
    assert answer in ("b", "c") and sent > began + 0.1, "the first send's time, not the answered one's"
    assert took < held - 0.5, f"{took:.2f} s: the first send after the election waited for the earlier ones"
    # Nothing answers before give_up: an error, the last member's when one came back by then.
    elected.clear()
    until = time.monotonic() + 0.3
    with pytest.raises((etcd.EtcdConnectionFailed, TimeoutError)):
        members.keep_sending(refresh, time.monotonic, lambda: time.monotonic() > until, every_s=0.05)
    # etcd's answer about the key: raised at once, not waited on.
    with pytest.raises(etcd.EtcdKeyNotFound):
        members.keep_sending(
            lambda client: client.read("k", quorum=True) if client.name == "b" else refresh(client),
            time.monotonic,
            lambda: False,
            every_s=0.05,
        )
    frozen.set()


class ScriptedSends:
    """Members whose refreshes are answered as scripted, on the test's clock: (sent at, answered
    at), or None for no answer before the seat gives up."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.script: list[tuple[float, float] | None] = []
        self.deletes: list[float] = []

    def call(self, request: Any) -> Any:  # the create and the delete
        return request(self)

    def write(self, key: str, value: str, ttl: int, prevExist: bool) -> Any:
        return SimpleNamespace(createdIndex=7, modifiedIndex=7)

    def delete(self, key: str, prevIndex: int) -> Any:
        self.deletes.append(self.clock[0])

    def keep_sending(self, request: Any, clock: Any, give_up: Any, every_s: float) -> tuple[float, Any]:
        import etcd

        step = self.script.pop(0)
        if step is None:
            while not give_up():
                self.clock[0] += every_s
            raise etcd.EtcdConnectionFailed("no leader")
        self.clock[0] = step[1]
        return step[0], SimpleNamespace(modifiedIndex=8)


def test_a_refresh_holds_the_seat_from_its_answered_send_and_never_past_the_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("elastic_train.quorum.seat.now", lambda: clock[0])
    members = ScriptedSends(clock)
    seat = Seat(SeatConfig(("a:1",), "job", "http://h:1", ttl_s=5), members)
    seat.tick()
    assert seat.mine() and seat.lease_end() == 104.0  # ttl 5 - margin 1 after the create was sent
    # An election: the send that went through left at 102.5 and was answered at 103.5.
    members.script.append((102.5, 103.5))
    clock[0] = 100.5
    seat.tick()
    assert seat.mine() and seat.lease_end() == 106.5 and seat.least_left_s == 0.5
    # A reply that comes back after the fence does not give the seat back: the agent has killed
    # its Lighthouse by then. The key is deleted, for the next holder to create with a new term.
    members.script.append((106.0, 107.0))
    clock[0] = 106.0
    seat.tick()
    assert not seat.mine() and members.deletes == [107.0]
    # Nothing answered: the sends stop at the fence, and the seat is gone.
    seat = Seat(SeatConfig(("a:1",), "job", "http://h:1", ttl_s=5), members)
    clock[0] = 200.0
    seat.tick()
    members.script.append(None)
    clock[0] = 202.0
    seat.tick()
    assert not seat.mine() and clock[0] == 204.0


class V2Key:
    """etcd v2's rules for the seat's key, on the test's clock (measured on etcd 3.4's v2 API,
    and read in its ``parseKeyRequest``): a TTL counts from when the member that received the
    request parsed it, not from when etcd applied it; a compare is on the index or the value;
    every applied write moves the index; the key is gone once its expiry has passed (etcd
    sweeps every 0.5 s: stricter here)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.index = 6
        self.node: SimpleNamespace | None = None
        self.lock = threading.Lock()

    def live(self) -> SimpleNamespace | None:
        if self.node is not None and self.clock() >= self.node.expiry:
            self.node = None
        return self.node

    def apply(self, op: str, parsed: float, **args: Any) -> Any:
        with self.lock:
            return self._apply(op, parsed, **args)

    def _apply(self, op: str, parsed: float, **args: Any) -> Any:
        import etcd

        node = self.live()
        if op == "read":
            if node is None:
                raise etcd.EtcdKeyNotFound("no key")
            return SimpleNamespace(**vars(node), ttl=math.ceil(node.expiry - self.clock()))
        if op == "write":  # a create: prevExist=False
            if node is not None:
                raise etcd.EtcdAlreadyExist("taken")
            self.index += 1
            self.node = SimpleNamespace(
                value=args["value"], createdIndex=self.index, modifiedIndex=self.index, expiry=parsed + args["ttl"]
            )
            return SimpleNamespace(**vars(self.node))
        if node is None:
            raise etcd.EtcdKeyNotFound("no key")
        if "prevIndex" in args and node.modifiedIndex != args["prevIndex"]:
            raise etcd.EtcdCompareFailed(f"{args['prevIndex']} != {node.modifiedIndex}")
        if "prevValue" in args and node.value != args["prevValue"]:
            raise etcd.EtcdCompareFailed("value")
        self.index += 1
        if op == "delete":
            self.node = None
            return SimpleNamespace(modifiedIndex=self.index)
        node.modifiedIndex, node.expiry = self.index, parsed + args["ttl"]  # a refresh
        return SimpleNamespace(**vars(node))


class V2Member:
    """One member of the etcd holding ``V2Key``. While ``holding``, a request is parsed but not
    applied (a member that stalled between parsing it and proposing it): the client times out,
    and the copy waits in ``late`` until the test applies it. ``before_apply`` and
    ``before_reply``: events it waits for (real time, threaded tests) before it applies a
    request and before it answers; ``applied`` and ``answered`` are set after it did."""

    def __init__(self, key: V2Key) -> None:
        self.key = key
        self.holding = False
        self.late: list[Callable[[], Any]] = []
        self.before_apply: threading.Event | None = None
        self.before_reply: threading.Event | None = None
        self.applied, self.answered = threading.Event(), threading.Event()
        self.ops: list[str] = []  # what it was asked, in order

    def _do(self, op: str, **args: Any) -> Any:
        import etcd

        self.ops.append(op)
        parsed = self.key.clock()
        if self.holding:
            self.late.append(lambda: self.key.apply(op, parsed, **args))
            raise etcd.EtcdConnectionFailed("read timed out")
        if self.before_apply is not None:
            assert self.before_apply.wait(5)
        try:
            return self.key.apply(op, parsed, **args)
        finally:
            self.applied.set()
            if self.before_reply is not None:
                assert self.before_reply.wait(5)
            self.answered.set()

    def write(self, key: str, value: str, ttl: int, prevExist: bool) -> Any:
        return self._do("write", value=value, ttl=ttl)

    def refresh(self, key: str, ttl: int, **compare: Any) -> Any:
        return self._do("refresh", ttl=ttl, **compare)

    def delete(self, key: str, **compare: Any) -> Any:
        return self._do("delete", **compare)

    def read(self, key: str, quorum: bool) -> Any:
        return self._do("read")


Step = Callable[[Any], tuple[float, Any]] | None


class ScriptedRefreshes(Members):
    """Real creates and deletes on ``V2Member``s; each call that keeps sending (a refresh, the
    read that settles one) runs the test's next step, which sends the seat's request where and
    when the test says; with no step left, or a None step, the last member answers at once."""

    def __init__(self, *clients: V2Member) -> None:
        self.clients, self.current, self.read_timeout_s = list(clients), 0, 1.0
        self.steps: list[Step] = []

    def keep_sending(self, request: Any, clock: Any, give_up: Any, every_s: float) -> tuple[float, Any]:
        step = self.steps.pop(0) if self.steps else None
        if step is None:
            return clock(), request(self.clients[-1])
        return step(request)


def sent_to(member: V2Member, request: Any) -> Any:
    """The reply to ``request`` at ``member``, or the error it raised."""
    try:
        return request(member)
    except Exception as exc:
        return exc


def heal(member: V2Member) -> None:
    """The member goes on: etcd applies each copy it held, or refuses it (an answer nobody waits
    for any more)."""
    held, member.late = member.late, []
    for copy in held:
        with contextlib.suppress(Exception):
            copy()


def unanswered(request: Any) -> tuple[float, Any]:
    """No member answers before the seat gives up."""
    import etcd

    raise etcd.EtcdConnectionFailed("no leader")


def seat_on_v2(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[float], V2Key, V2Member, V2Member, ScriptedRefreshes, Seat]:
    clock = [100.0]
    monkeypatch.setattr("elastic_train.quorum.seat.now", lambda: clock[0])
    key = V2Key(lambda: clock[0])
    late, live = V2Member(key), V2Member(key)
    members = ScriptedRefreshes(late, live)
    seat = Seat(SeatConfig(("a:1", "b:1"), "job", "http://h:1", ttl_s=5, margin_s=1.0), members)
    seat.tick()  # the create, sent at 100: the key expires at 105, the fence is at 104
    assert seat.mine() and key.live() is not None and seat.lease_end() == 104.0
    return clock, key, late, live, members, seat


def fenced_in_time(key: V2Key, seat: Seat) -> None:
    """The holder's Lighthouse is dead (its fence) at least ``margin_s`` before etcd ends the key."""
    node = key.live()
    assert node is not None, "the key expired while the holder counted the seat as its own"
    assert node.expiry - seat.lease_end() >= seat.config.margin_s, (
        f"the key expires at {node.expiry}, the holder's Lighthouse serves until {seat.lease_end()}"
    )


def test_a_late_copy_of_an_earlier_refresh_cannot_end_the_key_before_the_holders_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that parsed a refresh and applied it only after a later send was answered would
    set an expiry earlier than the one the holder counts from: with a compare on the value, the
    key expired a second before the holder's fence (two Lighthouses for that second)."""
    clock, key, late, live, members, seat = seat_on_v2(monkeypatch)

    def election(request: Any) -> tuple[float, Any]:
        late.holding = True
        assert isinstance(sent_to(late, request), Exception)  # parsed at 100.5, held
        clock[0] = 102.5
        made = sent_to(live, request)  # parsed and applied at 102.5: expires at 107.5
        clock[0] = 103.5
        return 102.5, made

    members.steps.append(election)
    clock[0] = 100.5
    seat.tick()
    assert seat.mine() and seat.lease_end() == 106.5
    clock[0] = 103.6
    heal(late)
    fenced_in_time(key, seat)


def reply_lost(
    clock: list[float], late: V2Member, live: V2Member, parsed: float, applied: float, failed: float
) -> Step:
    """A send parsed at ``parsed`` is applied at ``applied`` and its reply lost; the next send,
    at ``failed``, fails its compare: the first answer to come back."""

    def step(request: Any) -> tuple[float, Any]:
        late.holding = True
        clock[0] = parsed
        sent_to(late, request)
        clock[0] = applied
        late.late.pop()()
        late.holding = False
        clock[0] = failed
        answer = sent_to(live, request)
        assert type(answer).__name__ == "EtcdCompareFailed", answer
        raise answer

    return step


def test_when_a_compare_failure_comes_back_first_the_lease_counts_from_the_first_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send was applied but its reply was lost; a later send fails its compare. The seat
    reads the key: still its own, so one of its sends set the expiry, none before the first.
    It then refreshes again at once, comparing the index it read."""
    clock, key, late, live, members, seat = seat_on_v2(monkeypatch)
    # The refresh, the read that settles it, and the refresh sent at once after: unanswered.
    members.steps += [reply_lost(clock, late, live, 100.5, 101.0, 101.2), None, unanswered]
    clock[0] = 100.5
    seat.tick()
    assert seat.mine(), "a compare failure on its own moved key cost the holder its seat"
    assert seat.lease_end() == 104.5, "not counted from the first send"
    fenced_in_time(key, seat)
    # Settled twice in a row (the second refresh's reply lost too), at two indices: each counts
    # from the first send that compared its own index.
    members.steps += [
        reply_lost(clock, late, live, 101.5, 101.6, 101.7),
        None,
        reply_lost(clock, late, live, 101.7, 101.9, 102.0),  # sent as the first settle ends
        None,
        unanswered,
    ]
    clock[0] = 101.5
    seat.tick()
    assert seat.lease_end() == 105.7, "the second settle counted from the first one's send"
    fenced_in_time(key, seat)
    # The next refresh compares the index the read found, and is answered.
    clock[0] = 102.5
    seat.tick()
    assert seat.lease_end() == 106.5 and key.live() is not None


def test_a_settle_read_that_fails_keeps_the_first_send_for_the_next_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read that would settle a compare failure is not answered; the next round's refresh
    fails its compare at once and its read is answered: the lease still counts from the first
    round's first send, the earliest any copy comparing that index left."""
    clock, key, late, live, members, seat = seat_on_v2(monkeypatch)
    members.steps += [reply_lost(clock, late, live, 100.5, 100.6, 100.7), unanswered]
    clock[0] = 100.5
    seat.tick()
    assert seat.mine() and seat.lease_end() == 104.0  # not settled: the create's lease runs on
    members.steps += [None, None, unanswered]  # the refresh fails its compare; the read answers
    clock[0] = 102.0
    seat.tick()
    assert seat.lease_end() == 104.5, "counted from the second round's send, after the applied copy"
    fenced_in_time(key, seat)


@pytest.mark.parametrize("moved", ["another agent's value", "a new term of this agent's"])
def test_a_compare_failure_on_a_key_that_is_not_this_terms_loses_the_seat(
    moved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, key, _, _, _, seat = seat_on_v2(monkeypatch)
    node = key.live()
    assert node is not None
    key.index += 1
    value = "another" if moved == "another agent's value" else node.value  # the same agent, created anew
    key.node = SimpleNamespace(value=value, createdIndex=key.index, modifiedIndex=key.index, expiry=200.0)
    clock[0] = 100.5
    seat.tick()
    assert not seat.mine()


def test_a_late_copy_of_a_delete_cannot_delete_the_agents_next_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's key has the same value in every term: a delete that compared the value and
    was applied late would delete a key created after it, while its Lighthouse serves."""
    clock, key, late, _, _, seat = seat_on_v2(monkeypatch)
    late.holding = True
    clock[0] = 100.2
    seat.resign()  # sent to the member that holds it, then to the next, which deletes the key
    assert key.live() is None and len(late.late) == 1
    late.holding = False
    clock[0] = 105.2  # after the TTL it may take the seat again
    seat.tick()
    assert seat.mine()
    clock[0] = 105.5
    heal(late)  # the held copy of the delete reaches etcd
    assert key.live() is not None, "a copy of an old delete deleted the key of the seat's new term"


def test_a_release_after_a_refresh_whose_reply_was_not_awaited_still_deletes_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent stops while a refresh is out: etcd applied it, the agent never saw its reply,
    so its delete compares an old index. It reads the key, its own of the same term, and deletes
    it at the index read: the next agent need not wait for the TTL."""
    _, key, _, live, _, seat = seat_on_v2(monkeypatch)
    node = key.live()
    assert node is not None
    sent_to(live, lambda c: c.refresh("k", ttl=5, prevIndex=node.modifiedIndex))  # its reply not awaited
    seat.abdicate()
    assert key.live() is None, "the release left the key to its TTL"


def test_a_compare_failure_answered_before_the_applied_sends_reply_is_settled_by_a_read() -> None:
    """With the real resends: one member applies the refresh and its reply is slow; the other
    fails its compare and answers first. A read settles it, and the seat is kept; the refresh
    that follows at once compares the index read."""
    key = V2Key(now)
    slow, quick = V2Member(key), V2Member(key)
    members = fake_members(slow, quick)  # type: ignore[arg-type]
    seat = Seat(SeatConfig(("a:1", "b:1"), "job", "http://h:1", ttl_s=5, margin_s=1.0), members)
    seat.tick()
    assert seat.mine()
    quick.before_apply = slow.applied  # the slow member applies its copy first ...
    slow.before_reply = quick.answered  # ... and answers after the quick one's compare failure
    seat.tick()
    quick.before_apply = slow.before_reply = None
    assert seat.mine(), "the compare failure cost the seat"
    assert "read" in quick.ops + slow.ops, "not settled by a read"
    node = key.live()
    assert node is not None and seat._index == node.modifiedIndex
    assert node.expiry - seat.lease_end() >= seat.config.margin_s


def test_the_seat_thread_outlives_a_round_that_raises() -> None:
    client = FakeClient("a")
    failures = [RuntimeError("a bug in a round")]
    write = client.write

    def first_write_raises(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return write(*args, **kwargs)

    client.write = first_write_raises  # type: ignore[method-assign]
    seat = Seat(SeatConfig(("a:1",), "job", "http://h:1", ttl_s=3), fake_members(client))
    seat.start()
    try:
        deadline = time.monotonic() + 5
        while not seat.mine():
            assert time.monotonic() < deadline, "the seat thread died with its round"
            time.sleep(0.02)
        assert not failures
    finally:
        seat.stop()


def test_a_refresh_in_flight_does_not_give_back_a_seat_given_up_meanwhile() -> None:
    client = FakeClient("a")
    seat = Seat(SeatConfig(("a:1",), "job", "http://h:1", ttl_s=3), fake_members(client))
    seat.tick()  # creates the key: the seat is this agent's
    assert seat.mine()
    client.hold_refresh = True
    refreshing = threading.Thread(target=seat.tick)
    refreshing.start()  # a refresh is on its way ...
    assert client.in_refresh.wait(5)
    seat.abdicate()  # ... when the agent gives the seat up (its Lighthouse cannot start)
    client.release_refresh.set()
    refreshing.join(5)
    assert not seat.mine(), "the refresh's reply gave the seat back to an agent that gave it up"
    seat.tick()
    assert not seat.mine(), "an agent that gave the seat up took it again"


def test_an_agent_that_deleted_its_live_key_takes_the_seat_again_only_after_the_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Other agents may still relay to this agent's address under the old term for up to the
    TTL: a Lighthouse of a new term there before that would get two quorum ids per quorum."""
    clock = [100.0]
    monkeypatch.setattr("elastic_train.quorum.seat.now", lambda: clock[0])
    client = FakeClient("a")
    writes: list[float] = []
    write = client.write
    client.write = lambda *a, **k: (writes.append(clock[0]), write(*a, **k))[1]  # type: ignore[method-assign]
    seat = Seat(SeatConfig(("a:1",), "job", "http://h:1", ttl_s=3), fake_members(client))
    seat.tick()
    assert seat.mine() and writes == [100.0]
    seat.resign()  # its Lighthouse died while the seat was held
    assert not seat.mine()
    for t in (100.0, 101.0, 102.9):
        clock[0] = t
        seat.tick()
        assert not seat.mine() and writes == [100.0], f"took the seat back {t - 100:.1f} s after giving it up"
    clock[0] = 103.0
    seat.tick()
    assert seat.mine() and writes == [100.0, 103.0]


@pytest.mark.parametrize("address", ["lighthouse", "http://h", "http://h:1"])
def test_a_key_that_names_no_http_host_and_port_leaves_no_holder(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay would have nowhere to lead: the read is ignored, with a message, not a crash."""
    import json

    client = FakeClient("a")
    record = SimpleNamespace(value=json.dumps({"address": address, "agent": "other"}), createdIndex=9, ttl=3)
    monkeypatch.setattr(client, "read", lambda key, quorum: record)
    seat = Seat(SeatConfig(("a:1",), "job", "http://h:1", ttl_s=3), fake_members(client))
    monkeypatch.setattr(seat, "_candidate", False)  # only reads
    seat.tick()
    good = address == "http://h:1"
    assert (seat.holder() is not None) == good, seat.holder()


@pytest.mark.parametrize("view", ["lease ran out", "new term at the same address"])
def test_the_relay_stops_passing_bytes_once_its_lighthouse_is_no_longer_current(view: str) -> None:
    with echo_server(b"a:") as (url, _):
        current: list[Route | None] = [Route(url, 5)]
        with Forwarder(current=lambda: current[0]) as relay:
            relay.retarget(Route(url, 5))
            conn, reply = ask(relay, b"x")
            assert reply == b"a:x"
            # The agent's main loop has not retargeted yet (nor written the new term for its
            # workers): either nobody holds the seat as far as it knows, or a new process serves
            # the same address under another term.
            current[0] = None if view == "lease ran out" else Route(url, 9)
            conn.sendall(b"y")
            conn.settimeout(5)
            assert conn.recv(4096) == b"", "a byte reached a Lighthouse whose seat may be gone"
            conn.close()
            conn = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
            assert conn.recv(4096) == b"", "a new connection was relayed to it"
            conn.close()


def test_quorum_ids_carry_the_term_of_the_lighthouse_that_formed_them(tmp_path: Path) -> None:
    quorum = SimpleNamespace(quorum_id=2, replica_ids=["a", "b"], max_step=55)
    client = SimpleNamespace(_quorum=lambda **_: quorum, other="kept")
    termed = TermedClient(client, tmp_path / "term")
    assert termed._quorum().quorum_id == 2  # no term yet: torchft's own id
    write_term(tmp_path / "term", 27)
    first = termed._quorum()
    write_term(tmp_path / "term", 45)  # the seat moved: the new Lighthouse's quorum 2 is another quorum
    second = termed._quorum()
    assert first.quorum_id != second.quorum_id and {first.quorum_id, second.quorum_id}.isdisjoint({1, 2, 3})
    assert second.replica_ids == ["a", "b"] and second.max_step == 55 and termed.other == "kept"
    assert read_term(tmp_path / "missing") == 0


@given(
    terms=st.lists(st.integers(1, 2**39), min_size=2, max_size=2, unique=True),
    ids=st.lists(st.integers(1, 2**24 - 1), min_size=2, max_size=2),
)
def test_two_lighthouses_never_give_the_same_quorum_id(terms: list[int], ids: list[int]) -> None:
    made = {(t << SHIFT) + i for t in terms for i in ids}
    assert len(made) == len({(t, i) for t in terms for i in ids})
