"""Fill a runtime venv: what a module's or a container's python lacks, never a second torch.

Run by jobs/lib/common.sh (``et_runtime_venv``), inside the runtime, with the python of a venv it
has just made with ``--system-site-packages`` over the runtime's own python (an Apptainer image's,
or the one ``module load`` put on PATH):

    VENV/bin/python jobs/lib/runtime_venv.py setup PROJECT_DIR [PIP_ARG...]

1. reads the runtime dependencies of PROJECT_DIR/pyproject.toml, minus torch and torchvision:
   those must be the runtime's own (a pip-installed torch would not match its CUDA, NCCL and
   drivers, and would be a second multi-GB copy);
2. pip-installs the ones the runtime does not satisfy into the venv, with ``--no-deps`` (nothing
   comes along unasked) and the PIP_ARGs (``ET_PIP_ARGS``, e.g. ``--no-index --find-links DIR``);
3. makes the project importable with a .pth file (what an editable install amounts to, without
   a build backend that an offline cluster would have to fetch);
4. writes ``bin/torchrun``: torch's launcher run by this venv's python, so that the workers it
   starts (``sys.executable``) see the venv too;
5. checks in a fresh interpreter (``check``) that every dependency is satisfied and that torch and
   torchvision are imported from the runtime, not from the venv; then writes the stamp
   (``.et-runtime-stamp``, one line describing the build) last.

Standard library and pip only (pip's vendored ``packaging`` and ``tomli`` when those are not
installed): the runtime's python may be a bare 3.10. Exit status 0, or 2 with one message that
names the problem and the fix.

Limits: the venv is built under a temporary name and renamed into place by the caller, so console
scripts that pip writes into ``bin/`` would name the temporary path (none of our dependencies has
one; the jobs run ``python -m`` and the ``torchrun`` written here, which finds its python
relative to itself).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import importlib.util
import os
import platform
import shlex
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a runtime without packaging still has pip, which vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment,no-redef,unused-ignore]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[assignment,no-redef,unused-ignore]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10 runtimes
    from pip._vendor import tomli as tomllib

STAMP = ".et-runtime-stamp"
# Provided by the runtime, never installed here (see the module docstring).
RUNTIME_PROVIDED = ("torch", "torchvision")
TORCHRUN = """#!/bin/sh
# torchrun of the runtime's torch, run by this venv's python: the workers it starts use the same
# python, so they see the packages installed here (written by jobs/lib/runtime_venv.py).
exec "$(dirname "$0")/python" -m torch.distributed.run "$@"
"""


class SetupError(Exception):
    """A problem with the runtime; the message names it and the fix."""


# Optional dependency groups to install too, comma-separated (jobs/lib/common.sh sets "ft" for
# ET_FT=quorum: torchft and its Lighthouse).
EXTRAS_VAR = "ET_RUNTIME_EXTRAS"


def requirements(project: Path) -> list[Requirement]:
    """The project's runtime dependencies that apply here (plus the extras of ``EXTRAS_VAR``),
    except the runtime-provided ones."""
    with (project / "pyproject.toml").open("rb") as fh:
        project_table = tomllib.load(fh)["project"]
    listed = list(project_table["dependencies"])
    for extra in filter(None, os.environ.get(EXTRAS_VAR, "").split(",")):
        if extra not in project_table.get("optional-dependencies", {}):
            raise SetupError(f"{EXTRAS_VAR}: pyproject.toml has no optional dependency group {extra!r}")
        listed += project_table["optional-dependencies"][extra]
    reqs = [Requirement(text) for text in listed]
    return [r for r in reqs if (r.marker is None or r.marker.evaluate()) and not is_runtime_provided(r.name)]


def is_runtime_provided(name: str) -> bool:
    return canonicalize_name(name) in RUNTIME_PROVIDED


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unsatisfied(reqs: list[Requirement]) -> list[Requirement]:
    """Requirements this interpreter does not meet (missing, or a version outside the range)."""
    missing = []
    for req in reqs:
        version = installed_version(req.name)
        if version is None or not req.specifier.contains(version, prereleases=True):
            missing.append(req)
    return missing


def describe(reqs: list[Requirement]) -> str:
    return ", ".join(str(r) for r in reqs)


def offline_hint(reqs: list[Requirement]) -> str:
    """The commands that bring the wheels to a cluster whose compute nodes cannot reach PyPI."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = f"--python-version {python}"
    if sys.platform.startswith("linux"):
        target += f" --platform manylinux2014_{platform.machine()}"
    wanted = " ".join(shlex.quote(str(r)) for r in reqs)
    return (
        "Without internet on the compute nodes, fetch the wheels where pip reaches PyPI:\n"
        f"    pip download --no-deps --only-binary=:all: {target} -d WHEELS {wanted}\n"
        'copy WHEELS to the cluster and submit with ET_PIP_ARGS="--no-index --find-links /path/to/WHEELS".'
    )


