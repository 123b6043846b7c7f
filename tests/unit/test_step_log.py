"""The per-step curve: a line every --log-every steps, best effort, read back by the report."""

from __future__ import annotations

from pathlib import Path

from elastic_train.step_log import StepLog, read_steps


def test_a_line_every_n_steps_with_the_rate_since_the_previous_line(tmp_path: Path) -> None:
    steps = StepLog(tmp_path, every=2, enabled=True, global_batch=32)
    for step in range(1, 7):
        steps.step(step, epoch=1, loss=1.0 / step, lr=0.1, world_size=2)
    steps.close()
    lines = read_steps(tmp_path)
    assert [line["step"] for line in lines] == [2, 4, 6]
    assert lines[0]["samples_per_s"] is None and lines[1]["samples_per_s"] > 0
    assert lines[2]["loss"] == 1.0 / 6 and lines[2]["world_size"] == 2 and lines[2]["lr"] == 0.1


def test_off_on_other_ranks_or_at_0_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    for every, enabled in ((0, True), (5, False)):
        log = StepLog(tmp_path, every=every, enabled=enabled, global_batch=8)
        log.step(5, 1, 0.5, 0.1, 1)
        assert not log.due(5)
    assert read_steps(tmp_path) == []
    (tmp_path / "steps.jsonl").write_text('{"step": 1, "time": 1.0}\n{"step": 2, "ti')
    assert [line["step"] for line in read_steps(tmp_path)] == [1]


def test_a_write_that_fails_never_fails_training(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    log = StepLog(tmp_path / "file" / "logs", every=1, enabled=True, global_batch=8)
    log.step(1, 1, 0.5, 0.1, 1)  # the log folder cannot be created: nothing raised
    log.close()
