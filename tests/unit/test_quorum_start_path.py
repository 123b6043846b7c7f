"""What a quorum mode launch does before its first worker starts, kept off torch's import.

Importing torch takes 1.5-2 s on two cores. The launcher used to do it twice before a worker
ran: once itself (a module it imported pulled torch in), once in the Lighthouse (torchft's
console script imports the torchft package, which imports torch). The Lighthouse starts again on
every move of the seat, so its start is also a failover's cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_train.quorum import lighthouse_main
from elastic_train.quorum.lighthouse import Lighthouse
from elastic_train.quorum.names import WARM_ARGV_VAR


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


def test_a_worker_takes_the_forkservers_data_though_its_lighthouse_came_from_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's forkserver opens the task's data once, from the trainer's flags, before the
    first worker; each worker gets the Lighthouse's address in its environment only. A cache
    keyed on the whole configuration missed in every worker, and every replacement opened the
    data again: ~0.5 s of its start, mostly past the Lighthouse's 400 ms, so the survivors
    mostly went on alone first."""
    import torch

    from elastic_train.flags import parse_config
    from elastic_train.quorum import warm

    argv = ["--ft", "quorum", "--max-steps-per-epoch", "2"]
    monkeypatch.setattr(warm, "_cache", None)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setenv(WARM_ARGV_VAR, json.dumps(argv))
    threads = torch.get_num_threads()
    try:
        warm._open()  # what the forkserver runs when it imports the module
    finally:
        torch.set_num_threads(threads)
    assert warm._cache is not None, "the forkserver did not open the data"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")  # what the agent gives each worker
    cfg = parse_config(argv)
    assert cfg.lighthouse == "http://127.0.0.1:29510"
    assert warm.take(cfg) is not None
    assert warm.take(parse_config([*argv, "--seed", "7"])) is None, "another run's flags must not take this data"
