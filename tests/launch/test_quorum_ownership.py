"""The quorum agent's Lighthouse is its own, and a quorum is one job's (issue 17, point 6).

Real agents (``python -m elastic_train.quorum.launch``): a port another process holds is refused
at once (no workers, no restart loop); a SIGKILLed agent takes its Lighthouse with it; two jobs
pointed at one Lighthouse refuse each other's replicas instead of training or healing together.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_train.outcome import ExitCode
from elastic_train.quorum.lighthouse import Lighthouse, LighthouseConfig
from tests.helpers import BIN, ROOT, TOKEN_VAR, base_env, kill_tagged, pid_alive

AGENT = [str(BIN / "python"), "-m", "elastic_train.quorum.launch", "--nproc-per-node", "1", "--max-restarts", "0"]
TRAIN = [
    "--epochs",
    "1",
    "--max-steps-per-epoch",
    "40",
    "--batch-size",
    "32",
    "--target-accuracy",
    "1.0",
    "--max-val-samples",
    "64",
]
LIGHTHOUSE = re.compile(r"Lighthouse at \S+ \(pid (\d+)\)")


def wait_for(what: str, condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never saw {what} within {timeout}s"
        time.sleep(0.1)


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    """The tests' environment; everything that carried its token is reaped at the end."""
    env = base_env()
    try:
        yield env
    finally:
        kill_tagged(env[TOKEN_VAR])


def agent_command(base: Path, *ours: str) -> list[str]:
    dirs = ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt")]
    return [*AGENT, *ours, "-m", "elastic_train", *TRAIN, *dirs]


def test_an_agent_whose_lighthouse_port_is_held_by_another_process_exits_2_naming_the_fix(
    tmp_path: Path, env: dict[str, str]
) -> None:
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        port = foreign.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            agent_command(tmp_path, "--lighthouse-port", str(port)),
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert done.returncode == ExitCode.USAGE, done.stdout + done.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr and "--lighthouse-port" in done.stderr
    assert "worker pid" not in done.stdout  # no worker was started, nothing restarted
    assert time.monotonic() - started < 30


def test_a_sigkilled_agent_leaves_no_lighthouse_process_behind(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "agent.out"
    with out.open("wb") as sink:
        agent = subprocess.Popen(
            agent_command(tmp_path), env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for("the Lighthouse's pid", lambda: LIGHTHOUSE.search(out.read_text()), timeout=120)
        match = LIGHTHOUSE.search(out.read_text())
        assert match is not None
        lighthouse = int(match.group(1))
        assert pid_alive(lighthouse)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        wait_for(f"the Lighthouse (pid {lighthouse}) to exit", lambda: not pid_alive(lighthouse), timeout=15)
    finally:
        agent.kill()
        agent.wait()


def test_two_jobs_sent_to_one_lighthouse_refuse_each_other_instead_of_training_together(
    tmp_path: Path, env: dict[str, str]
) -> None:
    # min_replicas 2: the first quorum holds one replica of each job (the case to refuse).
    config = LighthouseConfig(min_replicas=2, heartbeat_timeout_ms=3000)
    with Lighthouse(config, log=tmp_path / "lighthouse.log", env=env) as lighthouse:
        jobs = {}
        for name in ("job-a", "job-b"):
            base = tmp_path / name
            base.mkdir()
            jobs[name] = subprocess.Popen(
                agent_command(base, "--lighthouse", lighthouse.address, "--run-id", name),
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        outputs = {name: proc.communicate(timeout=240)[0] for name, proc in jobs.items()}
    for name, proc in jobs.items():
        assert proc.returncode == ExitCode.USAGE, outputs[name]
        other = "job-b" if name == "job-a" else "job-a"
        assert re.search(rf"replica@{other}@1_0:\S+ \(another job\)", outputs[name]), outputs[name]
        assert not any((tmp_path / name / "ckpt").glob("step-*"))  # nothing was trained


def test_more_replica_groups_than_samples_in_a_global_batch_exit_2_at_the_first_attempt(
    tmp_path: Path, env: dict[str, str]
) -> None:
    # Three groups with restarts allowed; the later --batch-size wins over TRAIN's.
    command = [*agent_command(tmp_path, "--nproc-per-node", "3", "--max-restarts", "2"), "--batch-size", "2"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == ExitCode.USAGE, done.stdout + done.stderr
    assert "3 replica groups cannot share a global batch of 2" in done.stdout + done.stderr
    assert "--batch-size 3 or more" in done.stdout + done.stderr
    assert "(restart 1)" not in done.stdout, "a usage error was retried"
    assert not list(tmp_path.glob("ckpt/step-*")), "nothing trains"
