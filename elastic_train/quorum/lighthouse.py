"""torchft's Lighthouse as a child process on loopback, for tests, examples and benchmarks.

The Lighthouse is the quorum's coordinator: every replica group's Manager heartbeats to it and
asks it for the membership of each step. Its knobs decide how long a failure costs the
survivors: a replica that stops heartbeating is left out of the next quorum after
``heartbeat_timeout_ms``; measured on 2 cores, a SIGKILLed worker cost its peer 0.36-0.57 s at
250-500 ms. In a real job run ``torchft_lighthouse`` (it ships in the torchft wheel) on a host
every node reaches, with the same flags.

Ownership: ``start`` refuses a port something else listens on (``LighthousePortTaken``: another
job's Lighthouse, or one a SIGKILLed agent left behind), and counts the Lighthouse as started
only when the listening socket on its port is one of its child's own file descriptors (the
socket's inode, from ``/proc/<pid>/net/tcp*`` and ``/proc/<pid>/fd``), never because "someone
answered". The child runs ``lighthouse_main`` (torchft's Lighthouse without importing torch:
it listens ~20 ms after its start instead of ~2 s), which first sets ``PR_SET_PDEATHSIG``
(SIGKILL): when the process that started it dies, even by SIGKILL, the Lighthouse dies too.
Linux delivers that signal when the starting THREAD exits: start it from a thread that lives as
long as the Lighthouse should (the agent's main thread).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from elastic_train.quorum import lighthouse_main


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LighthousePortTaken(RuntimeError):
    """Another process listens on the Lighthouse's port: it is not this job's to use."""

    def __init__(self, host: str, port: int) -> None:
        holder = listening_pid(port)
        who = f"process {holder}" if holder is not None else "another process (not visible to this user)"
        super().__init__(
            f"port {port} on {host} is already in use by {who}: another job's Lighthouse, or one left "
            f"behind by a killed agent. Fix: pass another --lighthouse-port (or stop that process)"
        )
        self.port = port


def _listening_inodes(pid: int | str, port: int) -> set[str]:
    """Inodes of the sockets listening on ``port`` in ``pid``'s network namespace."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int | str) -> set[str]:
    """Inodes of the sockets ``pid`` holds open (empty when its fds are not ours to read)."""
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def owns_listener(pid: int, port: int) -> bool:
    """True when ``pid`` itself holds a socket listening on ``port`` (not merely someone does)."""
    return bool(_listening_inodes(pid, port) & _socket_inodes(pid))


def listening_pid(port: int) -> int | None:
    """The process listening on ``port`` in this network namespace, if this user may see it."""
    listening = _listening_inodes("self", port)
    if not listening:
        return None
    for entry in os.listdir("/proc"):
        if entry.isdigit() and listening & _socket_inodes(entry):
            return int(entry)
    return None


def _check_port_free(host: str, port: int) -> None:
    """``LighthousePortTaken`` when a socket already listens on ``host:port``. SO_REUSEADDR as
    the Lighthouse's own bind: the TIME_WAIT connections of a previous one are no obstacle."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LighthousePortTaken(host, port) from None
            raise


@dataclass(frozen=True)
class LighthouseConfig:
    """``torchft_lighthouse``'s flags."""

    min_replicas: int = 1  # the smallest quorum: 1 lets a lone survivor go on
    # A replica silent this long is dead. Its Manager heartbeats every 100 ms; on a loaded
    # machine too short a timeout drops a live replica (it then heals and rejoins: slow, not wrong).
    heartbeat_timeout_ms: int = 400
    # How long a quorum waits for replicas that heartbeat but have not asked to join yet (when
    # not all of the previous quorum's members asked). It is counted from the EARLIEST waiting
    # request: a replica left out of one quorum waits with an old timestamp, so with a short
    # timeout the next quorum forms the moment any other replica asks, leaving out the slowest
    # one again. Measured with 3 replicas on 2 cores at 100 ms: every quorum had 2 members and
    # one replica healed at every step. Dead replicas are not waited for (no heartbeat for
    # heartbeat_timeout_ms); a restarted one heartbeats only from just before it asks. With two
    # replicas it never applies: one of two is not a majority, so the survivor's quorum waits
    # for the dead one's heartbeat to expire, or for the replacement's request, either way.
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 20  # how often a pending quorum is re-evaluated

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, got {self.min_replicas}")
        for what in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            if getattr(self, what) <= 0:
                raise ValueError(f"{what} must be positive, got {getattr(self, what)}")

    def flags(self) -> list[str]:
        return [
            f"--min_replicas={self.min_replicas}",
            f"--heartbeat_timeout_ms={self.heartbeat_timeout_ms}",
            f"--join_timeout_ms={self.join_timeout_ms}",
            f"--quorum_tick_ms={self.quorum_tick_ms}",
        ]


