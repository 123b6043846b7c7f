"""The Lighthouse's seat: which agent runs the job's Lighthouse, decided by a lease in etcd, so
that quorum mode survives the loss or freeze of the node the Lighthouse runs on.

    python -m elastic_train.quorum.launch --lighthouse-etcd h0:2379,h1:2379,h2:2379 ...

Every agent runs a ``Seat``. One of them holds the key ``/elastic-train/<job>/lighthouse``
(created with ``prevExist=false`` and a TTL, refreshed every ``refresh_s``) and runs the
Lighthouse; the others read the key and learn where it serves. When the holder's node dies or
freezes, the key expires after ``ttl_s`` and the first agent to create it again starts its own
Lighthouse. The replicas never see the move: each agent hands its workers a loopback
``Forwarder`` as their Lighthouse and points it at the key's holder; a move closes the relayed
connections, and torchft's Manager reconnects (its quorum retries) to the new one.

The fence: a holder counts its lease from the moment it SENT the request that created or
refreshed it (the key cannot expire earlier than ``ttl_s`` after that) and stops its Lighthouse
(SIGKILL) ``margin_s`` before that deadline unless a later refresh succeeded. That needs to know
which send set the key's expiry: etcd v2 counts a TTL from when the member that received the
request parsed it, so a copy of an older send that etcd applies late would set an earlier expiry
than the one the holder counts from. Every refresh and delete therefore compares the key's index
(``prevIndex``, the index the holder last saw), never its value: each applied refresh moves the
index, so of all the copies sent with one index at most one is applied, and the copies of older
sends fail their compare. etcd deletes the
key only once the TTL has run out, so the old holder's Lighthouse is dead before anyone can
create the key again: two Lighthouses never serve at once, a frozen holder included (when it
thaws, the agent's first look at the clock kills its Lighthouse). Clocks are ``CLOCK_BOOTTIME``
(it counts while a process is stopped or the host suspended); the assumption is the usual one of
leases, that no clock runs ``margin_s`` per ``ttl_s`` slower than etcd's. etcd's own members must
agree on the time too: a member stamps a refresh's expiry with its clock, and the leader ends keys
by its own, so an offset between them eats into ``margin_s`` (keep them on NTP).

What this does not give alone: a side cut off from etcd and from the other replicas forms
quorums of its own until its fence, and a quorum formed by the old Lighthouse just before the
fence still finishes its step. Their commits are kept off the line by the line record in the
same etcd (``quorum.line``): each step is claimed there before it commits, and a side cut off
from etcd claims nothing (docs/fault-tolerance.md, "The coordinator").
"""

from __future__ import annotations

import json
import logging
import math
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_train.etcd_member import EtcdError, split_endpoint
from elastic_train.quorum.forward import Route

KEY = "/elastic-train/{job}/lighthouse"
# Refreshes in a row that a read settles (``Seat._refresh``): each counts its lease from an
# earlier send, so the next goes at once; past this many, it waits for the next tick.
SETTLES = 3


