"""``make gpu-check`` stays runnable where no GPU is: its CPU smoke mode (gloo, bf16 autocast on the
CPU, tiny runs) goes through every check, so a GPU machine only has to bring the device."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, run

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(600)]


def test_the_gpu_check_script_passes_every_check_in_its_cpu_smoke_mode() -> None:
    done = run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick"], timeout=540)
    assert done.returncode == 0, done.output
    table = done.stdout[done.stdout.index("| check |") :]
    for check in ("nccl-bf16", "nccl-fp16", "async-save", "kill-resume", "throughput"):
        assert f"| {check} | pass |" in table, table
