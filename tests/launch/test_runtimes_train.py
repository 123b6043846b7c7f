"""ET_RUNTIME=container and ET_RUNTIME=module on a first submission: jobs/train.sbatch builds a venv
over the stand-in runtime (tests/runtimes.py), trains under torchrun in it, and a later job
reuses it as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtimes import (
    TINY,
    StandIns,
    assert_built_over_the_runtime,
    job,
    probe,
    runtime_venvs,
)


@pytest.mark.timeout(300)
def test_container_first_job_builds_a_venv_over_the_image_and_trains_and_later_jobs_reuse_it(
    stand_ins: StandIns, project: Path
) -> None:
    env = stand_ins.env(project, "container", ET_NPROC="1")
    done = job(project, env, *TINY)
    assert done.returncode == 0, done.output
    assert "Training completed successfully." in done.stdout
    (venv,) = runtime_venvs(project, "container")
    assert_built_over_the_runtime(venv, stand_ins.image_site, done)
    # Everything ran inside the "image", the launch through the venv's torchrun.
    launch = [c for c in stand_ins.calls("apptainer") if "torchrun" in c and str(project) in c]
    assert launch and str(venv) in launch[-1] and "-m elastic_train" in launch[-1]

    # A requeue, or the next job: the same venv, as it is, without pip.
    stamp = venv / ".et-runtime-stamp"
    built = stamp.stat().st_mtime_ns
    again = probe(project, env)
    assert again.returncode == 0, again.output
    assert f"runtime venv {venv} reused" in again.stderr and "pip install" not in again.stderr
    assert runtime_venvs(project, "container") == [venv] and stamp.stat().st_mtime_ns == built
    prefix, torch_file = again.stdout.split()
    assert Path(prefix) == venv and Path(torch_file) == stand_ins.image_site / "torch" / "__init__.py"


@pytest.mark.timeout(300)
def test_module_first_job_builds_a_venv_over_the_modules_and_trains_and_later_jobs_reuse_it(
    stand_ins: StandIns, project: Path
) -> None:
    env = stand_ins.env(project, "module", ET_MODULES="PyTorch/2-stand-in", ET_NPROC="1")
    done = job(project, env, *TINY)
    assert done.returncode == 0, done.output
    assert "Training completed successfully." in done.stdout
    (venv,) = runtime_venvs(project, "module")
    assert_built_over_the_runtime(venv, stand_ins.torch_dir, done)

    again = probe(project, env)
    assert again.returncode == 0, again.output
    assert f"runtime venv {venv} reused" in again.stderr and "pip install" not in again.stderr
    prefix, torch_file = again.stdout.split()
    assert Path(prefix) == venv and Path(torch_file) == stand_ins.torch_dir / "torch" / "__init__.py"
