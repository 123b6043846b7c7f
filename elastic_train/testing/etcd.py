"""An etcd cluster on loopback for tests and benchmarks: every member a
``python -m elastic_train.etcd_member`` in its own session, on ports free here."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from elastic_train.etcd_member import BINARY_VAR, INSTALL_HINT
from elastic_train.testing.processes import ROOT, base_env, free_port, kill_group

REQUIRE_VAR = "ELASTIC_TRAIN_REQUIRE_ETCD"


def missing() -> str | None:
    """Why an etcd rendezvous cannot run here, or None."""
    if not (os.environ.get(BINARY_VAR) or shutil.which("etcd")):
        return f"no etcd binary: {INSTALL_HINT}"
    if importlib.util.find_spec("etcd") is None:
        return "no python-etcd, the client torch's etcd rendezvous imports: pip install -e '.[dev]'"
    return None


def require_etcd() -> None:
    """Skip the calling test where etcd cannot run, saying why; fail instead under
    ELASTIC_TRAIN_REQUIRE_ETCD=1 (set by .ci/run), where a skip would hide a missing install."""
    import pytest

    problem = missing()
    if problem:
        if os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(f"{REQUIRE_VAR}=1 but {problem}")
        pytest.skip(problem)


@dataclass
class EtcdMember:
    name: str
    client: str
    proc: subprocess.Popen[str]

    def kill(self) -> float:
        """SIGKILL the member (its wrapper and etcd itself, one session), like its host dying."""
        kill_group(self.proc)
        self.proc.wait()
        return time.time()

    def freeze(self) -> float:
        """SIGSTOP the member's session (wrapper and etcd): a frozen host. Its sockets stay open
        and nothing answers; the cluster's other members elect a leader without it."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        return time.time()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def leader(members: Sequence[EtcdMember]) -> EtcdMember:
    """The member that is the cluster's Raft leader now (v2 ``/v2/stats/self``)."""
    import json
    import urllib.request

    for member in members:
        if not member.alive:
            continue
        try:
            with urllib.request.urlopen(f"http://{member.client}/v2/stats/self", timeout=2) as reply:
                if json.loads(reply.read()).get("state") == "StateLeader":
                    return member
        except OSError:
            continue
    raise AssertionError("no etcd member says it is the leader")


@contextmanager
def etcd_cluster(
    tmp: Path,
    size: int = 3,
    token: str = "elastic-train-test",
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Iterator[list[EtcdMember]]:
    """``size`` members on ``host`` (an address of the namespace ``prefix`` enters, e.g.
    ``ip netns exec NS``), yielded once every one reports the cluster ready."""
    ports = [(free_port(), free_port()) for _ in range(size)]  # a fresh namespace has every port free
    cluster = ",".join(f"m{i}={host}:{peer}" for i, (_, peer) in enumerate(ports))
    members: list[EtcdMember] = []
    try:
        for i, (client, peer) in enumerate(ports):
            command = [
                *prefix,
                sys.executable,
                "-m",
                "elastic_train.etcd_member",
                "--name",
                f"m{i}",
                "--client",
                f"{host}:{client}",
                "--peer",
                f"{host}:{peer}",
                "--cluster",
                cluster,
                "--data-dir",
                str(tmp / f"etcd-m{i}"),
                "--token",
                token,
                "--ready-file",
                str(tmp / f"etcd-m{i}.ready"),
            ]
            with (tmp / f"etcd-m{i}.out").open("w") as out:
                proc = subprocess.Popen(
                    command,
                    env=base_env(),
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            members.append(EtcdMember(f"m{i}", f"{host}:{client}", proc))
        deadline = time.monotonic() + 60
        while not all((tmp / f"etcd-{m.name}.ready").exists() for m in members):
            dead = [m.name for m in members if not m.alive]
            assert not dead and time.monotonic() < deadline, f"etcd members not ready (dead: {dead}): " + "".join(
                (tmp / f"etcd-{m.name}.out").read_text()[-500:] for m in members
            )
            time.sleep(0.1)
        yield members
    finally:
        for member in members:
            if member.alive:
                member.kill()
