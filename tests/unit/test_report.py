"""``python -m elastic_train.report``: the picture and summary of a run, restarts included, from
written logs (tests/launch/test_report_torchrun.py reports a real torchrun run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from elastic_train import report


def write_run(log_dir: Path, torn_last_line: bool = False) -> None:
    log_dir.mkdir(parents=True)
    epochs = [
        {"epoch": e, "world_size": 2, "train_loss": 2.0 / e, "train_acc": 0.3 * e, "val_loss": 2.1 / e,
         "val_acc": 0.3 * e, "throughput": 100.0 + e, "step": 4 * e}
        for e in (1, 2, 3)
    ]  # fmt: skip
    epochs.insert(2, {**epochs[1], "val_acc": 0.0})  # epoch 2 logged twice: the later record wins
    epochs += [{"epoch": None}, {"epoch": 9, "val_acc": None}]  # unusable records are skipped
    (log_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in epochs))
    events = [
        {"event": "start", "rank": 0, "world_size": 2, "timestamp": "2026-11-30T10:00:05Z", "process_started": 1.0e9},
        {"event": "checkpoint_committed", "rank": 0, "timestamp": "2026-11-30T10:00:10Z"},
        {"event": "start", "rank": 0, "world_size": 1, "timestamp": "2026-11-30T10:00:30Z"},
        {"event": "recovery", "rank": 0, "cause": "hang", "timestamp": "2026-11-30T10:00:30Z"},
        {"event": "odd", "rank": 0, "timestamp": None},
        {"event": "done", "rank": 0, "timestamp": "2026-11-30T10:00:59Z"},
        {"event": "done", "rank": 0, "goodput": 0.71, "lost_s": 9.5, "recomputed_steps": 2,
         "timestamp": "2026-11-30T10:01:00Z"},
    ]  # fmt: skip
    text = "".join(json.dumps(e) + "\n" for e in events)
    (log_dir / "rank-0.jsonl").write_text(text + ('{"event": "epoch_en' if torn_last_line else ""))


def test_summary_reads_every_attempt_and_skips_a_torn_line(tmp_path: Path) -> None:
    write_run(tmp_path / "logs", torn_last_line=True)
    lines = report.summary_lines(report.load_run(tmp_path / "logs"))
    assert "Epochs: 3 (last val_acc 0.9000, best 0.9000)" in lines
    assert "World size: 2 -> 1 over 2 attempt(s)" in lines
    assert "Restarts: 1 (hang: 1)" in lines and "Checkpoints committed: 1" in lines
    assert "Goodput: 0.71 (time lost to recovery 9.5 s, steps recomputed 2)" in lines


def test_a_directory_without_metrics_is_refused_with_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err


def test_without_matplotlib_the_summary_prints_and_the_fix_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_run(tmp_path / "logs")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert report.main([str(tmp_path / "logs")]) == 2
    captured = capsys.readouterr()
    assert "Restarts: 1 (hang: 1)" in captured.out
    assert "pip install 'elastic-train[report]'" in captured.err
    assert not (tmp_path / "logs" / "report.png").exists()


def test_a_quorum_run_is_drawn_as_the_quorum_size_with_its_discards_and_heals(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    write_run(log_dir)
    (log_dir / "rank-0.jsonl").unlink()  # quorum mode writes replica_N.jsonl instead

    def line(event: str, second: int, **fields: object) -> str:
        return json.dumps({"event": event, "timestamp": f"2026-11-30T10:00:{second:02d}Z", **fields}) + "\n"

    (log_dir / "replica_0.jsonl").write_text(
        line("quorum_changed", 1, world=2)
        + line("discarded", 9, step=7)
        + line("quorum_changed", 10, world=1)
        + line("quorum_changed", 13, world=2)
        + line("checkpoint_committed", 20, step=12)
        + line("done", 21, goodput=0.61, lost_s=3.5, recomputed_steps=2)
    )
    (log_dir / "replica_1.jsonl").write_text(
        line("quorum_changed", 1, world=2)
        + line("healed", 12, from_step=0, to_step=9)
        + line("quorum_changed", 13, world=2)
    )
    run = report.load_run(log_dir)
    assert [size for _, size in run.quorum] == [2, 1, 2]
    lines = report.summary_lines(run)
    assert "Quorum size: 2 -> 1 -> 2 (2 membership change(s))" in lines
    assert "Attempts discarded: 1; workers healed from a peer: 1" in lines and "Checkpoints committed: 1" in lines
    # Finished, with its goodput, and the time axis from the job's first event, not the clock's 0.
    assert "Goodput: 0.61 (time lost to recovery 3.5 s, steps recomputed 2)" in lines
    assert run.origin == report.parse_timestamp("2026-11-30T10:00:01Z")
    pytest.importorskip("matplotlib")
    assert report.main([str(log_dir), "-o", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0
