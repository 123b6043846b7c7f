"""Goodput bookkeeping: recoveries, lost time, recomputed steps, the summary lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from elastic_train.resilience import goodput
from elastic_train.resilience.goodput import Accounting, ProgressTracker, read_progress


def test_a_recovery_is_counted_and_timed_until_the_run_is_back_where_it_was(tmp_path: Path) -> None:
    acct = Accounting(job_start=time.time() - 100)
    tracker = ProgressTracker(tmp_path, acct, enabled=True)
    failed_at = time.time() - 5
    tracker.begin_recovery(
        "failure", resumed_step=10, previous={"job_start": acct.job_start, "step": 13, "time": failed_at}
    )
    assert acct.restarts == {"failure": 1} and acct.recomputed_steps == 3
    for step in (11, 12):
        tracker.on_step(step)
    assert acct.lost_s == 0.0, "not back at step 13 yet"
    tracker.on_step(13)
    assert 5 <= acct.lost_s < 10
    progress = read_progress(tmp_path)
    assert progress is not None and progress["job_start"] == acct.job_start and progress["step"] >= 11


def test_time_between_launches_is_neither_lost_nor_the_jobs_wall_time(tmp_path: Path) -> None:
    """Ctrl-C at t=100, a rerun launched at t=400 that is back at the step 10 s later: 300 s were
    between launches, 10 s were the recovery's."""
    now = [1000.0]
    acct = Accounting(job_start=now[0] - 100)
    tracker = ProgressTracker(tmp_path, acct, enabled=True, clock=lambda: now[0])
    now[0] += 310
    tracker.begin_recovery(
        "interrupt", resumed_step=7, previous={"job_start": acct.job_start, "step": 7, "time": 1000.0}, away_s=300.0
    )
    tracker.on_step(8)
    assert acct.lost_s == pytest.approx(10.0) and acct.away_s == 300.0
    assert acct.wall(now[0]) == pytest.approx(110.0)  # 100 s before the interrupt, 10 s after
    lines = acct.summary_lines(productive_s=55.0, now=now[0])
    assert lines[0] == "Wall time since job start: 110.000 seconds (300.000 s between launches not counted)"
    assert lines[-1] == "Goodput: 0.50"
    assert Accounting.from_json(json.loads(json.dumps(acct.to_json()))) == acct


def test_summary_lines_and_goodput() -> None:
    now = time.time()
    acct = Accounting(job_start=now - 200, restarts={"failure": 1, "preemption": 2}, lost_s=12.5, recomputed_steps=4)
    lines = acct.summary_lines(productive_s=150.0, now=now)
    assert lines[2] == "Restarts: 3 (failure: 1, preemption: 2)"
    assert lines[3] == "Time lost to recovery: 12.500 seconds" and lines[4] == "Steps recomputed: 4"
    assert lines[5] == "Goodput: 0.75"
    assert Accounting.from_json(json.loads(json.dumps(acct.to_json()))) == acct


def test_a_missing_or_garbled_progress_file_reads_as_none(tmp_path: Path) -> None:
    assert read_progress(tmp_path) is None
    (tmp_path / ".progress.json").write_text("{oops")
    assert read_progress(tmp_path) is None


def test_progress_is_recorded_at_every_step_unless_writes_are_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake clock: the decision depends on measured durations, and a loaded CI machine must not
    # turn a fast write into a slow one (that made this test flaky when it slept on the real clock).
    now = [1000.0]
    tracker = ProgressTracker(tmp_path, Accounting(job_start=now[0]), enabled=True, clock=lambda: now[0])
    for step in range(1, 6):
        now[0] += 0.01  # a 10 ms step; the write itself takes no fake time: fast
        tracker.on_step(step)
        progress = read_progress(tmp_path)
        assert progress is not None and progress["step"] == step  # exact: the next attempt knows
    # A slow filesystem (each write 20 ms: over 2 ms and 5% of a step): throttled after 3 writes.
    real_replace = goodput.os.replace

    def slow_replace(src: str, dst: str) -> None:
        now[0] += 0.02
        real_replace(src, dst)

    monkeypatch.setattr(goodput.os, "replace", slow_replace)
    for step in range(6, 12):
        now[0] += 0.01
        tracker.on_step(step)
    progress = read_progress(tmp_path)
    assert progress is not None and progress["step"] == 8  # 6, 7, 8 were slow; 9-11 inside 0.2 s
    # One slow write in a run of fast ones is a busy disk, not a slow filesystem: no throttle.
    fresh = ProgressTracker(tmp_path, Accounting(job_start=now[0]), enabled=True, clock=lambda: now[0])
    monkeypatch.setattr(goodput.os, "replace", real_replace)
    for step in range(20, 30):
        now[0] += 0.01
        if step == 22:
            monkeypatch.setattr(goodput.os, "replace", slow_replace)
        elif step == 23:
            monkeypatch.setattr(goodput.os, "replace", real_replace)
        fresh.on_step(step)
        progress = read_progress(tmp_path)
        assert progress is not None and progress["step"] == step
