"""``--parallel fsdp`` under real torchrun: the README's command, a kill, a change of world size.

* The README's FSDP command, word for word, is the reference run. The same run under the
  mission's elastic torchrun (``--nnodes=1:2 --max-restarts=3``, c10d rendezvous) with a worker
  SIGKILLed mid-epoch resumes from its sharded checkpoint and ends bitwise equal: weights and
  optimizer moments (assembled from the pieces), and every epoch's metrics and sample digest.
* A 2-process FSDP run that crashed mid-epoch under torchrun is resumed by 3 processes (32
  samples a step: shares of 11, 11 and 10; every tensor resharded from 2 pieces into 3): every
  sample of every epoch exactly once (the reference's digests), and a checkpoint written in 3 pieces.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from elastic_train.checkpoint.format import read_manifest
from tests.helpers import (
    BIN,
    ROOT,
    assert_bitwise_equal,
    elastic_torchrun,
    epoch_metrics,
    final_state,
    read_jsonl,
    run,
    run_ranks,
)

pytestmark = pytest.mark.timeout(300)

README_FSDP = (
    "torchrun --standalone --nproc_per_node=2 -m elastic_train --run-dir runs/fsdp --parallel fsdp "
    "--batch-size 32 --epochs 2 --max-steps-per-epoch 6"
)


def args_of(cmd: str) -> list[str]:
    """The trainer's flags of a ``torchrun ... -m elastic_train FLAGS`` command."""
    words = shlex.split(cmd)
    return words[words.index("elastic_train") + 1 :]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's command, verbatim, in a scratch folder: its run folder is the reference."""
    documented = (ROOT / "README.md").read_text()
    assert README_FSDP in documented, "the README no longer shows the FSDP command"
    cwd = tmp_path_factory.mktemp("fsdp-reference")
    done = run([str(BIN / "torchrun"), *shlex.split(README_FSDP)[1:]], timeout=200, cwd=cwd)
    assert done.returncode == 0, done.output[-3000:]
    assert "parallel: FSDP2 over 2 processes" in done.stdout and "Training completed successfully." in done.stdout
    return cwd / "runs" / "fsdp"


def layout(base: Path) -> Path:
    """The run folder's checkpoints, under the name ``final_state`` reads."""
    (base / "ckpt").symlink_to(base / "checkpoints")
    return base


def test_a_worker_killed_mid_epoch_under_elastic_torchrun_resumes_its_shards_bitwise(
    tmp_path: Path, reference: Path
) -> None:
    base = tmp_path / "killed"
    cmd = [*elastic_torchrun("fsdp"), "-m", "elastic_train", *args_of(README_FSDP), "--run-dir", str(base)]
    cmd += ["--checkpoint-every", "4"]
    done = run(cmd, timeout=240, env={"ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=10"})  # after step 8's save
    assert done.returncode == 0, done.output[-3000:]
    assert "Resumed from" in done.stdout and "step 8" in done.stdout, done.stdout
    assert "Training completed successfully." in done.stdout and not done.leftovers
    manifest = read_manifest(base / "checkpoints" / "latest")
    assert manifest.version == 4 and manifest.sharded and manifest.world_size == 2
    assert_bitwise_equal(final_state(layout(reference)), final_state(layout(base)))
    assert epoch_metrics(base) == epoch_metrics(reference)


def test_a_crashed_two_process_run_resumed_by_three_sees_every_sample_once(tmp_path: Path, reference: Path) -> None:
    base = tmp_path / "resharded"
    crashed = run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=0",
            "-m",
            "elastic_train",
            *args_of(README_FSDP),
            "--run-dir",
            str(base),
            "--checkpoint-every",
            "4",
        ],
        timeout=200,
        env={"ELASTIC_TRAIN_FAULTS": "kill:rank=0:step=10"},
    )
    assert crashed.returncode != 0 and read_manifest(base / "checkpoints" / "latest").step == 8
    # The resume by 3 forked ranks with torchrun's environment (``run_ranks``): what a restart
    # reads does not depend on the agent (the kill-and-restart under torchrun is the test above),
    # and a third fresh interpreter and an agent cost ~15 s of CPU.
    three = run_ranks(3, [*args_of(README_FSDP), "--run-dir", str(base)], timeout=200)
    assert all(rank.returncode == 0 for rank in three), "\n".join(rank.output[-3000:] for rank in three)
    assert "parallel: FSDP2 over 3 processes" in three[0].stdout and "step 8" in three[0].stdout
    ours = [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in read_jsonl(base / "logs" / "metrics.jsonl")]
    theirs = [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(reference)]
    assert ours == theirs, "a sample was skipped or repeated across the reshard from 2 to 3 processes"
    manifest = read_manifest(base / "checkpoints" / "latest")
    assert manifest.world_size == 3
    weight = manifest.sharded["model.heads.head.weight"]  # 10 rows over 3 ranks
    assert [p.lengths[0] for p in weight.pieces] == [4, 4, 2]
