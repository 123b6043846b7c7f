"""``make gpu-check`` stays runnable where no GPU is: its CPU smoke mode (gloo, bf16 autocast on the
CPU, tiny runs) goes through the checks whose code exists only in the script (the trainer run
and the table, the async-save probe); deterministic kill+resume is what
tests/launch/test_checkpoint_torchrun.py already does on the CPU."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.timeout(600)


def test_the_gpu_check_script_passes_every_check_in_its_cpu_smoke_mode() -> None:
    checks = ("nccl-bf16", "async-save")  # not "throughput": a speed ratio on a noisy CPU is no test
    only = [arg for check in checks for arg in ("--only", check)]
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    done = run([sys.executable, script, "--device", "cpu", "--quick", *only], timeout=540)
    assert done.returncode == 0, done.output
    table = done.stdout[done.stdout.index("| check |") :]
    for check in checks:
        assert f"| {check} | pass |" in table, table
