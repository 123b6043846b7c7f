"""A loopback port that relays every connection to the Lighthouse of the moment.

torchft's Manager is given one Lighthouse address for its life. With the Lighthouse's seat in
etcd (``quorum.seat``) the Lighthouse may move to another node; the agent gives its workers this
relay's address instead and points it at the seat's holder. ``retarget`` to a new route closes
every relayed connection (the old Lighthouse is gone or fenced), and the Manager's next request
connects anew, to the new one. With no Lighthouse known, a connection is closed at once: the
Manager's quorum retries (every 0.25 s) find the next one.

A route is an address and a term (``quorum.term``): one address may serve a new Lighthouse
process under a new term, and the relay carries bytes only while the agent's view of the seat
is the very route it was given, term included, so that no request reaches a Lighthouse whose
term the agent has not yet handed to its workers.

Bytes are relayed as they come; nothing is parsed (gRPC over HTTP/2 passes through unchanged).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

CHUNK = 1 << 16
CONNECT_TIMEOUT_S = 1.0  # to the Lighthouse; a frozen one fails the request, which is retried


@dataclass(frozen=True)
class Route:
    """Where the relay leads: a Lighthouse's address and the term it serves under."""

    address: str
    term: int = 0

    def __post_init__(self) -> None:
        _endpoint(self.address)


def _endpoint(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"Lighthouse address {url!r} is not http://HOST:PORT")
    return parts.hostname, parts.port


class Forwarder:
    """``with Forwarder() as relay:`` workers use ``relay.address``; ``relay.retarget(route)``."""

    def __init__(self, host: str = "127.0.0.1", current: Callable[[], Route | None] | None = None) -> None:
        # ``current``: where the Lighthouse is right now, asked at each accept and before each
        # chunk is passed on, so that a relay whose agent's main loop is busy (or that thawed
        # before it) never carries a byte to a Lighthouse whose seat may be gone.
        self._current = current
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._target: Route | None = None
        self._open: set[socket.socket] = set()  # every relayed socket, both sides
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="lighthouse-relay", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def target(self) -> Route | None:
        with self._lock:
            return self._target

    def retarget(self, route: Route | None) -> None:
        """Relay new connections along ``route`` (None: refuse them); close the ones on another."""
        with self._lock:
            if route == self._target:
                return
            self._target = route
            stale, self._open = self._open, set()
        for sock in stale:
            _shut(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stale, self._open = self._open, set()
        _shut(self._listener)
        self._listener.close()
        for sock in stale:
            _shut(sock)

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(conn,), name="lighthouse-relay-conn", daemon=True).start()

    def _valid(self, target: Route) -> bool:
        return self._current is None or self._current() == target

    def _relay(self, conn: socket.socket) -> None:
        target = self.target
        if target is not None and not self._valid(target):
            target = None
        if target is None:
            conn.close()
            return
        try:
            upstream = socket.create_connection(_endpoint(target.address), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        for sock in (conn, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed or self._target != target:  # moved while connecting
                stale = True
            else:
                stale = False
                self._open.update((conn, upstream))
        if stale:
            conn.close()
            upstream.close()
            return
        back = threading.Thread(
            target=self._pump, args=(upstream, conn, target), name="lighthouse-relay-back", daemon=True
        )
        back.start()
        self._pump(conn, upstream, target)
        back.join()
        with self._lock:
            self._open.discard(conn)
            self._open.discard(upstream)
        conn.close()
        upstream.close()

    def _pump(self, src: socket.socket, dst: socket.socket, target: Route) -> None:
        try:
            while (data := src.recv(CHUNK)) and self._valid(target):
                dst.sendall(data)
        except OSError:
            pass
        # Either side's end ends both: a half-open relay would leave the Manager waiting.
        _shut(src)
        _shut(dst)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
