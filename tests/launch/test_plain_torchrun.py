"""Plain ``torchrun`` as users type it: torch's defaults, no environment tweaks.

torchrun's default shares the agent's TCPStore with the workers across rendezvous rounds; a
restarted worker used to meet the previous round's process-group keys and hang (3 of 4 runs of
exactly this command before the fix, see elastic_train/distributed/round.py). These runs must
recover every time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.helpers import Finished, flags, free_port, read_jsonl, torchrun

TINY = flags(batch_size=8, max_steps_per_epoch=8, epochs=1, target_accuracy=1.0, image_size=16, checkpoint_every=2)
# Three crashes per run, so every run restarts its workers 3 times on
# torchrun's shared store (a fault fires once per run; --max-restarts=3 allows exactly these).
CRASHES = "raise:rank=1:step=3,raise:rank=0:step=5,raise:rank=1:step=7"
# Measured before the fix: 5 of 8, 3 of 5 and 1 of 4 such recoveries succeeded (docs/fault-tolerance.md,
# the torch facts). At the best of those rates, 5/8, a regression passes 9 recoveries in a row by
# chance with probability (5/8)**9 < 1.5%.
RUNS = 3


def dirs(base: Path) -> list[str]:
    return ["--log-dir", str(base / "logs"), "--checkpoint-dir", str(base / "ckpt")]


@pytest.mark.timeout(RUNS * 90)
def test_plain_torchrun_recovers_from_a_crash_every_time_with_the_default_shared_store(tmp_path: Path) -> None:
    seconds = []
    for attempt in range(RUNS):
        base = tmp_path / f"run-{attempt}"
        done = torchrun(
            ["--standalone", "--nproc_per_node=2", "--max-restarts=3"],
            [*TINY, *dirs(base)],
            timeout=120,
            env={"ELASTIC_TRAIN_FAULTS": CRASHES},
        )
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in done.args
        assert done.returncode == 0, f"run {attempt} failed:\n{done.output[-4000:]}"
        assert done.stdout.count("Training started with 2 processes") == 4, done.stdout  # 3 restarts
        assert "Resumed from" in done.stdout, done.stdout
        # A recovery tells its story in a line per failed rank; the tracebacks are in the rank logs.
        assert "Traceback" not in done.output and 3 <= done.stderr.count("elastic-train: rank ") <= 6, done.stderr
        assert "Training completed successfully." in done.stdout, done.stdout
        assert not done.leftovers
        seconds.append(done.seconds)
    print(
        f"{RUNS} of {RUNS} runs recovered 3 times each; seconds per run: min {min(seconds):.1f}, max {max(seconds):.1f}"
    )


@pytest.mark.timeout(300)
def test_two_plain_agents_recover_from_a_killed_worker_with_the_default_shared_store(tmp_path: Path) -> None:
    """Two torchrun agents (one hosting the c10d rendezvous), one worker each; SIGKILL a worker."""
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=plain-two",
    ]
    args = [*flags(batch_size=8, max_steps_per_epoch=6, epochs=2, target_accuracy=1.0, image_size=16), *dirs(tmp_path)]
    env = {"ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=10"}  # after the epoch-end checkpoint commits
    results: dict[str, Finished] = {}

    def agent(name: str, extra: list[str]) -> None:
        results[name] = torchrun([*common, *extra], args, timeout=240, env=env)

    host = threading.Thread(target=agent, args=("host", ["--rdzv-conf=is_host=true"]))
    other = threading.Thread(target=agent, args=("other", ["--rdzv-conf=is_host=false"]))
    host.start()
    time.sleep(0.5)
    other.start()
    host.join()
    other.join()
    for name in ("host", "other"):
        assert name in results, f"agent {name} timed out"
        assert results[name].returncode == 0, f"{name}: {results[name].output[-4000:]}"
    logs = read_jsonl(tmp_path / "logs" / "rank-0.jsonl")
    assert sum(e.get("event") == "start" for e in logs) == 2, "the workers were not restarted exactly once"
    assert any(e.get("event") == "resumed" for e in logs), "the group did not restart from a checkpoint"
    assert any(e.get("event") == "done" for e in logs)