def now() -> float:
    """The fence's clock: it keeps counting while this process is stopped (SIGSTOP, suspend)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class SeatConfig:
    """Where the lease lives and how long it lasts."""

    endpoints: tuple[str, ...]  # etcd members, HOST:PORT
    job: str  # the job's id: one key per job, so two jobs never share a Lighthouse
    address: str  # http://host:port, where this agent's Lighthouse serves when it holds the seat
    # How long a holder that stopped refreshing keeps the seat: what losing the Lighthouse's node
    # costs the replicas (plus up to a second: etcd's expiry tick, a read, the Lighthouse's start).
    # It must stay under the replicas' quorum timeout (0.45 x --hang-timeout), or they restart.
    ttl_s: int = 5
    refresh_s: float = 0.5  # how often the holder refreshes and the others read
    margin_s: float = 1.0  # the holder's Lighthouse stops this long before its lease could end
    read_timeout_s: float = 1.0  # an etcd request to a member that does not answer
    # While no member answers a refresh, it is sent again this often, the earlier sends still
    # waiting: the first send after an etcd election ends goes through (``Members.keep_sending``).
    resend_s: float = 0.25

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise EtcdError("--lighthouse-etcd is empty: give every etcd member as HOST:PORT, comma-separated")
        for endpoint in self.endpoints:
            split_endpoint(endpoint, "--lighthouse-etcd endpoint")
        if not self.job or "/" in self.job:
            raise ValueError(f"job id {self.job!r} must be non-empty and free of '/'")
        if self.ttl_s < 2:
            raise ValueError(
                f"ttl_s (--lighthouse-ttl) must be at least 2 s (etcd counts whole seconds), got {self.ttl_s}"
            )
        if not 0 < self.margin_s < self.ttl_s:
            raise ValueError(f"margin_s must be inside (0, ttl_s={self.ttl_s}), got {self.margin_s}")
        if self.resend_s <= 0:
            raise ValueError(f"resend_s must be > 0, got {self.resend_s}")
        # A refresh that waits out a silent member must still end before the holder's own fence.
        if not 0 < self.refresh_s + self.read_timeout_s <= self.ttl_s - self.margin_s:
            raise ValueError(
                f"refresh_s {self.refresh_s} plus read_timeout_s {self.read_timeout_s} must fit in "
                f"ttl_s - margin_s = {self.ttl_s - self.margin_s:g}: raise the TTL"
            )

    @property
    def key(self) -> str:
        return KEY.format(job=self.job)


@dataclass(frozen=True)
class Holder:
    """The agent whose Lighthouse serves, as the key says."""

    address: str
    agent: str  # the holder's nonce: an agent restarted on the same host is another holder
    term: int  # etcd's createdIndex of the key: grows with every new holder


def unreachable() -> tuple[type[BaseException], ...]:
    """What a request to a member that is down, frozen or cut off raises: try another member."""
    import etcd
    import urllib3

    return (etcd.EtcdConnectionFailed, urllib3.exceptions.HTTPError, OSError)


def answered() -> tuple[type[BaseException], ...]:
    """etcd's answers about the key itself (no such key, already there, compare failed): every
    member gives the same one, unlike a member that is out of reach or has no leader yet."""
    import etcd

    return (etcd.EtcdKeyError, etcd.EtcdValueError)


def _errors() -> tuple[type[BaseException], ...]:
    """Anything an etcd request may raise besides the answers handled where it is made."""
    import etcd
    import urllib3

    return (etcd.EtcdException, urllib3.exceptions.HTTPError, OSError)


def final(error: BaseException) -> bool:
    """An error that ends a request sent to several members: etcd's answer about the key (every
    member gives the same), or one that is not etcd's at all (a bug: waiting would hide it)."""
    return isinstance(error, answered()) or not isinstance(error, _errors())


