"""The documented quick-start commands, run verbatim in one fresh directory: the trainer, the
launcher, plain torchrun, the checkpoint tool and the report (the rules for every documented
command are in tests/unit/test_docs.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import BIN, run
from tests.unit.test_docs import ALL, RUN_HERE


@pytest.mark.timeout(300)
def test_quickstart_commands_run_verbatim(tmp_path: Path) -> None:
    documented = {cmd for _, cmd in ALL}
    for cmd in RUN_HERE:
        assert cmd in documented, f"RUN_HERE lists `{cmd}`, which no doc shows any more"
        words = shlex.split(cmd)
        assert words[0] in ("python", "torchrun")
        # In order, in one folder, as a newcomer types them: each run has a folder of its own.
        argv = [str(BIN / "torchrun"), *words[1:]] if words[0] == "torchrun" else [sys.executable, *words[1:]]
        done = run(argv, timeout=240, cwd=tmp_path)
        assert done.returncode == 0, f"`{cmd}` failed:\n{done.output}"
    assert (tmp_path / "model.safetensors").stat().st_size > 100_000
    assert (tmp_path / "runs" / "taste" / "report.png").stat().st_size > 20_000
    for name in ("taste", "warm", "torchrun", "quorum"):
        assert (tmp_path / "runs" / name / "logs" / "metrics.jsonl").is_file(), name
        assert (tmp_path / "runs" / name / "checkpoints" / "latest").exists(), name
    assert not (tmp_path / "logs").exists() and not (tmp_path / "checkpoints").exists()
