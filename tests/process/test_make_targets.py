"""The make targets the docs name exist and expand (``make -n``: nothing is built or run)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers import ROOT, run


def test_make_targets_exist() -> None:
    for target in ("demo", "test", "bench", "lint", "gpu-check"):
        done = run(["make", "-n", target], timeout=30)
        assert done.returncode == 0, done.output


def test_the_benchmarks_page_renders_from_the_committed_results(tmp_path: Path) -> None:
    """`make bench`'s last step, from benchmarks/results/ as committed: every section renders
    (an optional one only when its results exist), and the page says which targets are met."""
    page = tmp_path / "benchmarks.md"
    done = run(
        [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--render-only", "--out", str(page)], timeout=120
    )
    assert done.returncode == 0, done.output
    text = page.read_text()
    assert "## Goodput under failures" in text and "met" in text
    results = ROOT / "benchmarks" / "results"
    if (results / "goodput-large.json").exists():
        assert "### The same with a large model" in text
    if (results / "heal.json").exists():
        assert "### The heal's transfer alone" in text
    if (results / "goodput-groups.json").exists():
        assert "### Replica groups of 2 workers" in text and "| quorum mode, groups of 2: targets |" in text
