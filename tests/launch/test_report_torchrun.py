"""``python -m elastic_train.report`` on the logs of a real two-process torchrun run with a killed
worker: the picture and the summary, restarts included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import RESUME_RUN, dirs, run, torchrun

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.timeout(300)
def test_report_of_a_two_process_run_with_a_killed_worker(tmp_path: Path) -> None:
    done = torchrun(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=1"],
        [*RESUME_RUN, "--log-every", "1", *dirs(tmp_path)],
        env={**AGENT_ENV, "ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=7"},  # after step 4's commit: 5, 6 redone
    )
    assert done.returncode == 0 and "Resumed from" in done.stdout, done.output
    # The per-step curve: every step once, and the recomputed ones (5, 6) once more after the kill.
    from elastic_train import report

    logged = report.load_run(tmp_path / "logs")
    assert sorted(s["step"] for s in logged.steps) == [1, 2, 3, 4, 5, 5, 6, 6, 7, 8], logged.steps
    spans = report.recovery_spans(logged)
    assert [s.kind for s in spans] == ["lost", "redone"] and all(s.end > s.start for s in spans), spans
    out = tmp_path / "report.png"
    made = run([sys.executable, "-m", "elastic_train.report", str(tmp_path / "logs"), "-o", str(out)], timeout=120)
    assert made.returncode == 0, made.output
    assert "Epochs: 2" in made.stdout and "Restarts: 1 (failure: 1)" in made.stdout
    assert "World size: 2 over 2 attempt(s)" in made.stdout and "Goodput: " in made.stdout
    assert f"Report: {out}" in made.stdout
    assert out.stat().st_size > 20_000  # four panels with data, not an empty canvas
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1200, 800)
