"""The quorum agent with ``--lighthouse-etcd``, where it meets a newcomer's mistakes: no etcd
answering (exit 1 after ``--lighthouse-wait``, naming the members and the fix, no worker
started, nothing left running), a malformed member list (exit 2), and Ctrl-C while it waits
(exit 130). No etcd needed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from elastic_train.testing.processes import ROOT, base_env, free_port, kill_group, run

pytestmark = pytest.mark.timeout(120)
TRAINER = ["-m", "elastic_train", "--epochs", "1", "--max-steps-per-epoch", "2"]


def agent(*flags: str) -> list[str]:
    return [sys.executable, "-m", "elastic_train.quorum.launch", "--run-id", "seat-agent", *flags, *TRAINER]


def test_no_etcd_answering_ends_the_agent_with_exit_1_naming_the_members_and_the_fix() -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = run(agent("--lighthouse-etcd", dead, "--lighthouse-wait", "3"), timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"no Lighthouse holds its seat in etcd ({dead}) after 3 s" in done.stderr, done.stderr[-2000:]
    assert "--lighthouse-wait" in done.stderr and "etcd_member" in done.stderr
    assert "worker pid" not in done.stdout, "a worker started without a Lighthouse"
    assert not done.leftovers, "the agent left a process behind"
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--lighthouse-etcd", "etcd-host"), "is not HOST:PORT"),
        (("--lighthouse-etcd", "h:2379", "--lighthouse-ttl", "1"), "--lighthouse-ttl) must be at least 2"),
        (("--lighthouse-etcd", "h:2379", "--lighthouse-wait", "0"), "--lighthouse-wait 0"),
    ],
)
def test_bad_seat_settings_exit_2_naming_the_problem(flags: tuple[str, ...], says: str) -> None:
    done = run(agent(*flags), timeout=60)
    assert done.returncode == 2 and says in done.stderr, (done.returncode, done.stderr[-2000:])


def test_ctrl_c_while_waiting_for_the_seat_exits_130() -> None:
    proc = subprocess.Popen(
        agent("--lighthouse-etcd", f"127.0.0.1:{free_port()}", "--lighthouse-wait", "60"),
        env=base_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        time.sleep(5)  # past its imports, into the wait
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err[-2000:]
    finally:
        kill_group(proc)
