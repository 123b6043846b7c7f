"""The goodput benchmark's split of a quorum-mode failure (``benchmarks/goodput.py``), on made-up
event logs of both shapes a recovery takes: the survivor goes on alone and the replacement joins
later, or the replacement is already in the quorum that redoes the broken step."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from benchmarks.goodput import split_quorum

T0, T1 = 1_800_000_000.0, 1_800_000_030.0


def write(base: Path, name: str, records: list[tuple[float, dict[str, object]]]) -> None:
    lines = [
        json.dumps({**fields, "timestamp": datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")})
        for t, fields in records
    ]
    (base / "logs").mkdir(exist_ok=True)
    (base / "logs" / name).write_text("\n".join(lines) + "\n")


def test_both_shapes_of_a_recovery_are_split_and_counted(tmp_path: Path) -> None:
    # Kill 1 (replica 0, pid 11): replica 1 discards its attempt; the replacement asks before the
    # Lighthouse drops the dead worker and is in the redo's quorum (world 2 again, heal included).
    # Kill 2 (replica 1, pid 12): replica 0 goes on alone first; the replacement joins a later quorum.
    write(
        tmp_path,
        "replica_1.jsonl",
        [
            (T0 + 0.05, {"event": "discarded", "attempt_s": 0.30}),
            (T0 + 0.80, {"event": "quorum_changed", "world": 2, "previous_world": 2, "discarded": 1, "quorum_s": 0.27}),
            (T1 + 1.10, {"event": "healed", "seconds": 0.12}),
        ],
    )
    write(
        tmp_path,
        "replica_0.jsonl",
        [
            (T0 + 0.40, {"event": "healed", "seconds": 0.17}),
            (T1 + 0.10, {"event": "discarded", "attempt_s": 0.40}),
            (T1 + 0.60, {"event": "quorum_changed", "world": 1, "previous_world": 2, "discarded": 1, "quorum_s": 0.30}),
            (T1 + 1.20, {"event": "quorum_changed", "world": 2, "previous_world": 1, "discarded": 0, "quorum_s": 0.05}),
        ],
    )
    kills = [{"pid": 11, "time": T0}, {"pid": 12, "time": T1}]
    split = split_quorum(tmp_path, kills, {11: 0, 12: 1})
    assert split["detection_s"] == pytest.approx(0.075)
    assert split["reform_s"] == pytest.approx(0.285)  # 0.27 (heal included) and 0.30 (alone)
    assert split["state_transfer_s"] == pytest.approx(0.025)  # 0 (in the redo's quorum) and 0.05
    assert split["recomputation_s"] == pytest.approx(0.35)
    assert split["heal_s"] == pytest.approx(0.145)
    assert split["in_redo_share"] == pytest.approx(0.5)
