"""torchft's Lighthouse, run as a script: ``python lighthouse_main.py --bind=HOST:PORT ...``.

Why not ``torchft_lighthouse``: that console script imports ``torchft._torchft``, and importing
it runs the ``torchft`` package's ``__init__``, which imports torch: 1.8-2 s on two cores before
the Lighthouse listens (measured), on the launch's critical path and again on every move of the
seat (--lighthouse-etcd). The Lighthouse itself is Rust inside that one extension module, which
links nothing of torch's, so this script loads the module from its file alone: ~20 ms.

It is a file run by path, with no interpreter flags, because the Lighthouse parses the
process's own argv (Rust's ``std::env::args``), skipping only the interpreter: argv[1] must be
this script, then the Lighthouse's flags. Standard library only (it runs before any import of
the package).

When ``STARTER_VAR`` names the process that started it (Linux), it first asks for SIGKILL when
that process's thread exits (``PR_SET_PDEATHSIG``) and exits if the starter is already gone:
a Lighthouse never outlives the agent that supervises it, even one SIGKILLed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

STARTER_VAR = "ELASTIC_TRAIN_LIGHTHOUSE_STARTER"
PR_SET_PDEATHSIG = 1


def die_with_starter(starter: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
    if os.getppid() != starter:  # it died before the request above: nobody supervises this one
        sys.exit(0)


def extension() -> Path | None:
    """torchft's compiled module (``torchft/_torchft*.so``), found without importing torchft."""
    spec = importlib.util.find_spec("torchft")  # a top-level package: located, not executed
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = Path(folder) / f"_torchft{suffix}"
            if candidate.is_file():
                return candidate
    return None


def load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
    spec = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main() -> int:
    starter = os.environ.pop(STARTER_VAR, "")
    if starter and sys.platform == "linux":
        die_with_starter(int(starter))
    path = extension()
    if path is None:  # another layout (a newer torchft?): the package's own way, torch and all
        from torchft._torchft import lighthouse_main  # type: ignore[import-not-found]
    else:
        lighthouse_main = load(path).lighthouse_main
    return int(lighthouse_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
