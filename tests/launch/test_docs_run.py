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
        # The launchers train on their own, in folders of their own (they would find the run above finished).
        if words[0] == "torchrun":
            cwd, argv = tmp_path / "torchrun", [str(BIN / "torchrun"), *words[1:]]
        else:
            own = {"elastic_train.launch": "launch", "elastic_train.quorum.launch": "quorum"}
            cwd = tmp_path / own[words[2]] if words[2] in own else tmp_path
            argv = [sys.executable, *words[1:]]
        cwd.mkdir(exist_ok=True)
        done = run(argv, timeout=240, cwd=cwd)
        assert done.returncode == 0, f"`{cmd}` failed:\n{done.output}"
    assert (tmp_path / "model.safetensors").stat().st_size > 100_000
    assert (tmp_path / "report.png").stat().st_size > 20_000
    assert (tmp_path / "launch" / "logs" / "metrics.jsonl").is_file()
    assert (tmp_path / "torchrun" / "logs" / "metrics.jsonl").is_file()
    assert (tmp_path / "quorum" / "logs" / "metrics.jsonl").is_file()
