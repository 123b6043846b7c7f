"""``python -m elastic_train.etcd_member`` around a real etcd: a stop signal ends both with exit 0
(an ``--ephemeral`` member leaves no data behind), etcd ending on its own is a failure, and a
wrapper SIGKILLed leaves no etcd holding the ports. Needs Debian's etcd-server; skips without it,
unless ELASTIC_TRAIN_REQUIRE_ETCD=1 (set by .ci/run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from elastic_train.testing.etcd import require_etcd
from elastic_train.testing.processes import ROOT, base_env, free_port, kill_group

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def etcd_here() -> None:
    require_etcd()


@contextmanager
def member(tmp: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    client, peer = free_port(), free_port()
    data = tmp / "data"
    ready = tmp / "ready"
    command = [sys.executable, "-m", "elastic_train.etcd_member", "--name", "m0", "--client", f"127.0.0.1:{client}"]
    command += ["--peer", f"127.0.0.1:{peer}", "--cluster", f"m0=127.0.0.1:{peer}", "--data-dir", str(data)]
    command += ["--ready-file", str(ready), *extra]
    proc = subprocess.Popen(
        command, env=base_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        yield proc, data
    finally:
        kill_group(proc)
        proc.wait()


def etcd_of(data: Path) -> list[int]:
    """The etcd processes serving ``data`` (their command line names it; the wrapper's does too)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"etcd") and str(data).encode() in argv and running(int(entry)):
            found.append(int(entry))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait a while for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_stop_signal_ends_member_and_etcd_with_0_and_an_ephemeral_member_leaves_nothing(tmp_path: Path) -> None:
    with member(tmp_path, "--ephemeral") as (proc, data):
        (pid,) = etcd_of(data)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "etcd member m0 ready on http://127.0.0.1:" in out
    assert not running(pid), "etcd outlived its member"
    assert not data.exists() and not data.with_name("data.log").exists()


def test_etcd_ending_by_itself_is_a_failure_and_keeps_its_data(tmp_path: Path) -> None:
    with member(tmp_path, "--ephemeral") as (proc, data):
        (pid,) = etcd_of(data)
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "etcd ended with no stop asked (killed by signal 9" in err
    assert data.exists(), "a failed member's data is evidence: kept"


def test_a_killed_member_leaves_no_etcd_holding_its_ports(tmp_path: Path) -> None:
    with member(tmp_path) as (proc, data):
        (pid,) = etcd_of(data)
        os.kill(proc.pid, signal.SIGKILL)  # the wrapper only: its etcd child is told by the kernel
        proc.wait()
        deadline = time.monotonic() + 15
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid), "etcd outlived its SIGKILLed member"
