"""What a quorum mode launch does before its first worker starts, kept off torch's import.

Importing torch takes 1.5-2 s on two cores. The launcher used to do it twice before a worker
ran: once itself (a module it imported pulled torch in), once in the Lighthouse (torchft's
console script imports the torchft package, which imports torch). The Lighthouse starts again on
every move of the seat, so its start is also a failover's cost.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from elastic_train.quorum import lighthouse_main
from elastic_train.quorum.lighthouse import Lighthouse


def test_the_quorum_launcher_imports_no_torch() -> None:
    code = (
        "import sys, elastic_train.quorum.launch\n"
        "torch = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "sys.exit(f'imported {torch[:5]}' if torch else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the launcher imported torch modules: {done.stderr.strip()[-500:]}"


def test_the_lighthouse_listens_with_torchfts_extension_alone_not_torch() -> None:
    began = time.monotonic()
    with Lighthouse() as lighthouse:
        took = time.monotonic() - began
        maps = Path(f"/proc/{lighthouse.pid}/maps").read_text()
        cmdline = Path(f"/proc/{lighthouse.pid}/cmdline").read_bytes().split(b"\0")
    assert "_torchft" in maps
    assert "libtorch" not in maps and "torch/lib" not in maps, "the Lighthouse process loaded torch"
    # The Lighthouse parses the process's own argv after the interpreter: the script, then its flags.
    assert cmdline[1].decode() == lighthouse_main.__file__ and cmdline[2].decode().startswith("--bind=")
    assert took < 30  # generous: a loaded CI machine; the point is above, not this bound


def test_the_extension_is_found_without_importing_torchft() -> None:
    code = (
        "import sys; from elastic_train.quorum.lighthouse_main import extension; p = extension(); "
        "print(p); sys.exit(0 if p is not None and 'torchft' not in sys.modules and 'torch' not in sys.modules else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert Path(done.stdout.strip()).name.startswith("_torchft")