class Lighthouse:
    """``with Lighthouse() as lh:`` a Lighthouse listening at ``lh.address`` until the block ends.

    Starts torchft's Lighthouse (``lighthouse_main``) with this interpreter on a free loopback
    port (or ``port``), in a session of its own, and waits until it accepts connections. ``env``
    is its whole environment (tests pass one carrying their reaping token); output goes to
    ``log`` (default: discarded).
    """

    def __init__(
        self,
        config: LighthouseConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 60.0,
        prefix: Sequence[str] = (),
    ) -> None:
        if prefix and not port:
            raise ValueError("a Lighthouse started under a prefix (another network namespace) needs its port given")
        self.config = config or LighthouseConfig()
        self.host = host
        self.port = port or _free_port(host)
        # A command it runs under, e.g. ``ip netns exec NS`` (tests): ``host`` is then an address
        # of that namespace, where the free-port probe cannot bind; the ownership check (the
        # child's own listening socket) still decides whether it started.
        self.prefix = list(prefix)
        self.log = log
        self.env = dict(env) if env is not None else dict(os.environ)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """What replicas pass as their Lighthouse (torchft's TORCHFT_LIGHTHOUSE)."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the Lighthouse is not running: use it as a context manager (with Lighthouse() as lh:)")
        return self.proc.pid

    def start(self) -> None:
        """Starts it and waits until it listens (``start_timeout_s``)."""
        self.launch()
        assert self.proc is not None
        self._wait_until_listening(self.proc)

    def launch(self) -> None:
        """Starts it without waiting: ``listening()`` says when it serves. For a caller that
        must keep doing something else meanwhile (the seat's fence)."""
        if importlib.util.find_spec("torchft") is None:
            raise FileNotFoundError(
                f"torchft is not installed for {sys.executable}: quorum mode needs it (pip install 'elastic-train[ft]')"
            )
        if not self.prefix:
            _check_port_free(self.host, self.port)
        command = [sys.executable, lighthouse_main.__file__, f"--bind={self.host}:{self.port}", *self.config.flags()]
        command = [*self.prefix, *command]  # the prefix execs its command: the starter stays the parent
        env = {"RUST_LOG": "info", **self.env}  # it logs quorum changes: useful in a test's output
        env[lighthouse_main.STARTER_VAR] = str(os.getpid())  # it dies with this process (Linux)
        with self.log.open("ab") if self.log is not None else open(os.devnull, "wb") as output:
            self.proc = subprocess.Popen(
                command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )

    def listening(self) -> bool:
        """Whether the launched child itself listens on the port yet; raises when it exited
        (``LighthousePortTaken`` when someone else took the port meanwhile)."""
        proc = self.proc
        if proc is None:
            raise RuntimeError("the Lighthouse was not launched")
        if owns_listener(proc.pid, self.port):
            return True
        if proc.poll() is not None:
            if not self.prefix and _listening_inodes("self", self.port):  # taken between the check and its bind
                raise LighthousePortTaken(self.host, self.port)
            raise RuntimeError(f"torchft_lighthouse exited with {proc.returncode}; see {self.log}")
        return False

    def _wait_until_listening(self, proc: subprocess.Popen[bytes]) -> None:
        """Until ``proc`` itself listens on the port; a foreign listener there is an error, not a start."""
        deadline = time.monotonic() + self.start_timeout_s
        while not self.listening():
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"torchft_lighthouse not listening on {self.address} after {self.start_timeout_s}s")
            time.sleep(0.01)  # it listens ~20 ms after its start: every quorum mode launch waits here

    def kill(self) -> None:
        """SIGKILL, now: a Lighthouse whose seat is lost must not answer one more request."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; always waits for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> Lighthouse:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
