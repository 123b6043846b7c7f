"""jobs/train.sbatch outside Slurm, running real torchrun: a two-process CPU run, the same in
quorum mode as one replica group of two workers, and the GPU monitor it starts is stopped by pid
even when training fails."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import QUICK, ROOT, pid_alive, run

VENV = Path(sys.prefix)


def sbatch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The script's environment outside Slurm: this checkout, this venv, folders under ``tmp_path``."""
    return {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "ET_VENV": str(VENV),
        "ET_LOG_DIR": str(tmp_path / "logs"),
        "ET_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        **extra,
    }


def fake_nvidia_smi(bin_dir: Path, pid_file: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"echo $$ >> {pid_file}\n"
        "while true; do echo '2026/11/30 00:00:00.000, 0, FakeGPU, 50 %, 10 %, 81920 MiB, 100 MiB'; sleep 0.2; done\n"
    )
    script.chmod(0o755)


@pytest.mark.timeout(240)
def test_train_sbatch_runs_torchrun_with_two_cpu_processes_outside_slurm(tmp_path: Path) -> None:
    done = run(["bash", str(ROOT / "jobs" / "train.sbatch"), *QUICK], timeout=180, env=sbatch_env(tmp_path))
    assert done.returncode == 0, done.output
    assert "Training started with 2 processes" in done.stdout
    assert "Total processes used: 2" in done.stdout and "Training completed successfully." in done.stdout
    assert (tmp_path / "logs" / "metrics.jsonl").is_file()


@pytest.mark.timeout(240)
def test_train_sbatch_in_quorum_mode_runs_replica_groups_of_the_size_asked_for(tmp_path: Path) -> None:
    env = sbatch_env(tmp_path, ET_FT="quorum", ET_NPROC="2")
    odd = run(
        ["bash", str(ROOT / "jobs" / "train.sbatch"), *QUICK], timeout=60, env={**env, "ET_PROCS_PER_REPLICA": "3"}
    )
    assert odd.returncode == 2 and "ET_PROCS_PER_REPLICA=3 does not divide the node's 2 processes" in odd.output
    assert not (tmp_path / "ckpt").exists(), "refused before anything started"
    done = run(
        ["bash", str(ROOT / "jobs" / "train.sbatch"), *QUICK], timeout=180, env={**env, "ET_PROCS_PER_REPLICA": "2"}
    )
    assert done.returncode == 0, done.output
    assert "1 of 1 replica groups of 2 workers (DDP inside)" in done.stdout, done.output
    assert "Total processes used: 2" in done.stdout and "Training completed successfully." in done.stdout


@pytest.mark.timeout(120)
def test_gpu_monitor_is_stopped_by_pid_even_when_training_fails(tmp_path: Path) -> None:
    pid_file = tmp_path / "monitor.pid"
    fake_nvidia_smi(tmp_path / "bin", pid_file)
    env = {
        **sbatch_env(tmp_path),
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
