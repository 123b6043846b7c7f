"""A replicated rendezvous for restart mode: one etcd member, ``python -m elastic_train.etcd_member``.

torchrun's c10d rendezvous lives in one process's ``TCPStore``: whichever host serves it
(``python -m elastic_train.rendezvous`` or an agent) is a single point of failure. torch also
ships a rendezvous backend over etcd (``--rdzv-backend=etcd-v2``), and etcd replicates its keys
over its members by Raft, so a cluster of three survives the loss of any one member, five of any
two. This command starts one member, with the settings that backend needs, and waits until the
cluster has a leader:

    # on each of three hosts (h0, h1, h2), its own --name and addresses:
    python -m elastic_train.etcd_member --name h0 --client h0:2379 --peer h0:2380 \\
        --cluster h0=h0:2380,h1=h1:2380,h2=h2:2380 --data-dir /tmp/etcd-$JOB &
    # every agent, given every member (it picks one that answers):
    ET_RDZV_BACKEND=etcd ET_RDZV_ENDPOINT=h0:2379,h1:2379,h2:2379 jobs/elastic-agent.sh ...

The etcd binary is Debian's ``etcd-server`` (``apt-get install etcd-server``; 3.4 on bookworm),
or ``ELASTIC_TRAIN_ETCD=/path/to/etcd``. torch's backend speaks etcd's v2 API, which etcd serves
only with ``--enable-v2`` and removed in 3.6, so a newer etcd is refused here. The Python client
is ``python-etcd`` (the ``etcd`` extra). A member that is killed and started again with its data
folder rejoins the cluster; a member on a new, empty folder would need ``etcdctl member add``
first (not done here).

Nothing is home-made: the rendezvous protocol is torch's, the replication etcd's. Prints
``etcd member NAME ready on http://HOST:PORT`` once the cluster answers (``--ready-file`` also
writes it), runs until SIGTERM or SIGINT, and exits non-zero if etcd does.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

BINARY_VAR = "ELASTIC_TRAIN_ETCD"
INSTALL_HINT = "install Debian's etcd-server (apt-get install etcd-server) or set ELASTIC_TRAIN_ETCD=/path/to/etcd"
# A leader is elected within a few election timeouts (1 s each by default) once a majority runs.
READY_TIMEOUT_S = 60.0


class EtcdError(Exception):
    """Bad input or a missing etcd: the message names the problem and the fix."""


@dataclass(frozen=True)
class Member:
    name: str
    client: str  # host:port the agents use
    peer: str  # host:port the other members use
    cluster: dict[str, str]  # every member's name -> its peer host:port, this one included

    def __post_init__(self) -> None:
        for what, value in (("--client", self.client), ("--peer", self.peer), *self.cluster.items()):
            split_endpoint(value, what)
        if self.cluster.get(self.name) != self.peer:
            raise EtcdError(
                f"--cluster must list this member as {self.name}={self.peer} (it lists "
                f"{self.cluster.get(self.name, 'no ' + self.name)}): every member is started with the same --cluster"
            )
        if len(self.cluster) % 2 == 0:
            # Not refused: two members work, but a majority of two is both, so they survive no loss.
            print(
                f"elastic-train etcd: {len(self.cluster)} members survive no more losses than "
                f"{len(self.cluster) - 1}: an odd count (3, 5) is what Raft's majority rewards",
                file=sys.stderr,
                flush=True,
            )

    def command(self, binary: str, data_dir: Path, token: str) -> list[str]:
        peers = ",".join(f"{name}=http://{peer}" for name, peer in sorted(self.cluster.items()))
        client_host, client_port = split_endpoint(self.client, "--client")
        peer_host, peer_port = split_endpoint(self.peer, "--peer")
        return [
            binary,
            "--name",
            self.name,
            "--data-dir",
            str(data_dir),
            "--enable-v2=true",  # torch's etcd rendezvous backends speak the v2 API
            "--listen-client-urls",
            f"http://{listen_address(client_host)}:{client_port}",
            "--advertise-client-urls",
            f"http://{self.client}",  # python-etcd learns every member from these and fails over
            "--listen-peer-urls",
            f"http://{listen_address(peer_host)}:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://{self.peer}",
            "--initial-cluster",
            peers,
            "--initial-cluster-state",
            "new",  # ignored by etcd once the data folder holds a member: a restart rejoins
            "--initial-cluster-token",
            token,  # members of two jobs never join each other's cluster
        ]


def split_endpoint(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EtcdError(f"{what} {value!r} is not HOST:PORT (for example node1:2379)")
    return host, int(port)


def listen_address(host: str) -> str:
    """etcd listens on IP addresses only: an address stays, a name (which may resolve to loopback
    here and to the real interface elsewhere, as Debian's /etc/hosts does) becomes every interface."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "0.0.0.0"  # the advertised name is how peers and agents reach it
    return host


def parse_cluster(spec: str) -> dict[str, str]:
    cluster: dict[str, str] = {}
    for item in filter(None, spec.split(",")):
        name, sep, peer = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise EtcdError(f"--cluster item {item!r} is not NAME=HOST:PORT (for example h0=h0:2380)")
        if name in cluster:
            raise EtcdError(f"--cluster names {name} twice")
        cluster[name] = peer
    if not cluster:
        raise EtcdError("--cluster is empty: give every member as NAME=HOST:PORT, comma-separated")
    return cluster


def find_binary() -> str:
    configured = os.environ.get(BINARY_VAR)
    binary = configured or shutil.which("etcd")
    if binary is None or not os.access(binary, os.X_OK):
        where = f"{BINARY_VAR}={configured} is not an executable" if configured else "etcd is not on PATH"
        raise EtcdError(f"{where}: {INSTALL_HINT}")
    return binary


def check_version(binary: str) -> str:
    """The binary's version, refused where torch's backend cannot talk to it (no v2 API)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EtcdError(f"{binary} --version failed ({exc}): {INSTALL_HINT}") from exc
    found = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", out)
    if found is None:
        raise EtcdError(f"{binary} --version printed no etcd version ({out.strip()[:200]!r}): {INSTALL_HINT}")
    major, minor = int(found[1]), int(found[2])
    if (major, minor) >= (3, 6) or major < 3:
        raise EtcdError(
            f"etcd {found[0][14:]} cannot serve torch's etcd rendezvous, which speaks the v2 API "
            "(served by etcd 3.4 and 3.5 with --enable-v2, removed in 3.6): use etcd 3.4 or 3.5"
        )
    return found[0][14:]


def healthy(endpoint: str, timeout_s: float = 2.0) -> bool:
    """Whether the member at host:port answers and its cluster has a leader."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout_s) as reply:
            return bool(json.loads(reply.read()).get("health") == "true")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def pick(endpoints: Sequence[str], timeout_s: float, every: bool = False) -> list[str]:
    """The first of ``endpoints`` that is healthy (``every``: all of them, once all are), trying
    until ``timeout_s`` ends.

    torch's etcd backend is given one endpoint and fails at start if that member is down; once
    connected, python-etcd knows every member and moves on from a dead one by itself. A job that
    starts its members checks every one (``every``): a member that failed to start leaves the
    cluster without a spare, and nobody would notice until the next loss.
    """
    if not endpoints:
        raise EtcdError("no endpoint given: pass every member's HOST:PORT, comma-separated")
    for endpoint in endpoints:
        split_endpoint(endpoint, "endpoint")
    deadline = time.monotonic() + timeout_s
    while True:
        up = [e for e in endpoints if healthy(e)]
        if up and not every:
            return up[:1]
        if every and len(up) == len(endpoints):
            return up
        if time.monotonic() >= deadline:
            if every and up:
                down = ",".join(e for e in endpoints if e not in up)
                raise EtcdError(
                    f"etcd member(s) {down} did not answer in {timeout_s:.0f} s (the others did): see their "
                    "output and etcd logs; a port in use or etcd missing on that node are the usual causes"
                )
            raise EtcdError(
                f"no etcd member of {','.join(endpoints)} answered with a leader in {timeout_s:.0f} s: "
                "start the members (python -m elastic_train.etcd_member) and check that a majority runs"
            )
        time.sleep(0.5)


def _die_with_parent() -> None:
    """In the etcd child: SIGTERM when the wrapper dies, even by SIGKILL, so that no orphaned
    etcd keeps the ports for the next job (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def serve(member: Member, data_dir: Path, token: str, ready_file: Path | None, ephemeral: bool = False) -> int:
    """Run the member until a stop signal (exit 0) or etcd's own exit (non-zero: a member that
    ends by itself has failed). ``ephemeral``: remove the data folder after a clean stop."""
    binary = find_binary()
    version = check_version(binary)
    # etcd logs a line per election and compaction: kept out of the job's output, beside the data
    # folder (etcd warns about unknown files inside it).
    log = data_dir.with_name(data_dir.name + ".log")
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # etcd wants its folder private
        out = log.open("a")
    except OSError as exc:
        raise EtcdError(
            f"cannot create the data folder {data_dir} or its log ({exc}): pass a writable --data-dir"
        ) from exc
    stop = {"signal": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    with out:
        try:
            proc = subprocess.Popen(
                member.command(binary, data_dir, token),
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise EtcdError(f"cannot start {binary} ({exc}): {INSTALL_HINT}") from exc
    died_by_itself = False
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        announced = False
        while not stop["signal"]:
            if proc.poll() is not None:
                died_by_itself = True
                break
            if not announced and healthy(member.client, timeout_s=1.0):
                line = (
                    f"etcd member {member.name} ready on http://{member.client} "
                    f"(etcd {version}, {len(member.cluster)} members)"
                )
                print(line, flush=True)
                if ready_file is not None:
                    ready_file.write_text(line + "\n")
                announced = True
            elif not announced and time.monotonic() > deadline:
                print(
                    f"elastic-train etcd: member {member.name} has no leader after {READY_TIMEOUT_S:.0f} s: "
                    f"is a majority of {','.join(member.cluster)} started? (etcd's log: {log})",
                    file=sys.stderr,
                    flush=True,
                )
                deadline = float("inf")  # said once; it goes on waiting, a late majority still forms
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if not died_by_itself:
        if ephemeral:
            shutil.rmtree(data_dir, ignore_errors=True)
            log.unlink(missing_ok=True)
        return 0
    code = proc.returncode
    how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
    print(f"elastic-train etcd: etcd ended with no stop asked ({how}; its log: {log})", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else (code or 1)  # a member never ends by itself: never 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_train.etcd_member", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action")
    parser.add_argument("--name", help="this member's name, as in --cluster")
    parser.add_argument("--client", help="HOST:PORT agents reach this member at (for example h0:2379)")
    parser.add_argument("--peer", help="HOST:PORT the other members reach this member at (for example h0:2380)")
    parser.add_argument("--cluster", help="every member as NAME=HOST:PORT (peer address), comma-separated")
    parser.add_argument("--data-dir", type=Path, help="this member's folder; kept, so that a restart rejoins")
    parser.add_argument("--token", default="elastic-train", help="the cluster's token: the job's id")
    parser.add_argument("--ready-file", type=Path, default=None)
    parser.add_argument(
        "--ephemeral",
        action="store_true",
        help="remove the data folder and its log after a clean stop (a job's own cluster)",
    )
    chooser = sub.add_parser("pick", help="print the first healthy of comma-separated HOST:PORT endpoints")
    chooser.add_argument("endpoints")
    chooser.add_argument("--timeout", type=float, default=60.0)
    chooser.add_argument("--all", action="store_true", help="wait until every endpoint is healthy; print them all")
    args = parser.parse_args(argv)
    try:
        if args.action == "pick":
            print(",".join(pick([e for e in args.endpoints.split(",") if e], args.timeout, every=args.all)))
            return 0
        required = ("name", "client", "peer", "cluster", "data_dir")
        missing = [f"--{n.replace('_', '-')}" for n in required if not getattr(args, n)]
        if missing:
            raise EtcdError(f"missing {' '.join(missing)}: python -m elastic_train.etcd_member --help shows an example")
        member = Member(args.name, args.client, args.peer, parse_cluster(args.cluster))
        return serve(member, args.data_dir, args.token, args.ready_file, args.ephemeral)
    except EtcdError as exc:
        print(f"elastic-train etcd: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
