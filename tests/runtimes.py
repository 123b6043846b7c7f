"""Stand-in runtimes for the ET_RUNTIME=container and ET_RUNTIME=module tests
(tests/process/test_runtimes.py: building the runtime venv; tests/launch/test_runtimes_train.py:
a first job that trains in it).

The seed guide runs the job in an NGC PyTorch Apptainer image or with EESSI/EasyBuild modules:
a python with torch and torchvision but none of structlog, tenacity, xxhash or a recent
safetensors. The stand-ins rebuild exactly that from this machine's interpreter, without root:

* a python "prefix": a copy of the interpreter binary, the standard library linked in, and a
  site-packages of its own holding pip and nothing else (``python_prefix``);
* the image (``container``): such a prefix whose site-packages also holds torch, torchvision and
  their dependencies, linked from the test venv (``torch_closure``), like the image's system
  site-packages; ``bin/apptainer`` runs ``apptainer exec ... IMAGE CMD`` as CMD with that prefix
  first on a PATH of its own (a container does not see the host's PATH);
* the modules (``module``): ``module`` is a shell function exported to the job, as Lmod's is;
  ``Python/3-stand-in`` puts a bare prefix on PATH, ``PyTorch/2-stand-in`` also puts a directory
  with torch on PYTHONPATH (how EasyBuild modules expose their packages).

pip never reaches a network here: ET_PIP_ARGS points at a wheel directory repacked from the test
venv's installed copies of those packages, and the machine's pip configuration is switched off.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT, Finished, flags, run

# What the runtimes lack (pyproject.toml's dependencies besides torch, torchvision and numpy).
LACKING = ["structlog", "tenacity", "safetensors", "tqdm", "xxhash"]  # xxhash last: see wheels_without_xxhash
TINY = flags(epochs=1, max_steps_per_epoch=2, max_val_samples=64, batch_size=16, target_accuracy=1.0)
# Runs the runtime setup of the job scripts alone, then a probe in the runtime it set up.
PROBE = (
    "set -euo pipefail; ET_PROJECT_DIR=$PWD; source jobs/lib/common.sh; et_setup_runtime; "
    '"${ET_RUN[@]}" python -c "import sys, torch, structlog, xxhash; print(sys.prefix); print(torch.__file__)"'
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def repack_wheel(name: str, out: Path) -> None:
    """The installed distribution ``name`` as a wheel again (its files and its dist-info)."""
    dist = metadata.distribution(name)
    files = [f for f in dist.files or [] if ".." not in f.parts and "__pycache__" not in f.parts]
    site = Path(str(dist.locate_file("")))
    info = next(f for f in files if f.name == "WHEEL")
    tag = next(
        line.split(":", 1)[1].strip() for line in (site / info).read_text().splitlines() if line.startswith("Tag:")
    )
    wheel = out / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for f in files:
            if f.name not in ("INSTALLER", "REQUESTED", "direct_url.json"):
                zf.write(site / f, str(f))


def torch_closure() -> list[Path]:
    """Top-level entries of torch, torchvision and everything they require, in the test venv."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = ["torch", "torchvision"]
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # optional on this platform
        if canonical(name) in seen:
            continue
        seen[canonical(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    assert not {canonical(n) for n in LACKING} & set(seen), "torch now needs a package the runtimes are said to lack"
    tops = {
        Path(str(dist.locate_file(f.parts[0])))
        for dist in seen.values()
        for f in dist.files or []
        if ".." not in f.parts and f.parts[0] != "__pycache__"
    }
    return sorted(tops)


def link_into(directory: Path, entries: list[Path]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        (directory / entry.name).symlink_to(entry)


def python_prefix(root: Path, packages: list[Path]) -> Path:
    """A python installation at ``root`` whose own site-packages holds ``packages``; its site-packages."""
    binary = Path(sys._base_executable).resolve()  # type: ignore[attr-defined]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(binary, root / "bin" / version)
    for alias in ("python3", "python"):
        (root / "bin" / alias).symlink_to(version)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    own = root / stdlib.relative_to(sys.base_prefix)
    link_into(own, [p for p in stdlib.iterdir() if p.name not in ("site-packages", "dist-packages")])
    for lib in Path(sys.base_prefix, "lib").glob("libpython*"):  # when the binary finds it relatively
        link_into(root / "lib", [lib])
    asked = run([str(root / "bin" / "python3"), "-c", "import site; print(site.getsitepackages()[0])"], timeout=30)
    site = Path(asked.stdout.strip())
    assert asked.returncode == 0 and site.is_relative_to(root), asked.output
    pip = metadata.distribution("pip")
    pip_info = next(f for f in pip.files or [] if f.name == "METADATA").parent
    link_into(site, [Path(str(pip.locate_file("pip"))), Path(str(pip.locate_file(pip_info))), *packages])
    return site


@dataclass
class StandIns:
    root: Path
    bin: Path
    image: Path  # the "image file" given as ET_CONTAINER
    image_site: Path
    torch_dir: Path  # what the PyTorch module puts on PYTHONPATH
    wheels: Path
    wheels_without_xxhash: Path

    def env(self, project: Path, runtime: str, **knobs: str) -> dict[str, str]:
        env = {
            "SLURM_SUBMIT_DIR": str(project),
            "ET_RUNTIME": runtime,
            "ET_PIP_ARGS": f"--no-index --find-links {self.wheels}",
            "ET_LOG_DIR": str(project / "logs"),
            "ET_CHECKPOINT_DIR": str(project / "checkpoints"),
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "PIP_CONFIG_FILE": os.devnull,  # this machine's pip.conf adds find-links and indexes
            # Lmod's `module` reaches batch jobs as an exported function, like this one.
            "BASH_FUNC_module%%": f'() {{  eval "$({self.bin}/modulecmd bash "$@")"\n}}',
        }
        if runtime == "container":
            env["ET_CONTAINER"] = str(self.image)
        return {**env, **knobs}

    def calls(self, tool: str) -> list[str]:
        log = self.root / f"{tool}.calls"
        return log.read_text().splitlines() if log.exists() else []


APPTAINER = """#!/usr/bin/env bash
# Stand-in for `apptainer exec [--nv] [--bind DIR] [--pwd DIR] IMAGE CMD...`: the image file names
# a python prefix; CMD runs with its bin/ first on the image's PATH (not the host's), from --pwd.
set -euo pipefail
echo "$*" >> {log}
[ "$1" = exec ] || {{ echo "stand-in apptainer: only 'exec'" >&2; exit 64; }}
shift
workdir=""
while [ $# -gt 0 ]; do
  case $1 in
    --nv) shift ;;
    --bind) shift 2 ;;
    --pwd) workdir=$2; shift 2 ;;
    -*) echo "stand-in apptainer: unexpected option $1" >&2; exit 64 ;;
    *) break ;;
  esac
done
image=$1; shift
PATH="$(cat "$image")/bin:/usr/local/bin:/usr/bin:/bin"; export PATH
[ -z "$workdir" ] || cd "$workdir"
exec "$@"
"""

MODULECMD = """#!/usr/bin/env bash
# Stand-in for Lmod's `modulecmd bash load NAME...`: prints the shell code that loads them.
echo "$*" >> {log}
[ "$2" = load ] || {{ echo "echo 'stand-in module: only load' >&2; false"; exit 0; }}
for name in "${{@:3}}"; do
  case $name in
    Python/3-stand-in) echo 'export PATH={python}/bin:$PATH;' ;;
    PyTorch/2-stand-in)
      echo 'export PATH={python}/bin:$PATH;'
      echo 'export PYTHONPATH={torch}${{PYTHONPATH:+:$PYTHONPATH}};' ;;
    *) echo "echo 'Lmod has detected the following error: unknown module(s): $name' >&2; false;" ;;
  esac
done
"""


def build_stand_ins(root: Path) -> StandIns:
    """The stand-in image, modules and wheel directories, under ``root``."""
    closure = torch_closure()
    image = root / "image.sif"
    image_site = python_prefix(root / "image", closure)
    image.write_text(str(root / "image"))
    python_prefix(root / "python", [])
    link_into(root / "torch", closure)
    wheels, wheels_without_xxhash = root / "wheels", root / "wheels-no-xxhash"
    for directory, names in ((wheels, LACKING), (wheels_without_xxhash, LACKING[:-1])):
        directory.mkdir()
        for name in names:
            repack_wheel(name, directory)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    scripts = {
        "apptainer": APPTAINER.format(log=root / "apptainer.calls"),
        "modulecmd": MODULECMD.format(log=root / "module.calls", python=root / "python", torch=root / "torch"),
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return StandIns(root, bin_dir, image, image_site, root / "torch", wheels, wheels_without_xxhash)


def make_project(tmp_path: Path) -> Path:
    """A project directory of its own (its runtime venvs land in it), sharing the code with ROOT."""
    project = tmp_path / "project"
    link_into(project, [ROOT / "jobs", ROOT / "elastic_train", ROOT / "pyproject.toml"])
    return project


def without_pip_env(args: list[str]) -> list[str]:
    """``args`` with the PIP_* variables of this machine unset (they add wheel directories)."""
    return ["env", *(f"--unset={k}" for k in os.environ if k.startswith("PIP_")), *args]


def job(project: Path, env: dict[str, str], *args: str, timeout: float = 180) -> Finished:
    return run(without_pip_env(["bash", str(project / "jobs" / "train.sbatch"), *args]), timeout=timeout, env=env)


def probe(project: Path, env: dict[str, str], timeout: float = 120) -> Finished:
    return run(without_pip_env(["bash", "-c", PROBE]), timeout=timeout, env=env, cwd=project)


def runtime_venvs(project: Path, kind: str) -> list[Path]:
    return sorted(project.glob(f".venv-{kind}-*"))


def assert_built_over_the_runtime(venv: Path, torch_home: Path, done: Finished) -> None:
    """One venv, holding what the runtime lacked and no torch of its own; the job used it."""
    site = next(venv.glob("lib/python*/site-packages"))
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth"))) == sorted(LACKING)
    stamp = (venv / ".et-runtime-stamp").read_text()
    # torch.__version__ may carry a local part (+cu130) that the distribution's version lacks
    assert re.search(
        rf"torch {re.escape(metadata.version('torch'))}\S* from {re.escape(str(torch_home))}/torch,", stamp
    )
    installed = stamp.split("; pip-installed ")[1].strip().split(", ")
    assert sorted(installed) == sorted(f"{n} {metadata.version(n)}" for n in LACKING), stamp
    assert "pip install --no-deps" in done.stderr and "--find-links" in done.stderr
