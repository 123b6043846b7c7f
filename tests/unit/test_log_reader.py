"""The tests' JSON-lines reader polls logs of running jobs: a record half appended is not yet a
record (CI once failed a partition test on a line read mid-write), but a complete line that does
not parse is still an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_train.testing.processes import read_jsonl


def test_a_record_still_being_appended_is_left_for_the_next_read(tmp_path: Path) -> None:
    log = tmp_path / "replica_0.jsonl"
    whole = json.dumps({"event": "committed", "step": 5})
    log.write_text(whole + "\n" + whole[:20])
    assert read_jsonl(log) == [{"event": "committed", "step": 5}]
    log.write_text(whole + "\n" + whole + "\n")
    assert len(read_jsonl(log)) == 2


def test_a_complete_line_that_does_not_parse_fails(tmp_path: Path) -> None:
    log = tmp_path / "replica_0.jsonl"
    log.write_text('{"event": "commi\n{"event": "committed"}\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(log)
