"""Flag validation: every bad value names the problem and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_train.cli import parse_config
from elastic_train.config import TrainConfig
from elastic_train.data.sampler import per_process_batch
from elastic_train.distributed.env import DistEnv
from elastic_train.errors import UsageError


def test_defaults_train_something_real_without_flags() -> None:
    cfg = parse_config([])
    assert (cfg.model, cfg.dataset, cfg.optimizer) == ("vit", "synthetic", "adamw")
    assert cfg.batch_size >= 2 and cfg.epochs >= 2 and 0 < cfg.target_accuracy <= 1


def test_the_seeds_flags_parse_with_the_seeds_meaning() -> None:
    cfg = parse_config(
        (
            "--model resnet18 --dataset tiny-imagenet --data-dir /d --batch-size 1024 --epochs 100 --optimizer sgd "
            "--base-lr 0.0003 --target-accuracy 0.95 --patience 2 --seed 7 --num-workers 8 --amp"
        ).split()
    )
    assert cfg.model == "resnet18" and cfg.dataset == "tiny-imagenet" and cfg.data_dir == Path("/d")
    assert (cfg.batch_size, cfg.epochs, cfg.base_lr, cfg.patience, cfg.seed) == (1024, 100, 0.0003, 2, 7)
    assert cfg.amp and cfg.num_workers == 8 and cfg.optimizer == "sgd"
    cfg.check_world_size(4)
    assert str(per_process_batch(cfg.batch_size, 4)) == "256"  # the global batch split over 4


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--epochs", "0"], "--epochs 0 must be >= 1"),
        (["--base-lr", "0"], "--base-lr 0.0 must be > 0"),
        (["--base-lr", "-1"], "--base-lr -1.0 must be > 0"),
        (["--target-accuracy", "0"], "outside (0, 1]"),
        (["--target-accuracy", "1.5"], "outside (0, 1]"),
        (["--patience", "-1"], "--patience -1 must be >= 0"),
        (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
        (["--num-workers", "-2"], "--num-workers -2"),
        (["--model", "gpt"], "invalid choice"),
        (["--parallel", "tp"], "invalid choice"),
        (["--parallel", "fsdp", "--amp", "--amp-dtype", "fp16"], "--amp-dtype fp16 with --parallel fsdp"),
        (["--dataset", "cifar"], "invalid choice"),
        (["--optimizer", "lion"], "invalid choice"),
        (["--dataset", "tiny-imagenet"], "needs --data-dir"),
        (["--max-steps-per-epoch", "0"], "must be >= 1"),
        (["--max-val-samples", "0"], "--max-val-samples 0 must be >= 1"),
        (["--epochs", "two"], "invalid int value"),
        (["--keep-best", "-1"], "--keep-best -1 must be >= 0"),
        (["--best-metric", "f1"], "invalid choice: 'f1'"),
    ],
)
def test_bad_flags_raise_a_usage_error_with_a_fix(argv: list[str], problem: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_config(argv)
    assert problem in str(info.value)
    assert "Fix:" in str(info.value)


def test_keep_best_is_off_by_default_and_an_unknown_metric_is_refused_naming_the_choices() -> None:
    cfg = parse_config(["--keep-best", "2", "--best-metric", "val_loss"])
    assert (cfg.keep_best, cfg.best_metric) == (2, "val_loss")
    assert (TrainConfig().keep_best, TrainConfig().best_metric) == (0, "val_acc")
    with pytest.raises(UsageError, match="--best-metric 'f1' is not one of val_acc, train_acc, val_loss, train_loss"):
        TrainConfig(best_metric="f1")  # a library caller, past argparse's choices


def test_a_global_batch_smaller_than_the_world_is_a_usage_error_with_a_fix() -> None:
    with pytest.raises(UsageError, match="world size 4") as info:
        TrainConfig(batch_size=3).check_world_size(4)
    assert "--batch-size 3 is smaller than the world size 4" in str(info.value)
    assert "Fix: use --batch-size 4 or more, or at most 3 processes" in str(info.value)


@pytest.mark.parametrize(("batch", "world"), [(10, 4), (64, 3), (1024, 12), (7, 7), (5, 1)])
def test_any_world_size_up_to_the_global_batch_is_accepted(batch: int, world: int) -> None:
    TrainConfig(batch_size=batch).check_world_size(world)  # no divisibility requirement


def test_the_fingerprint_holds_the_data_order_settings_and_the_dataset_identity() -> None:
    cfg = TrainConfig(batch_size=64, seed=7)
    fp = cfg.fingerprint({"train_samples": 10, "train_content": "10 files, sha256 ab"})
    assert fp["batch_size"] == 64 and fp["seed"] == 7 and fp["model"] == "vit"
    assert fp["data.train_samples"] == 10 and fp["data.train_content"] == "10 files, sha256 ab"
    assert "base_lr" not in fp and "epochs" not in fp, "a resume may change them"
    assert "parallel" not in fp, "a DDP checkpoint resumes under FSDP and back"


def test_changes_since_lists_only_settings_a_resume_may_change() -> None:
    saved = TrainConfig(base_lr=1e-3, epochs=5, patience=3).to_json()
    saved.pop("warmup_steps")  # a setting the checkpoint's version did not know
    now = TrainConfig(base_lr=2e-3, epochs=8, patience=3, warmup_steps=10)
    assert now.changes_since(saved) == {"base_lr": (1e-3, 2e-3), "epochs": (5, 8)}
    assert TrainConfig().changes_since(TrainConfig().to_json()) == {}


def test_env_is_read_once_from_torchrun_variables() -> None:
    env = DistEnv.from_environ(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_RUN_ID": "job7",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.restart_count) == (3, 1, 4, 1, 2)
    assert env.run_id == "job7" and env.launched and not env.is_main and env.is_distributed
    alone = DistEnv.from_environ({})
    assert alone.world_size == 1 and alone.is_main and not alone.launched


@pytest.mark.parametrize(
    "environ",
    [{"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "0"}],
)
def test_inconsistent_launcher_env_is_a_usage_error(environ: dict[str, str]) -> None:
    with pytest.raises(UsageError):
        DistEnv.from_environ(environ)


def test_a_run_dir_holds_the_runs_logs_and_checkpoints_unless_they_are_named() -> None:
    cfg = parse_config(["--run-dir", "runs/first"])
    assert (cfg.log_dir, cfg.checkpoint_dir) == (Path("runs/first/logs"), Path("runs/first/checkpoints"))
    named = parse_config(["--run-dir", "runs/first", "--checkpoint-dir", "/fast/ckpt"])
    assert (named.log_dir, named.checkpoint_dir) == (Path("runs/first/logs"), Path("/fast/ckpt"))
    assert parse_config([]).log_dir == Path("logs")