class Members:
    """One python-etcd client per member, used in turn: a request that finds its member
    unreachable is sent to the next at once (``call``), or sent to all at once (``hedged``).

    Not python-etcd's own failover: with several hosts it contacts the cluster when it is
    built (an agent started before etcd would crash), its member list empties when every member
    failed once and never fills again (the client is stuck on the last one tried, measured),
    and urllib3 retries each request three more times on a timeout (4 x ``read_timeout`` on a
    frozen member, longer than the fence allows)."""

    def __init__(self, endpoints: tuple[str, ...], read_timeout_s: float) -> None:
        import etcd  # python-etcd: the client torch's etcd rendezvous uses too ('elastic-train[etcd]')
        import urllib3

        # Its failed requests are logged at ERROR on the root logger's last resort (stderr): this
        # module says what matters, once in a while (Seat._report).
        logging.getLogger("etcd").setLevel(logging.CRITICAL)
        self.clients = []
        for endpoint in endpoints:
            host, port = split_endpoint(endpoint, "--lighthouse-etcd endpoint")
            client = etcd.Client(host=host, port=port, read_timeout=read_timeout_s, allow_reconnect=False)
            # maxsize 16: resent refreshes overlap a frozen member's requests still waiting out their
            # connect and read timeouts (up to 2 s / resend_s of them).
            client.http = urllib3.PoolManager(num_pools=2, maxsize=16, retries=False, timeout=read_timeout_s)
            self.clients.append(client)
        self.current = 0
        self.read_timeout_s = read_timeout_s

    def call(self, request: Callable[[Any], Any]) -> Any:
        """``request(client)`` on the current member, else on each next one; the last member's
        error when none answers. etcd's own answers (no such key, compare failed) are raised at once."""
        last: BaseException | None = None
        for _ in self.clients:
            try:
                return request(self.clients[self.current])
            except unreachable() as exc:
                last = exc
                self.current = (self.current + 1) % len(self.clients)
        assert last is not None
        raise last

    def round_s(self) -> float:
        """The longest a request waits: its connect and its read timeouts (urllib3 counts them
        apart), plus a second for the threads to run on a loaded host."""
        return 2 * self.read_timeout_s + 1.0

    def hedged(self, request: Callable[[Any], Any]) -> Any:
        """``request(client)`` on every member at once; the first answer wins (a result, or
        etcd's answer about the key, ``answered()``), and the last member's error when none
        answers (out of reach, or no leader to take the request).
        Only for requests that may be applied more than once: a quorum read.

        Why not in turn: while the leader is frozen, every write and quorum read waits out the
        read timeout on each member until the others have elected a new one. In turn, a round
        on three members costs three timeouts, so a holder's fence (``ttl_s - margin_s``) held
        one round: an election that outlasted it under load cost the seat (seen in CI). At
        once, a round costs one timeout and the next starts right after it."""
        answers: queue.SimpleQueue[tuple[float, bool, Any]] = queue.SimpleQueue()
        self._send_to_all(request, answers, 0.0)
        last: BaseException | None = None
        deadline = time.monotonic() + self.round_s()
        for _ in self.clients:
            try:
                _, ok, answer = answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                last = TimeoutError(f"no etcd member answered in {self.round_s():g} s")
                break
            if ok:
                return answer
            if final(answer):
                raise answer
            last = answer
        assert last is not None
        raise last

    def _send_to_all(
        self, request: Callable[[Any], Any], answers: queue.SimpleQueue[tuple[float, bool, Any]], sent: float
    ) -> None:
        """``request(client)`` on every member, each in a thread of its own; every outcome goes
        to ``answers`` as (``sent``, answered, result or error), for the caller to weigh."""

        def ask(client: Any) -> None:
            try:
                answers.put((sent, True, request(client)))
            except BaseException as exc:  # handed to the caller, which raises or waits on
                answers.put((sent, False, exc))

        for client in self.clients:
            threading.Thread(target=ask, args=(client,), name="etcd-request", daemon=True).start()

    def keep_sending(
        self, request: Callable[[Any], Any], clock: Callable[[], float], give_up: Callable[[], bool], every_s: float
    ) -> tuple[float, Any]:
        """``request(client)`` on every member at once, and again every ``every_s`` while none
        has answered, the earlier sends still waiting, until ``give_up()``. Returns when the
        send that was answered left (``clock()``) and its result; raises etcd's answer about
        the key at once, and the last error when nothing was answered before ``give_up()``.
        Only for a request that may be applied any number of times (a quorum read) or of which
        etcd applies at most one copy (the seat's refresh, which compares the key's index).

        Why not one round after another (``hedged`` again): a request sent during an etcd
        election is not answered when the election ends, it waits out its read timeout, so
        rounds reach a new leader only once a second. Sent every ``every_s``, the first send
        after the election goes through within ``every_s`` of its end."""
        answers: queue.SimpleQueue[tuple[float, bool, Any]] = queue.SimpleQueue()
        last: BaseException | None = None
        next_send = clock()
        while not give_up():
            sent = clock()
            if sent >= next_send:
                self._send_to_all(request, answers, sent)
                next_send = sent + every_s
            try:
                when, ok, answer = answers.get(timeout=max(0.0, next_send - clock()))
            except queue.Empty:
                continue
            if ok:
                return when, answer
            if final(answer):
                raise answer
            last = answer
        raise last if last is not None else TimeoutError("no etcd member answered before the lease ran out")


