"""The make targets the docs name exist and expand (``make -n``: nothing is built or run)."""

from __future__ import annotations

from tests.helpers import run


def test_make_targets_exist() -> None:
    for target in ("demo", "test", "bench", "lint", "gpu-check"):
        done = run(["make", "-n", target], timeout=30)
        assert done.returncode == 0, done.output
