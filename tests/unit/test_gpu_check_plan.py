"""What ``make gpu-check`` runs on a machine with 0, 1 or 2+ GPUs, and how it reports it.

The checks themselves need GPUs (their CPU smoke mode runs in tests/launch/test_gpu_check.py);
here the GPU count is stubbed and the checks replaced by recorders, so the choice of what runs,
what is skipped and why, the table and the exit code are tested on any machine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import CHECKS, Result, Where

ONE_GPU = [s.name for s in CHECKS if s.processes == 1]
TWO_GPU = [s.name for s in CHECKS if s.processes == 2]


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[Where]:
    """Every check replaced by one that records where it was asked to run and passes."""
    calls: list[Where] = []

    def record(where: Where) -> tuple[bool, str]:
        calls.append(where)
        return True, "recorded"

    monkeypatch.setattr(gpu_check, "CHECKS", [dataclasses.replace(s, run=record) for s in CHECKS])
    return calls


def _stub_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(gpu_check, "visible_gpus", lambda: count)


def test_there_are_two_gpu_checks_for_what_a_world_of_one_cannot_show() -> None:
    assert ONE_GPU == ["nccl-bf16", "nccl-fp16", "async-save", "kill-resume", "throughput", "fsdp"]
    assert TWO_GPU == ["nccl-bf16-2gpu", "async-save-2gpu", "kill-resume-2gpu", "fsdp-2gpu"]


def test_with_no_gpu_every_check_is_skipped_and_the_last_line_says_nothing_was_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ran: list[Where], tmp_path: Path
) -> None:
    _stub_gpus(monkeypatch, 0)
    code = gpu_check.main(["--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert code == 0 and ran == []
    for name in ONE_GPU + TWO_GPU:
        assert f"| {name} | skipped | 0.0 | skipped: no GPU |" in out, out
    assert out.splitlines()[-1] == "gpu-check skipped: no GPU (10 of 10 checks skipped: nothing was checked)"
    rows = json.loads((tmp_path / "out.json").read_text())["checks"]
    assert {r["result"] for r in rows} == {"skipped"}


def test_with_one_gpu_the_one_gpu_checks_run_and_the_two_gpu_checks_say_why_they_were_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ran: list[Where]
) -> None:
    _stub_gpus(monkeypatch, 1)
    code = gpu_check.main([])
    out = capsys.readouterr().out
    assert code == 0
    assert [(w.work.name, w.device, w.processes) for w in ran] == [(name, "cuda", 1) for name in ONE_GPU]
    for name in TWO_GPU:
        assert f"| {name} | skipped | 0.0 | skipped: needs 2 GPUs, 1 visible |" in out, out
    assert out.splitlines()[-1] == "gpu-check: 6 passed, 0 failed, 4 skipped"


def test_with_two_or_more_gpus_the_two_gpu_checks_run_two_processes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ran: list[Where]
) -> None:
    _stub_gpus(monkeypatch, 4)
    assert gpu_check.main([]) == 0
    assert [(w.work.name, w.processes) for w in ran] == [(s.name, s.processes) for s in CHECKS]
    assert capsys.readouterr().out.splitlines()[-1] == "gpu-check: 10 passed, 0 failed, 0 skipped"


def test_the_cpu_smoke_mode_skips_nothing_and_needs_no_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ran: list[Where]
) -> None:
    _stub_gpus(monkeypatch, 0)
    assert gpu_check.main(["--device", "cpu", "--only", "async-save-2gpu"]) == 0
    assert [(w.device, w.processes) for w in ran] == [("cpu", 2)]


def test_the_exit_code_counts_failed_checks_and_a_crashing_check_is_a_failed_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def crash(where: Where) -> tuple[bool, str]:
        raise RuntimeError("NCCL error: unhandled system error")

    specs = [
        gpu_check.Spec("fails", 1, lambda w: (False, "ratio 0.5")),
        gpu_check.Spec("crashes", 1, crash),
        gpu_check.Spec("passes", 1, lambda w: (True, "ok")),
        gpu_check.Spec("wide", 2, lambda w: (True, "ok")),
    ]
    results = gpu_check.run_checks(specs, "cuda", 1, tmp_path, quick=False)
    assert [r.result for r in results] == [Result.FAIL, Result.FAIL, Result.PASS, Result.SKIPPED]
    assert results[1].detail == "RuntimeError: NCCL error: unhandled system error"
    assert gpu_check.summary(results) == "gpu-check: 1 passed, 2 failed, 1 skipped"


def test_the_async_save_probe_fails_when_rank_1_wrote_nothing_of_its_own() -> None:
    rank0 = {"rank": 0, "device": "cuda:0", "committed": True, "tensors": 9, "wrote": 9, "differ": []}
    rank1 = {"rank": 1, "device": "cuda:1", "committed": True, "tensors": 9, "wrote": 0, "differ": []}
    ok, detail = gpu_check.judge_probe([rank0, rank1])
    assert not ok and "rank 1 on cuda:1 wrote no tensors" in detail
    ok, detail = gpu_check.judge_probe([rank0, {**rank1, "wrote": 4}])
    assert ok and detail == "equal: 9 tensors (rank 0 wrote 9 from cuda:0, rank 1 wrote 4 from cuda:1)"
    assert not gpu_check.judge_probe([rank0, {**rank1, "wrote": 4, "differ": ["model.w"]}])[0]
    assert not gpu_check.judge_probe([{**rank0, "committed": False}])[0]


def test_the_json_file_it_writes_is_what_make_bench_renders_into_the_docs(
    monkeypatch: pytest.MonkeyPatch, ran: list[Where], tmp_path: Path
) -> None:
    from benchmarks import suite

    _stub_gpus(monkeypatch, 1)
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--json", str(out)])
    run = json.loads(out.read_text())
    run["notes"] = ["measured beside it"]
    page = suite.gpu_table(run)
    assert page.startswith(f"Run on {run['where']}:")
    assert "| nccl-bf16 | pass |" in page and "| fsdp-2gpu | skipped |" in page
    assert page.endswith("measured beside it")
    # The file kept in benchmarks/results renders too (it was written by hand from a GPU run).
    kept = json.loads((Path(suite.ROOT) / "benchmarks" / "results" / "gpu_check.json").read_text())
    assert "| kill-resume | pass |" in suite.gpu_table(kept)


def test_a_finished_fsdp_run_is_extended_by_the_other_shape(tmp_path: Path) -> None:
    """check_fsdp's reshard: a two-GPU run's checkpoint by one GPU process, a one-GPU run's by
    two CPU processes under gloo (the smoke test runs only the first: its CPU run is the costly
    part of ``make test``'s gpu-check test)."""
    bf16 = ["--parallel", "fsdp", "--amp", "--amp-dtype", "bf16"]
    two = gpu_check.fsdp_resume_plan(Where("cuda", 2, tmp_path, quick=False), bf16)
    assert two == (1, "cuda", bf16, "resumed by 1 process (2 -> 1 pieces)")
    one = gpu_check.fsdp_resume_plan(Where("cuda", 1, tmp_path, quick=False), bf16)
    assert one == (2, "cpu", ["--parallel", "fsdp"], "resumed by 2 CPU processes (1 -> 2 pieces, cuda -> cpu)")