class Seat:
    """One agent's view of the seat, kept current by a thread. ``mine()`` and ``holder()`` are
    what the agent acts on (it starts and kills the Lighthouse itself: a Lighthouse dies with
    the thread that started it, ``quorum.lighthouse``)."""

    def __init__(self, config: SeatConfig, members: Any = None) -> None:
        self.config = config
        self.nonce = uuid.uuid4().hex
        self.value = json.dumps({"address": config.address, "agent": self.nonce})
        self._members = members if members is not None else Members(config.endpoints, config.read_timeout_s)
        self._lock = threading.Lock()
        self._mine_until = 0.0  # while now() is below it, this agent's Lighthouse may serve
        self._term = 0  # the term this agent holds (when it does)
        self._index = 0  # the key's modifiedIndex as this agent last saw it (its create or refresh)
        # When the first refresh comparing ``_index`` was sent (None: none yet). If one of those
        # was applied without its reply reaching this agent, the lease counts from here.
        self._index_first_sent: float | None = None
        self._holder: Holder | None = None
        self._holder_until = 0.0  # while now() is below it, ``_holder`` is known to hold the key
        self._quiet_until = 0.0  # the last etcd error was reported; the next is not before this
        self._candidate = True  # False once this agent gives the seat up for good: it only reads
        # After this agent deleted its own key early, it does not create the key again before
        # this (``_delete_own``).
        self._retake_after = 0.0
        # Bumped when the seat is given up: a reply to a request sent before must not extend it.
        self._generation = 0
        self.taken_at: float | None = None  # when the last create that won was sent
        # The least lease left when the reply to a refresh came back: how near the fence the
        # holder came (an etcd election it rode out shows here); inf before the first refresh.
        self.least_left_s = math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lighthouse-seat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def mine(self) -> bool:
        with self._lock:
            return now() < self._mine_until

    def lease_end(self) -> float:
        """When this agent's Lighthouse must be dead by (``now()`` clock): the fence's deadline."""
        with self._lock:
            return self._mine_until

    def holder(self) -> Holder | None:
        """The Lighthouse to talk to: this agent's own while it holds the seat, else the one the
        key named at the last read, while that read says its lease runs. None: nobody is known
        to hold it now (no Lighthouse to relay to)."""
        with self._lock:
            t = now()
            if t < self._mine_until:
                return Holder(self.config.address, self.nonce, self._term)
            return self._holder if t < self._holder_until else None

    def resign(self) -> None:
        """Give the seat up now but stay a candidate: the key is deleted, and the next holder
        (another agent at its next round, or this one after ``ttl_s``) creates it with a new
        term. For a Lighthouse that died while its seat was held: a new process must not serve
        under the old term."""
        with self._lock:
            self._generation += 1
            held, self._mine_until, index, term = now() < self._mine_until, 0.0, self._index, self._term
        if held:
            self._delete_own(index, term)

    def _delete_own(self, index: int, term: int) -> None:
        """Delete this agent's key while etcd still counts it as live, and stand back. The other
        agents may have read the key just before: each relays to this agent's address under the
        old term until its read's lease runs out, up to ``ttl_s`` later. A new Lighthouse of this
        agent's at the same address within that time would be given the old term's quorum ids by
        them and the new term's by the rest; the new quorum's process group then forms under two
        ids, fails, and a replica restarts (measured under load: a worker restart after a
        Lighthouse killed alone). So this agent takes the seat again only after ``ttl_s``; any
        other agent may take it at its next round, at its own address.

        The delete compares ``index``, the key's index as this agent last saw it: a copy applied
        late (a member that held it) cannot delete a later key of this agent's with the same
        value. If a refresh of this agent's moved the index meanwhile (its reply lost, or not
        awaited once the agent stopped), the key is read and, still this agent's key of
        ``term``, deleted at the index read."""
        import etcd

        with self._lock:
            self._retake_after = now() + self.config.ttl_s
        key = self.config.key

        def delete(client: Any) -> Any:
            try:
                return client.delete(key, prevIndex=index)
            except etcd.EtcdCompareFailed:
                found = client.read(key, quorum=True)
                if found.value != self.value or int(found.createdIndex) != term:
                    return None  # another's key now: nothing of this agent's to release
                return client.delete(key, prevIndex=int(found.modifiedIndex))

        self._quietly(delete)

    def abdicate(self) -> None:
        """Give the seat up for good (this agent cannot run a Lighthouse, or is stopping): now,
        and never take it again; another agent's Lighthouse serves this one's workers too."""
        with self._lock:
            self._candidate = False
            self._generation += 1
            held, self._mine_until, index, term = now() < self._mine_until, 0.0, self._index, self._term
        if held:
            self._delete_own(index, term)

    def stop(self, release: bool = True) -> None:
        """Stop refreshing; ``release`` deletes the key when this agent holds it, so the next
        holder need not wait for the TTL (a clean end; a crash releases nothing)."""
        self._stop.set()
        if self._thread.is_alive():
            # A tick's longest path: a quorum read's hedged round (a refresh sees the stop within
            # ``resend_s``), then a delete sent to each member in turn, each within its connect
            # and read timeouts.
            per_request = 2 * self.config.read_timeout_s
            longest = per_request + 1.0 + len(self.config.endpoints) * per_request
            self._thread.join(timeout=longest + self.config.refresh_s)
        if release:
            self.abdicate()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # a thread that died here would leave the seat to expire unseen
                self._say(f"the Lighthouse seat's round failed: {type(exc).__name__}: {exc}; trying again")
            self._stop.wait(self.config.refresh_s)

    def _hold(self, sent: float, generation: int, index: int, term: int | None = None) -> bool:
        """A create or refresh sent at ``sent`` succeeded and left the key at ``index``: the lease
        runs from then, unless the seat was given up meanwhile (the caller then deletes the key)."""
        with self._lock:
            if not self._candidate or generation != self._generation:
                return False
            if term is None:  # a refresh
                left = self._mine_until - now()
                if left <= 0:
                    # Its reply came after the fence: the agent has killed (or is killing) the
                    # Lighthouse, so the seat is not taken back; the caller deletes the key.
                    return False
                self.least_left_s = min(self.least_left_s, left)
            self._mine_until = sent + self.config.ttl_s - self.config.margin_s
            self._index, self._index_first_sent = index, None
            if term is not None:
                self._term = term
                self.taken_at = sent
            return True

    def tick(self) -> None:
        """One round: refresh the seat if held, else try to take it, else read who has it."""
        import etcd

        key, ttl = self.config.key, self.config.ttl_s
        with self._lock:
            generation, candidate, retake_after = self._generation, self._candidate, self._retake_after
        if self.mine():
            self._refresh(generation)
            return
        sent = now()
        if not candidate or sent < retake_after:
            self._read(sent, generation)
            return
        try:
            made = self._members.call(lambda c: c.write(key, self.value, ttl=ttl, prevExist=False))
        except etcd.EtcdAlreadyExist:
            self._read(sent, generation)
            return
        except _errors() as exc:
            self._report(exc)
            return
        if not self._hold(sent, generation, int(made.modifiedIndex), int(made.createdIndex)):
            self._delete_own(int(made.modifiedIndex), int(made.createdIndex))
            return
        self._say(f"took the Lighthouse seat (term {made.createdIndex})")

    def _refresh(self, generation: int) -> None:
        """Extend the held lease: sent to every member, and sent again while none answers, for
        as long as the lease runs, not only at the next tick. While etcd elects a new leader
        (its leader lost or frozen) no member answers, and each send before the fence is a
        chance to keep the seat. When the fence has passed, the agent kills the Lighthouse.

        Each send compares the index this agent last saw: etcd applies at most one of them (the
        first moves the index), so a success names the send that set the key's expiry. When the
        first answer is a compare failure instead, a send whose reply is late or lost may have
        been applied: ``_settle`` reads the key to know. A lease kept that way counts from an
        earlier send, the first that compared the old index, so the refresh goes again at once
        with the index read, not at the next tick (at most ``SETTLES`` times in a row)."""
        for _ in range(SETTLES):
            if not self._refresh_once(generation):
                return

    def _refresh_once(self, generation: int) -> bool:
        """One refresh; True when it was settled by a read (refresh again now)."""
        import etcd

        key, ttl = self.config.key, self.config.ttl_s
        with self._lock:
            index, term = self._index, self._term
            if self._index_first_sent is None:
                self._index_first_sent = now()  # no earlier than this call's first send
            first = self._index_first_sent
        try:
            sent, made = self._while_held(lambda c: c.refresh(key, ttl=ttl, prevIndex=index))
        except etcd.EtcdKeyNotFound:
            self._lose("the lease expired before a refresh reached etcd")
            return False
        except etcd.EtcdCompareFailed:
            return self._settle(index, first, generation)
        except _errors() as exc:  # nothing answered before the fence: the next tick may take the seat again
            self._report(exc)
            return False
        if not self._hold(sent, generation, int(made.modifiedIndex)):
            self._delete_own(int(made.modifiedIndex), term)
        return False

    def _while_held(self, request: Callable[[Any], Any]) -> tuple[float, Any]:
        """``request`` to every member, resent every ``resend_s`` until one answers, this agent
        stops, or the fence passes (``Members.keep_sending``)."""
        return self._members.keep_sending(
            request,
            clock=now,
            give_up=lambda: self._stop.is_set() or now() >= self.lease_end(),
            every_s=self.config.resend_s,
        )

    def _settle(self, index: int, first: float, generation: int) -> bool:
        """A refresh comparing ``index`` failed its compare: the key moved on since this agent
        saw it at ``index``. Either one of this agent's own refreshes comparing ``index`` was
        applied and its reply is late or lost (the key is still this agent's, same term), or the
        key expired and another agent created it anew. Which one is read from a quorum, asked
        again every ``resend_s`` while the lease runs (as the refresh is); in the first case the
        lease counts from ``first``, the first send that compared ``index``: no copy of it
        reached a member before then. True when the seat is kept that way."""
        import etcd

        key = self.config.key
        try:
            _, found = self._while_held(lambda c: c.read(key, quorum=True))
        except etcd.EtcdKeyNotFound:
            self._lose("the key expired before a refresh reached etcd")
            return False
        except _errors() as exc:  # unread before the fence: the next tick may take the seat again
            self._report(exc)
            return False
        with self._lock:
            term = self._term
        moved = int(found.modifiedIndex)
        if found.value != self.value or int(found.createdIndex) != term or moved <= index:
            self._lose(f"the key is another's now (term {found.createdIndex})")
            return False
        if not self._hold(first, generation, moved):
            self._delete_own(moved, term)
            return False
        return True

    def _lose(self, why: str) -> None:
        with self._lock:  # the agent kills the Lighthouse at its next look
            self._mine_until = 0.0
        self._say(f"lost the Lighthouse seat ({why})")

    def _read(self, sent: float, generation: int) -> None:
        import etcd

        try:
            # A quorum read: a member cut off from the others would answer with what it last knew.
            found = self._members.hedged(lambda c: c.read(self.config.key, quorum=True))
        except etcd.EtcdKeyNotFound:
            return  # it expired between the create and the read: the next round creates it
        except _errors() as exc:
            self._report(exc)
            return
        try:
            fields = json.loads(found.value)
            holder = Holder(str(fields["address"]), str(fields["agent"]), int(found.createdIndex))
            Route(holder.address)  # http://HOST:PORT, or the relay could not lead there
        except (TypeError, ValueError, KeyError) as exc:
            self._say(f"the Lighthouse seat's key holds {found.value!r}, not an agent's record ({exc}); ignored")
            return
        if holder.agent == self.nonce:
            self._clear_stale(int(found.modifiedIndex), int(found.createdIndex))
            return
        # etcd reports the TTL left rounded up to whole seconds: at least ttl - 1 s were left
        # when the member answered, which was after ``sent``.
        left = max(0.0, float(found.ttl or 0) - 1.0)
        with self._lock:
            self._holder = holder
            self._holder_until = sent + left

    def _clear_stale(self, index: int, term: int) -> None:
        """The key is this agent's although it does not count the seat as held: a create whose
        reply was lost (a member that applied it and then stalled), or a lease past this agent's
        own fence but not yet expired in etcd. It is deleted, not taken back: the next holder
        (this agent only after ``ttl_s``) creates the key anew, and with it a new term, so that
        every Lighthouse process serves under a term of its own (``quorum.term``)."""
        self._delete_own(index, term)

    def _report(self, exc: BaseException) -> None:
        # A member down is routine (the others answer); say so once in a while, not each round.
        if now() >= self._quiet_until:
            self._quiet_until = now() + 10.0
            self._say(f"etcd at {','.join(self.config.endpoints)} did not answer: {type(exc).__name__}: {exc}")

    def _quietly(self, request: Callable[[Any], Any]) -> None:
        try:
            self._members.call(request)
        except answered() as exc:  # gone, or moved on again between the read and the delete
            self._say(f"released nothing: {type(exc).__name__}: {exc}; etcd ends the key at its TTL")
        except _errors() as exc:  # a release is a courtesy: the TTL ends it anyway
            self._report(exc)

    @staticmethod
    def _say(message: str) -> None:
        print(f"[quorum-agent] {message}", file=sys.stdout, flush=True)
