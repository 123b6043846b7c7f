"""Any world size from 1 to --batch-size: 64 samples per step over 3 processes (22, 21, 21).

Real trainer runs as plain gloo processes with the environment torchrun would set: 3 processes
train the same samples and make the same update as 1 (the loss weighting at work), and a
checkpoint of 2 processes resumes at 3, a world size that does not divide the global batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from elastic_train.checkpoint.format import step_dir_name
from elastic_train.metrics import MetricSums, index_digest
from elastic_train.models import build_model
from elastic_train.trainer import seed_everything
from tests.helpers import cli, dirs, final_state, flags, read_jsonl, spawn_ranks
from tests.helpers import run_ranks as run_rank_processes

pytestmark = pytest.mark.timeout(300)
# SGD without weight decay: the update is proportional to the gradient, so a mis-weighted loss
# shows (Adam's first step is about lr * sign(gradient), blind to a few percent of scale).
RUN = [
    *flags(batch_size=64, max_steps_per_epoch=3, epochs=2, target_accuracy=1.0, patience=0),
    *flags(optimizer="sgd", weight_decay=0, checkpoint_every=1, keep_last=10),
    "--no-async-checkpoint",
    # 100 of the 1024 validation samples: 34, 33, 33 over 3 processes, each counted once.
    *flags(max_val_samples=100),
]
SEED = 42  # the trainer's default --seed: initial weights


def run_ranks(world: int, base: Path, env: dict[str, str] | None = None) -> list[int]:
    """``world`` rank processes of one run; returns their exit codes (rank 0's output on failure)."""
    results = run_rank_processes(world, [*RUN, *dirs(base)], timeout=200, env=env)
    (base / "rank0.out").write_text(results[0].stdout)
    return [r.returncode for r in results]


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("w1")
    done = cli([*RUN, *dirs(base)], timeout=200)
    assert done.returncode == 0, done.output
    return base


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("w3")
    assert run_ranks(3, base) == [0, 0, 0], (base / "rank0.out").read_text()
    return base


def initial_weights() -> dict[str, torch.Tensor]:
    """The weights every run starts from (the trainer seeds with --seed, then builds the model)."""
    seed_everything(SEED)
    return {f"model.{k}": v for k, v in build_model("vit", 10, 32).state_dict().items()}


def weights_at(base: Path, step: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((base / "ckpt" / step_dir_name(step)).glob("shard-*.safetensors")):
        tensors.update(load_file(shard))
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def update_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """Largest difference between two runs' weights, relative to the largest change of ``want``."""
    assert got.keys() == want.keys() == start.keys()
    change = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert change > 1e-4, "the run barely moved the weights: the comparison would prove nothing"
    return max(float((got[k] - want[k]).abs().max()) for k in want) / change


def test_three_processes_train_the_same_samples_per_epoch_as_one(one: Path, three: Path) -> None:
    single = read_jsonl(one / "logs" / "metrics.jsonl")
    triple = read_jsonl(three / "logs" / "metrics.jsonl")
    assert len(single) == len(triple) == 2
    for a, b in zip(single, triple, strict=True):
        assert (a["samples_seen"], a["sample_digest"], a["val_samples"]) == (
            b["samples_seen"],
            b["sample_digest"],
            b["val_samples"],
        )
        assert a["samples_seen"] == 3 * 64 and b["world_size"] == 3
        assert a["val_samples"] == 100
        # Metric sums count true per-sample losses, whatever the loss weighting did.
        for key in ("train_loss", "val_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4), (key, a[key], b[key])
    out = (three / "rank0.out").read_text()
    assert "Training started with 3 processes" in out
    assert "global batch: 64, per-process batch: 21-22," in out


def test_optimizer_steps_at_three_processes_match_one_process(one: Path, three: Path) -> None:
    # The epoch-end checkpoint after the first 3 steps (every run writes it, whatever the
    # checkpoint timing of mid-epoch saves).
    error = update_error(weights_at(three, 3), weights_at(one, 3), initial_weights())
    # Measured ~1e-6 (float summation order); an unweighted mean of the 22/21/21 shares is ~1e-2 off.
    assert error < 1e-4, f"3 processes differ from 1 process by {error:.2e} of the update"


def test_a_two_process_checkpoint_resumes_at_three_processes_and_trains_the_same_samples(
    tmp_path: Path, one: Path
) -> None:
    # Rank 1 fails at the start of step 6: the synchronous checkpoint of step 5 (mid epoch 2,
    # saved by 2 processes) is the newest; 3 processes take over from it.
    codes = run_ranks(2, tmp_path, env={"ELASTIC_TRAIN_FAULTS": "raise:rank=1:step=6"})
    assert all(code != 0 for code in codes), codes
    assert run_ranks(3, tmp_path) == [0, 0, 0], (tmp_path / "rank0.out").read_text()
    out = (tmp_path / "rank0.out").read_text()
    assert f"Resumed from {tmp_path / 'ckpt' / step_dir_name(5)} at epoch 2, step 5" in out
    assert "per-process batch: 21-22" in out
    ours = [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in read_jsonl(tmp_path / "logs/metrics.jsonl")]
    theirs = [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in read_jsonl(one / "logs/metrics.jsonl")]
    assert ours == theirs, "epoch 2 (2 processes, then 3) must have trained exactly the samples of 1 process"
    final = {k: v for k, v in final_state(tmp_path).items() if k.startswith("model.")}
    reference = {k: v for k, v in final_state(one).items() if k.startswith("model.")}
    assert update_error(final, reference, initial_weights()) < 1e-4


def digest_worker(rank: int, world: int, init_file: str) -> None:
    """Each rank digests its third of range(3000); the all-reduced digest must be the whole's."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mine = MetricSums(torch.device("cpu"))
        mine.add_indices(torch.arange(rank * 1000, (rank + 1) * 1000))
        whole = MetricSums(torch.device("cpu"))
        whole.add_indices(torch.arange(world * 1000))
        reduced = mine.reduce().digest
        assert reduced == whole.digest_hex(), (reduced, whole.digest_hex())
    finally:
        dist.destroy_process_group()


def test_digests_all_reduced_over_ranks_equal_the_digest_of_all_their_indices() -> None:
    parts = [index_digest(torch.arange(r * 1000, (r + 1) * 1000)) for r in range(3)]
    for lane in range(2):  # both lanes' sums over the ranks exceed 2^64: the carries are exercised
        assert sum(int(part[lane]) for part in parts) >= 1 << 64
    spawn_ranks(digest_worker, 3, (), timeout=120)
