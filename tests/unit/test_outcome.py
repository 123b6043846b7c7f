"""The attempt-outcome contract: one table of exit codes, marker files written by Python and read
by both Python (the next attempt) and the job scripts' shell, and the restart cause."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from elastic_train import ckpt
from elastic_train.outcome import (
    LAUNCH_ID_VAR,
    MEANINGS,
    PREEMPTED_MARKER,
    STOPPED_MARKER,
    ExitCode,
    Marker,
    RestartCause,
    clear_markers,
    hang_marker_name,
    main,
    markdown_table,
    previous_exit_cause,
    read_marker,
    stop_marker,
    write_marker,
    write_marker_best_effort,
)
from elastic_train.resilience.goodput import Accounting, ProgressTracker
from elastic_train.resilience.orphan import ParentWatch
from elastic_train.resilience.preemption import StopKind
from elastic_train.resilience.watchdog import StepWatchdog

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = "4242.3.777.1700000000123456789"  # the form et_new_launch makes


# ------------------------------------------------------------------------------------ the codes


def test_exit_codes_are_unique_and_each_has_a_meaning() -> None:
    values = [int(code) for code in ExitCode.__members__.values()]  # an alias would repeat a value
    assert len(values) == len(set(values)), values
    assert set(MEANINGS) == set(ExitCode)
    assert all(MEANINGS[code].who and MEANINGS[code].then for code in ExitCode)


def test_the_stop_kinds_exit_with_the_contract_codes_and_name_their_cause() -> None:
    assert StopKind.PREEMPT.exit_code is ExitCode.PREEMPTED and StopKind.PREEMPT.cause is RestartCause.PREEMPTION
    assert StopKind.STOP.exit_code is ExitCode.STOPPED and StopKind.STOP.cause is RestartCause.STOP
    with pytest.raises(ValueError, match="no restart cause"):
        _ = StopKind.NONE.cause


def _wait(codes: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_orphan_watch_exits_with_orphaned() -> None:
    codes: list[int] = []
    watch = ParentWatch(rank=0, parent=-1, poll_s=0.05, exit_fn=codes.append)  # -1: never our parent
    watch.start()
    _wait(codes)
    watch.stop()
    assert codes == [ExitCode.ORPHANED]


def test_the_watchdog_writes_its_hang_marker_then_exits_with_hung(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    codes: list[int] = []
    dog = StepWatchdog(0.2, rank=3, poll_s=0.05, marker_dir=tmp_path, exit_fn=codes.append)
    dog.start()
    dog.beat(12, "eval")
    _wait(codes)
    dog.stop()
    assert codes == [ExitCode.HUNG]
    # Where each thread was: the stuck one (here the test's own, in _wait) and the watchdog's.
    err = capfd.readouterr().err
    assert "Current thread" in err and "in _wait" in err and "in _fire" in err, err[-2000:]
    marker = read_marker(tmp_path / hang_marker_name(3))
    assert marker is not None and (marker.cause, marker.rank, marker.step, marker.phase) == (
        RestartCause.HANG,
        3,
        12,
        "eval",
    )
    assert marker.exit_code is ExitCode.HUNG


def test_a_watchdog_without_a_marker_directory_writes_nothing(tmp_path: Path) -> None:
    codes: list[int] = []
    dog = StepWatchdog(0.2, rank=0, poll_s=0.05, exit_fn=codes.append)  # the old constructor
    dog.start()
    _wait(codes)
    dog.stop()
    assert codes == [ExitCode.HUNG] and dog.marker_dir is None and not list(tmp_path.iterdir())


def test_the_checkpoint_tool_exits_with_usage_and_checkpoint_invalid(tmp_path: Path) -> None:
    assert ckpt.main(["verify", str(tmp_path / "missing")]) == ExitCode.USAGE
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / "manifest.json").write_text("{not json")
    assert ckpt.main(["verify", str(folder)]) == ExitCode.CHECKPOINT_INVALID


# ---------------------------------------------------------------------------------- the markers


def test_a_marker_reads_back_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAUNCH_ID_VAR, LAUNCH)
    written = stop_marker(RestartCause.STOP, 9, "SIGTERM", committed=False)
    path = write_marker(tmp_path, written)
    assert path == tmp_path / STOPPED_MARKER and written.launch_id == LAUNCH
    assert read_marker(path) == written
    assert not [p for p in tmp_path.iterdir() if p != path], "a temporary file was left behind"


def test_a_marker_written_before_the_contract_still_reads(tmp_path: Path) -> None:
    old = '{"step": 5, "signal": "SIGUSR1", "committed": true, "time": 1.5, "exit_code": 75, "launch_id": null}'
    (tmp_path / PREEMPTED_MARKER).write_text(old)
    assert read_marker(tmp_path / PREEMPTED_MARKER) == Marker(
        RestartCause.PREEMPTION, 5, 0, time=1.5, launch_id=None, signal="SIGUSR1", committed=True
    )


def test_markers_exist_only_for_preemption_stop_and_hang() -> None:
    with pytest.raises(ValueError, match="no marker for restart cause 'failure'"):
        Marker(RestartCause.FAILURE, 1, 0)
    with pytest.raises(ValueError, match="not 'hang'"):
        stop_marker(RestartCause.HANG, 1, "SIGTERM", True)


def test_a_best_effort_write_that_cannot_succeed_returns_false_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    began = time.monotonic()
    # A failing write returns with it, not after the timeout (bound well below it: loaded CI).
    assert not write_marker_best_effort(blocker, Marker(RestartCause.HANG, 1, 0), timeout_s=10.0)
    assert time.monotonic() - began < 5.0


def _shell(script: str, checkpoint_dir: Path, launch_id: str) -> list[str]:
    """Run ``script`` in bash after sourcing jobs/lib/common.sh, as the job scripts do."""
    env = {**os.environ, "ELASTIC_TRAIN_LAUNCH_ID": launch_id, "ET_CHECKPOINT_DIR": str(checkpoint_dir)}
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source jobs/lib/common.sh; {script}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_shell_reads_the_python_writers_preemption_marker_of_its_own_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCH_ID_VAR, LAUNCH)  # as the job script exports it to the trainer
    write_marker(tmp_path, stop_marker(RestartCause.PREEMPTION, 7, "SIGUSR1", committed=True))
    fields = "launch_id exit_code step signal committed phase"
    script = (
        'echo "$ET_PREEMPTED_MARKER"; et_was_preempted && echo ours; '
        f'for key in {fields}; do et_marker_field "$ET_CHECKPOINT_DIR/$ET_PREEMPTED_MARKER" "$key"; done; '
        'et_marker_field "$ET_CHECKPOINT_DIR/$ET_PREEMPTED_MARKER" missing || echo "no missing"; '
        'rc=1; et_read_preemption; echo "$rc"; echo "$reason"'
    )
    lines = _shell(script, tmp_path, LAUNCH)
    assert lines == [
        PREEMPTED_MARKER,
        "ours",
        LAUNCH,
        str(int(ExitCode.PREEMPTED)),
        "7",
        "SIGUSR1",
        "true",
        "",
        "no missing",
        str(int(ExitCode.PREEMPTED)),  # the job's exit code comes from the marker, not a literal
        "preempted by SIGUSR1 at step 7 (checkpoint committed)",
    ]


def test_the_shell_ignores_a_preemption_marker_of_another_launch(tmp_path: Path) -> None:
    write_marker(tmp_path, Marker(RestartCause.PREEMPTION, 7, 0, launch_id="4242.0.1.2", signal="SIGUSR1"))
    assert _shell("et_was_preempted && echo ours || echo other", tmp_path, LAUNCH) == ["other"]
    clear_markers(tmp_path)
    assert _shell("et_was_preempted && echo ours || echo none", tmp_path, LAUNCH) == ["none"]


# ---------------------------------------------------------------------------- the restart cause

SINCE = 1_000_000.0
FRESH = SINCE + 5  # written after the last progress the next attempt knows of
STALE = SINCE - 60  # written by an earlier attempt


def _marker(kind: str, at: float) -> Marker:
    if kind == "hang":
        return Marker(RestartCause.HANG, 4, 1, time=at, phase="train")
    cause = RestartCause.PREEMPTION if kind == "preempted" else RestartCause.STOP
    return Marker(cause, 4, 0, time=at, signal="SIGUSR1", committed=True)


@pytest.mark.parametrize(
    ("markers", "cause"),
    [
        pytest.param([], RestartCause.FAILURE, id="none"),
        pytest.param([("preempted", FRESH)], RestartCause.PREEMPTION, id="preempted"),
        pytest.param([("stopped", FRESH)], RestartCause.STOP, id="stopped"),
        pytest.param([("hang", FRESH)], RestartCause.HANG, id="hang"),
        pytest.param([("hang", SINCE - 0.5)], RestartCause.HANG, id="hang-within-clock-slack"),
        pytest.param([("stopped", FRESH), ("hang", FRESH)], RestartCause.HANG, id="hang-outranks-stop"),
        pytest.param(
            [("preempted", FRESH), ("hang", FRESH), ("stopped", FRESH)], RestartCause.PREEMPTION, id="preempted-wins"
        ),
        pytest.param([("hang", STALE)], RestartCause.FAILURE, id="stale-hang"),
        pytest.param([("preempted", STALE)], RestartCause.FAILURE, id="stale-preempted"),
        pytest.param([("preempted", STALE), ("stopped", FRESH)], RestartCause.STOP, id="stale-preempted-fresh-stop"),
    ],
)
def test_previous_exit_cause_from_markers_alone(
    tmp_path: Path, markers: list[tuple[str, float]], cause: RestartCause
) -> None:
    for kind, at in markers:
        write_marker(tmp_path, _marker(kind, at))
    assert previous_exit_cause(tmp_path, SINCE) is cause


def test_an_unreadable_marker_is_no_cause(tmp_path: Path) -> None:
    (tmp_path / PREEMPTED_MARKER).write_text('{"step": 3')  # cut short
    (tmp_path / hang_marker_name(2)).write_text("[]")
    assert previous_exit_cause(tmp_path, 0.0) is RestartCause.FAILURE


def test_read_then_clear_books_the_hang_once_and_leaves_other_files(tmp_path: Path) -> None:
    for marker in (_marker("hang", FRESH), _marker("stopped", FRESH), Marker(RestartCause.HANG, 4, 0, time=FRESH)):
        write_marker(tmp_path, marker)
    (tmp_path / f"{PREEMPTED_MARKER}.tmp-123").write_text("{")  # a writer killed mid-write
    (tmp_path / ".progress.json").write_text("{}")
    (tmp_path / "latest").mkdir()
    assert previous_exit_cause(tmp_path, SINCE) is RestartCause.HANG  # read first ...
    clear_markers(tmp_path)  # ... then cleared, as an attempt starts
    assert sorted(p.name for p in tmp_path.iterdir()) == [".progress.json", "latest"]
    assert previous_exit_cause(tmp_path, SINCE) is RestartCause.FAILURE


def test_goodput_books_a_restart_under_the_causes_stored_value(tmp_path: Path) -> None:
    tracker = ProgressTracker(tmp_path, Accounting(job_start=0.0), enabled=False)
    tracker.begin_recovery(RestartCause.HANG, resumed_step=4, previous=None)
    tracker.begin_recovery("hang", resumed_step=4, previous=None)  # as read back from a checkpoint
    assert tracker.accounting.to_json()["restarts"] == {"hang": 2}
    assert f"{RestartCause.PREEMPTION}" == "preemption"
    with pytest.raises(ValueError):
        tracker.begin_recovery("hung", resumed_step=4, previous=None)


# -------------------------------------------------------------------------------------- the docs


def test_the_docs_table_of_exit_codes_is_the_contracts() -> None:
    text = (ROOT / "docs" / "fault-tolerance.md").read_text()
    begin = text.index("<!-- exit-codes:")
    start = text.index("\n", begin) + 1
    end = text.index("<!-- /exit-codes -->", start)
    assert text[start:end] == markdown_table(), "regenerate it: python -m elastic_train.outcome table"


def test_the_table_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["table"]) == ExitCode.OK
    assert capsys.readouterr().out == markdown_table()
    assert main([]) == ExitCode.USAGE
