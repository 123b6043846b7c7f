"""ET_RUNTIME=container and ET_RUNTIME=module: the job scripts' runtime setup on its own (venv
built once by concurrent jobs, offline builds, refusals), with the stand-in runtimes of
tests/runtimes.py (tests/launch/test_runtimes_train.py trains in them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ROOT, run
from tests.runtimes import StandIns, probe, runtime_venvs


@pytest.mark.timeout(180)
def test_jobs_starting_together_build_one_runtime_venv_and_both_use_it(stand_ins: StandIns, project: Path) -> None:
    env = stand_ins.env(project, "module", ET_MODULES="PyTorch/2-stand-in")
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: probe(project, env), range(2))
    assert first.returncode == 0 and second.returncode == 0, first.output + second.output
    (venv,) = runtime_venvs(project, "module")  # and no .tmp-* copy left behind
    assert {first.stdout.split()[0], second.stdout.split()[0]} == {str(venv)}
    logs = first.stderr + second.stderr
    assert logs.count("first job with this module") == 2, logs  # both really built
    assert logs.count(f"runtime venv {venv} ready (built ") == 1, logs
    assert logs.count(f"runtime venv {venv} was built meanwhile by another job: using that one") == 1, logs


@pytest.mark.timeout(120)
def test_an_offline_build_missing_a_wheel_fails_naming_the_package_and_the_fix(
    stand_ins: StandIns, project: Path
) -> None:
    env = stand_ins.env(
        project,
        "module",
        ET_MODULES="PyTorch/2-stand-in",
        ET_PIP_ARGS=f"--no-index --find-links {stand_ins.wheels_without_xxhash}",
    )
    done = probe(project, env)
    assert done.returncode == 2, done.output
    assert "pip could not install safetensors>=0.4, structlog>=24.1, tenacity>=8.2, xxhash>=3.4" in done.stderr, (
        done.stderr
    )
    assert "pip download --no-deps --only-binary=:all: --python-version" in done.stderr
    assert 'ET_PIP_ARGS="--no-index --find-links /path/to/WHEELS"' in done.stderr
    assert "nothing was left behind" in done.stderr and not list(project.glob(".venv-*"))


@pytest.mark.timeout(120)
def test_runtimes_without_torch_or_with_unknown_modules_are_refused_with_a_hint(
    stand_ins: StandIns, project: Path
) -> None:
    done = probe(project, stand_ins.env(project, "module", ET_MODULES="Python/3-stand-in"))
    assert done.returncode == 2, done.output
    assert "torch is not importable in this runtime" in done.stderr and "ET_MODULES" in done.stderr
    assert not list(project.glob(".venv-*"))
    done = probe(project, stand_ins.env(project, "module", ET_MODULES="PyTorch/9-typo"))
    assert done.returncode == 2 and "module load PyTorch/9-typo failed" in done.stderr, done.output
    assert "module spider PyTorch" in done.stderr


@pytest.mark.timeout(60)
def test_a_torch_installed_into_the_runtime_venv_is_refused(stand_ins: StandIns, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    made = run(
        [
            str(stand_ins.root / "image" / "bin" / "python3"),
            "-m",
            "venv",
            "--system-site-packages",
            "--without-pip",
            str(venv),
        ],
        timeout=30,
    )
    assert made.returncode == 0, made.output
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("__version__ = '0.0'\n")
    (site / "torch-0.0.dist-info").mkdir()
    (site / "torch-0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 0.0\n")
    done = run(
        [str(venv / "bin" / "python"), str(ROOT / "jobs" / "lib" / "runtime_venv.py"), "check", str(ROOT)], timeout=30
    )
    assert done.returncode == 2, done.output
    assert f"torch got installed into {venv}: a second copy next to the runtime's" in done.stderr
