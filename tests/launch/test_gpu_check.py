"""``make gpu-check`` stays runnable where no GPU is.

Its CPU smoke mode (gloo, bf16 autocast on the CPU, tiny runs) goes through the code that exists
only in the script: the trainer runs and the table, the async-save probe in two torchrun workers
(each writing its result file), and the two-process kill + resume with rank 1 killed (the path
that, on GPUs, kills the process on cuda:1 and tears down an NCCL collective), here under FSDP2,
then that checkpoint resumed by one process.
Not here: the speed ratio (no test on a noisy CPU) and the NCCL/CUDA specifics themselves, which
only a GPU machine can show. What runs with 0, 1 or 2+ GPUs is tests/unit/test_gpu_check_plan.py;
the real no-GPU run is below.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.timeout(600)
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


def _smoke(*checks: str) -> None:
    only = [arg for check in checks for arg in ("--only", check)]
    done = run([sys.executable, SCRIPT, "--device", "cpu", "--quick", *only], timeout=540)
    assert done.returncode == 0, done.output
    table = done.stdout[done.stdout.index("| check |") :]
    for check in checks:
        assert f"| {check} | pass |" in table, table
    assert done.stdout.splitlines()[-1] == f"gpu-check: {len(checks)} passed, 0 failed, 0 skipped", done.stdout


def test_the_gpu_check_script_passes_its_one_and_two_process_checks_in_its_cpu_smoke_mode() -> None:
    # One run of the script for three (each run starts torch and a bf16 probe first); the CPU
    # runs are this suite's costliest test, so each check's code runs once, at its larger shape.
    # kill-resume at world 1: tests/launch/test_checkpoint_torchrun.py; nccl-bf16-2gpu's code is
    # nccl-bf16's at world 2; async-save's is async-save-2gpu's at world 1; kill-resume-2gpu's
    # runs inside fsdp-2gpu (its kill + resume with --parallel fsdp), which adds the resume of
    # its checkpoint by one process; fsdp's is fsdp-2gpu's at world 1, whose resume by two
    # processes is the plan tests/unit/test_gpu_check_plan.py checks.
    _smoke("nccl-bf16", "async-save-2gpu", "fsdp-2gpu")


def test_without_a_gpu_the_gpu_check_reports_every_check_skipped_and_exits_0() -> None:
    done = run([sys.executable, SCRIPT], timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.output
    assert done.stdout.splitlines()[-1] == "gpu-check skipped: no GPU (10 of 10 checks skipped: nothing was checked)"
    assert done.stdout.count("| skipped | 0.0 | skipped: no GPU |") == 10, done.stdout
