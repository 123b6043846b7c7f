"""Markers by folder (tests/layers.py): tests/unit -> unit, process -> multiprocess, launch ->
torchrun, slurm -> slurm, netns -> netns.

A test file directly in tests/ or in an unknown folder is a collection error, reported like any
other (an exception from ``pytest_collection_modifyitems`` would crash pytest-xdist's workers with
an INTERNALERROR instead of naming the file). A test that carries another layer's marker itself
fails at setup, naming both.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from elastic_train.testing.agents import Agent
from tests.layers import MisplacedTestFile, layer_of, wrong_layer_markers
from tests.runtimes import StandIns, build_stand_ins, make_project

# Property tests judge values, never speed (benchmarks do): no per-example deadline, which a
# loaded 2-core CI machine (two xdist lanes beside multi-process tests) overruns at random.
settings.register_profile("elastic-train", deadline=None)
settings.load_profile("elastic-train")

pytest_plugins = ["pytester"]  # tests/unit/test_layers.py runs pytest on a scratch tree in-process

TESTS = Path(__file__).resolve().parent
_WRONG_LAYER = pytest.StashKey[str]()


class _MisplacedModule(pytest.File):
    """Stands in for a test module outside the layer folders: collecting it is an error."""

    problem: str = ""

    def collect(self) -> list[pytest.Item]:
        raise self.CollectError(self.problem)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if not any(fnmatch.fnmatch(module_path.name, p) for p in parent.config.getini("python_files")):
        return None  # __init__.py or a helper module that pytest was asked to collect: not a test file
    try:
        layer_of(module_path, TESTS)
    except MisplacedTestFile as exc:
        misplaced = _MisplacedModule.from_parent(parent, path=module_path)
        misplaced.problem = str(exc)
        return misplaced
    return None


# The order pytest-xdist hands test files to its lanes (the Makefile turns off its own, which sorts
# files by their number of tests and so put the few-test files that take minutes, such as the
# gpu-check smoke, the docs quick start and the Slurm jobs, last, each alone on a lane while the
# others had run dry): the longest first, the many short unit files last to fill the lanes' ends.
LAYER_ORDER = ("slurm", "launch", "netns", "process", "unit")
# Files placed first in another layer's turn: the two longest single tests (Dec 7), and the second
# Slurm file, which must not run beside the first: every job asks for the node's 2 CPUs, so jobs
# of two files at once would queue behind each other past their tests' waits.
PLACED = {"test_gpu_check.py": "launch", "test_docs_run.py": "launch", "test_slurm_quorum.py": "process"}


def run_order(path: Path) -> tuple[int, int]:
    """Where a test file goes in the run: by layer (or its place), placed files first."""
    if path.name in PLACED:
        return LAYER_ORDER.index(PLACED[path.name]), 0
    layer = layer_of(path, TESTS)
    return (LAYER_ORDER.index(layer.folder) if layer is not None else len(LAYER_ORDER)), 1


# tryfirst: the markers must be on the items before `-m` deselects by them (pytest's own hook).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: run_order(item.path))  # stable: a file's tests keep their order
    for item in items:
        layer = layer_of(item.path, TESTS)
        if layer is None:
            continue
        wrong = wrong_layer_markers({m.name for m in item.iter_markers()}, layer)
        if wrong:
            item.stash[_WRONG_LAYER] = (
                f"{item.nodeid} is marked {', '.join(wrong)} but sits in tests/{layer.folder}/ ({layer.marker}): "
                "layer markers come from the folder; drop the marker or move the test to its layer's folder"
            )
        item.add_marker(layer.marker)


def pytest_runtest_setup(item: pytest.Item) -> None:
    problem = item.stash.get(_WRONG_LAYER, None)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """The torchrun agents a test starts (two-agent harness); each is cleaned up, its processes
    reaped, whatever the outcome."""
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.cleanup()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> StandIns:
    """The stand-in container and module runtimes (tests/runtimes.py), built once per module."""
    return build_stand_ins(tmp_path_factory.mktemp("runtimes"))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project directory of its own (its runtime venvs land in it), sharing the code with ROOT."""
    return make_project(tmp_path)
