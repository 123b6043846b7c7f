"""Test layers are folders: the folder a test file sits in decides its pytest marker.

A new test file cannot join the fast layer by forgetting a marker: one placed directly in tests/
or in a folder that is no layer fails collection (tests/conftest.py), naming the folders. The
marker names are the ones CI, the Makefile and the docs select with ``-m``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layer:
    folder: str
    marker: str
    holds: str  # what its tests may do, for the error message and the marker's help text


LAYERS = {
    layer.folder: layer
    for layer in (
        Layer("unit", "unit", "this process only: no subprocess, no process group beyond a world of one"),
        Layer(
            "process",
            "multiprocess",
            "subprocesses without torchrun: spawned gloo ranks, `python -m elastic_train`, job-script logic",
        ),
        Layer("launch", "torchrun", "real torchrun: the launcher, the two-agent harness, job scripts that launch"),
        Layer("slurm", "slurm", "real Slurm jobs (need sbatch)"),
        Layer("netns", "netns", "network namespaces on a private bridge (need root and iproute2)"),
    )
}
MARKERS = frozenset(layer.marker for layer in LAYERS.values())


class MisplacedTestFile(ValueError):
    """A test file under tests/ that is not inside a layer folder."""


def layer_of(path: Path, tests: Path) -> Layer | None:
    """The layer of the test file at ``path`` under the ``tests`` folder; None for a file outside it
    (not ours to judge). Raises ``MisplacedTestFile`` for one directly in ``tests`` or in a folder
    that is no layer."""
    try:
        relative = path.resolve().relative_to(tests.resolve())
    except ValueError:
        return None
    if len(relative.parts) > 1 and relative.parts[0] in LAYERS:
        return LAYERS[relative.parts[0]]
    folders = "\n".join(f"  {tests.name}/{f}/  (-m {layer.marker}): {layer.holds}" for f, layer in LAYERS.items())
    raise MisplacedTestFile(
        f"{tests.name}/{relative.as_posix()} is not in a test layer folder. Move it into the folder of the "
        f"heaviest thing its tests do (the folder sets its marker):\n{folders}"
    )


def wrong_layer_markers(markers: set[str], layer: Layer) -> list[str]:
    """The layer markers a test carries itself that contradict its folder's (sorted)."""
    return sorted((markers & MARKERS) - {layer.marker})
