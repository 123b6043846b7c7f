"""Example (a): the custom-loop character LM (examples/char_lm.py) in restart mode under elastic
torchrun (its quorum mode, the same loop: tests/launch/test_quorum.py).

``torchrun --nnodes=1:2 --max-restarts=3`` with a worker SIGKILLed mid-epoch: the agent restarts
the group, the loop resumes from its last checkpoint, and the final weights equal those of an
uninterrupted run bit for bit. Only library pieces make that true (sampler position, RNG
streams, the step boundary's agreed saves), nothing in the script but their use.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import step_dir_name
from tests.helpers import BIN, ROOT, elastic_torchrun, run, state_hash

SCRIPT = str(ROOT / "examples" / "char_lm.py")
ARGS = ["--epochs", "2", "--chars", "20000", "--checkpoint-every", "4"]


@pytest.mark.timeout(300)
def test_the_custom_loop_survives_a_killed_worker_and_ends_bit_for_bit_equal(tmp_path: Path) -> None:
    clean = run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node=2",
            SCRIPT,
            *ARGS,
            "--checkpoint-dir",
            str(tmp_path / "a"),
        ],
        timeout=120,
    )
    assert clean.returncode == 0, clean.output[-3000:]
    elastic = elastic_torchrun("char-lm")
    killed = run(
        [*elastic, SCRIPT, *ARGS, "--checkpoint-dir", str(tmp_path / "b")],
        timeout=180,
        env={"ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=11"},  # mid-epoch 1, after the saves of steps 4 and 8
    )
    assert killed.returncode == 0, killed.output[-3000:]
    # Saves are asynchronous: step 8's commits only once every shard is written, which on a busy
    # machine can be after step 11's kill. The resume must be from the newest commit of the
    # first attempt (whose workers are all gone before the agent's second round forms).
    rounds = re.split(r"round_agreed\s+generation=2\b", killed.stderr)
    assert len(rounds) == 2, f"no second rendezvous round after the kill:\n{killed.stderr[-3000:]}"
    committed = [int(s) for s in re.findall(r"checkpoint_committed .* step=(\d+)", rounds[0])]
    assert committed and committed[-1] in (4, 8), f"first attempt committed {committed}:\n{rounds[0][-3000:]}"
    assert f"resumed from {tmp_path / 'b' / step_dir_name(committed[-1])} at step {committed[-1]}\n" in killed.stdout
    assert killed.stdout.count("done") == 1 and not killed.leftovers
    assert state_hash(tmp_path / "b") == state_hash(tmp_path / "a")


README_EXAMPLES = [
    "torchrun --standalone --nproc_per_node=2 -m elastic_train --model torchvision:mobilenet_v3_small "
    "--dataset synthetic --epochs 2 --max-steps-per-epoch 5",
    "torchrun --standalone --nproc_per_node=2 -m elastic_train --task examples.lm_task:task "
    "--epochs 2 --max-steps-per-epoch 5 --target-accuracy 1.0",
]


@pytest.mark.timeout(300)
def test_the_readme_examples_run_verbatim(tmp_path: Path) -> None:
    """The "Train your own model" commands, word for word, each in a scratch folder of its own
    (their checkpoints and logs land there), with the repository importable as a user's would be."""
    documented = (ROOT / "README.md").read_text().replace("\\\n    ", "")
    for i, cmd in enumerate(README_EXAMPLES):
        assert cmd in documented, f"the README no longer shows `{cmd}`"
        cwd = tmp_path / str(i)
        cwd.mkdir()
        words = shlex.split(cmd)
        done = run([str(BIN / "torchrun"), *words[1:]], timeout=200, cwd=cwd, env={"PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, f"`{cmd}` failed:\n{done.output[-3000:]}"
        assert "Training completed successfully." in done.stdout
        assert (cwd / "checkpoints" / "latest").exists() and (cwd / "logs" / "metrics.jsonl").is_file()
