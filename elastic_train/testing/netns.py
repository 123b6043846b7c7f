"""Hosts in network namespaces on a private bridge, for partition tests: cut a link, heal it.

Layout, all of it created by ``bridged_hosts`` and deleted on exit (the root namespace, where the
machine's own interfaces live, is never touched; the subnet exists only on this bridge):

    <prefix>-hub:   bridge br0, ports p-store, p-a, p-b ...       (nothing else lives here)
    <prefix>-store: veth v-store 10.213.0.2/24, lo                (one namespace per host)
    <prefix>-a:     veth v-a     10.213.0.3/24, lo

Processes enter a host with ``ip netns exec`` (``Host.command``). They still share the file
system, the PID space and the hostname with everything else: the hostname resolves to an address
in the root namespace, so a program must be told its address explicitly (torchrun
``--local-addr``, gloo ``GLOO_SOCKET_IFNAME``). There is no default route, so nothing inside can
reach anything but the other hosts on the bridge: the only traffic is the test's own.

Needs root and iproute2 (``netns_problem`` says what is missing).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

SUBNET = "10.213.0"  # /24, on the test's bridge only
BRIDGE = "br0"


def _ip_binary() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def ip(*args: str) -> str:
    """Run ``ip ARGS``; raise with ip's own message if it fails."""
    binary = _ip_binary()
    assert binary is not None, "iproute2's `ip` is not installed"
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@cache
def netns_problem() -> str | None:
    """Why namespace tests cannot run here, or None: root, `ip`, and a bridge and veth in a probe."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (they create namespaces, a bridge and veth pairs)"
    if _ip_binary() is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"etprobe-{uuid.uuid4().hex[:6]}"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "br-probe", "type", "bridge")
        ip("-n", probe, "link", "add", "v-probe", "type", "veth", "peer", "name", "p-probe")
    except RuntimeError as exc:
        return f"cannot create a namespace with a bridge and a veth pair here: {exc}"
    finally:
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", probe)
    return None


REQUIRE_VAR = "ELASTIC_TRAIN_REQUIRE_NETNS"


def require_netns() -> None:
    """Skip the calling test where namespaces cannot be made, saying why; fail instead under
    ELASTIC_TRAIN_REQUIRE_NETNS=1 (set by .ci/run), where a skip would hide a missing install."""
    import pytest

    problem = netns_problem()
    if problem is not None:
        if os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(f"{REQUIRE_VAR}=1 but {problem}")
        pytest.skip(problem)


@dataclass(frozen=True)
class Host:
    """One host: a namespace with one veth on the bridge."""

    name: str
    netns: str
    ifname: str  # its interface, inside its namespace
    addr: str  # its IPv4 address on the bridge

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this host's namespace."""
        binary = _ip_binary()
        assert binary is not None
        return [binary, "netns", "exec", self.netns, *args]

    def set_link(self, up: bool) -> float:
        """Bring the host's only link down (a partition: packets vanish, nothing is closed) or back
        up. Returns the time it was done."""
        ip("-n", self.netns, "link", "set", self.ifname, "up" if up else "down")
        return time.time()

    def pids(self) -> list[int]:
        """Live processes inside this namespace."""
        try:
            return [int(pid) for pid in ip("netns", "pids", self.netns).split()]
        except RuntimeError:
            return []


def _reap(hosts: Sequence[Host], timeout: float = 10) -> None:
    """SIGKILL every process inside the hosts' namespaces, until none is left (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [pid for host in hosts for pid in host.pids()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


@contextmanager
def bridged_hosts(names: Sequence[str]) -> Iterator[dict[str, Host]]:
    """A namespace per name, each with one veth on a bridge that lives in a namespace of its own.

    On exit every process still inside the namespaces is SIGKILLed and the namespaces are deleted
    (which deletes the bridge and the veth pairs with them), whatever happened inside.
    """
    assert len(names) < 250 and all(0 < len(n) <= 8 for n in names), "at most 249 names of 1-8 characters"
    prefix = f"et{uuid.uuid4().hex[:6]}"  # unique: tests on a shared machine never collide
    hub = f"{prefix}-hub"
    hosts = {name: Host(name, f"{prefix}-{name}", f"v-{name}", f"{SUBNET}.{i + 2}") for i, name in enumerate(names)}
    made: list[str] = []
    try:
        ip("netns", "add", hub)
        made.append(hub)
        ip("-n", hub, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", hub, "link", "set", BRIDGE, "up")
        for host in hosts.values():
            ip("netns", "add", host.netns)
            made.append(host.netns)
            port = f"p-{host.name}"
            # Created in the hub with its peer moved straight into the host: no root-namespace step.
            ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", host.ifname, "netns", host.netns)
            ip("-n", hub, "link", "set", port, "master", BRIDGE, "up")
            ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            ip("-n", host.netns, "link", "set", host.ifname, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        _reap(list(hosts.values()))
        for netns in reversed(made):
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", netns)