def pip_install(reqs: list[Requirement], pip_args: list[str]) -> None:
    if importlib.util.find_spec("pip") is None:
        raise SetupError(
            f"the runtime's python ({sys.base_prefix}) has no pip, so {describe(reqs)} cannot be installed: "
            "use an image or modules with pip (the NGC images and EESSI's Python have it)"
        )
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check"]
    command += ["--no-warn-script-location", "--progress-bar", "off", *pip_args, *(str(r) for r in reqs)]
    print(f"runtime venv: {shlex.join(command[2:])}", file=sys.stderr, flush=True)
    if subprocess.run(command, stdout=sys.stderr).returncode != 0:
        raise SetupError(
            f"pip could not install {describe(reqs)}, which this runtime (Python {platform.python_version()}, "
            f"{sys.base_prefix}) lacks; pip's own error is above (ET_PIP_ARGS={os.environ.get('ET_PIP_ARGS', '')!r}).\n"
            + offline_hint(reqs)
        )


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def setup(project: Path, pip_args: list[str]) -> None:
    if sys.prefix == sys.base_prefix:
        raise SetupError(f"run this with the python of the runtime venv, not {sys.executable}")
    for name in RUNTIME_PROVIDED:  # found, not imported yet (that takes seconds): before pip, not after
        if importlib.util.find_spec(name) is None:
            raise not_provided(name, f"no module named {name!r}")
    reqs = requirements(project)
    missing = unsatisfied(reqs)
    present = [f"{r.name} {installed_version(r.name)}" for r in reqs if r not in missing]
    print(f"runtime venv: provided by the runtime: {', '.join(present) or 'none'}", file=sys.stderr)
    if missing:
        pip_install(missing, pip_args)
    (site_packages() / "elastic_train_project.pth").write_text(f"{project.resolve()}\n")
    torchrun = Path(sys.prefix) / "bin" / "torchrun"
    torchrun.write_text(TORCHRUN)
    torchrun.chmod(0o755)
    # A fresh interpreter: this one has cached what it saw before pip ran.
    done = subprocess.run([sys.executable, __file__, "check", str(project)], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SetupError("the runtime venv failed its check (above); nothing was kept")
    built = time.strftime("%Y-%m-%d %H:%M:%S")
    installed = ", ".join(f"{r.name} {installed_version(r.name)}" for r in missing) or "nothing"
    (Path(sys.prefix) / STAMP).write_text(
        f"built {built} on {socket.gethostname()}: {done.stdout.strip()}; pip-installed {installed}\n"
    )


def not_provided(name: str, why: object) -> SetupError:
    return SetupError(
        f"{name} is not importable in this runtime ({why}): the image, or ET_MODULES, must provide torch and "
        "torchvision (EESSI/EasyBuild: add the torchvision module next to PyTorch in ET_MODULES)"
    )


def imported_from(name: str) -> tuple[str, Path]:
    """Import ``name`` from the runtime; its version and location."""
    try:
        module: Any = importlib.import_module(name)
    except ImportError as err:
        raise not_provided(name, err) from err
    return str(module.__version__), Path(module.__file__)


def why_unsatisfied(reqs: list[Requirement]) -> str:
    """The likely cause and fix, for requirements that ``unsatisfied`` returned."""
    shadowing = []
    for req in reqs:
        if installed_version(req.name) is not None:
            where = metadata.distribution(req.name).locate_file("")
            shadowing.append(f"{req.name} {installed_version(req.name)} from {where}")
    if not shadowing:
        return "they are missing (build the venv with `setup`, as jobs/lib/common.sh does)"
    return (
        f"older copies come first on sys.path ({', '.join(shadowing)}; "
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}): drop the module or directory that brings them"
    )


def check(project: Path) -> str:
    """Raise SetupError unless this venv is complete and uses the runtime's torch; a summary line."""
    venv = Path(sys.prefix).resolve()
    in_venv = sorted(
        d.metadata["Name"]
        for d in metadata.distributions(path=[str(site_packages())])
        if is_runtime_provided(d.metadata["Name"])
    )
    if in_venv:
        raise SetupError(
            f"{', '.join(in_venv)} got installed into {venv}: a second copy next to the runtime's. "
            "Remove that directory and look in ET_PIP_ARGS and the pip configuration (pip config list) for what "
            "asked for it"
        )
    wrong = unsatisfied(requirements(project))
    if wrong:
        raise SetupError(f"this venv does not satisfy {describe(wrong)}: " + why_unsatisfied(wrong))
    found = []
    for name in RUNTIME_PROVIDED:
        version, where = imported_from(name)
        if where.resolve().is_relative_to(venv):
            raise SetupError(
                f"{name} is imported from the venv ({where}), not from the runtime: remove {venv} and resubmit"
            )
        found.append(f"{name} {version} from {where.parent}")
    try:
        importlib.import_module("elastic_train.run")  # everything the trainer imports resolves
    except ImportError as err:
        raise SetupError(
            f"the trainer does not import in this runtime ({err}): is a dependency missing from pyproject.toml?"
        ) from err
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["setup", "check"])
    parser.add_argument("project", type=Path, help="the project directory (holds pyproject.toml)")
    parser.add_argument("pip_args", nargs=argparse.REMAINDER, help="extra pip arguments (setup)")
    args = parser.parse_args(argv)
    pip_args = args.pip_args[1:] if args.pip_args[:1] == ["--"] else args.pip_args
    try:
        if args.command == "setup":
            setup(args.project, pip_args)
        else:
            print(check(args.project))
    except SetupError as err:
        print(f"ERROR: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
