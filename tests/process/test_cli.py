"""The command line in one process: the seed's console lines, files written, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import QUICK, SEED_EPOCH_LINE, cli, cli_process, flags, read_jsonl

pytestmark = pytest.mark.timeout(180)


def test_single_process_run_prints_the_seeds_lines_and_writes_logs(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    # QUICK without its validation cap: this run evaluates the whole validation set (1024).
    quick = flags(batch_size=32, max_steps_per_epoch=3, epochs=2, target_accuracy=1.0)
    # A fresh interpreter: the entry point as users type it (the other runs here fork a warm one).
    done = cli_process([*quick, "--log-dir", str(logs), "--checkpoint-dir", str(logs / "ckpt")])
    assert done.returncode == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[0] == "Training started with 1 processes"
    assert lines[1].startswith("Backend: gloo, device: cpu, model: vit")
    epoch_lines = [line for line in lines if line.startswith("Epoch ")]
    assert len(epoch_lines) == 2 and all(SEED_EPOCH_LINE.match(line) for line in epoch_lines), epoch_lines
    # The seed's summary block, then our goodput lines, then the seed's last line.
    tail = lines[lines.index("Training Summary:") :]
    assert tail[1].startswith("Total training time: ") and tail[1].endswith(" seconds")
    assert tail[2].startswith("Throughput: ") and tail[2].endswith(" images/second")
    assert tail[3:5] == ["Total GPUs used: 0", "Total processes used: 1"]
    assert [line.split(":")[0] for line in tail[5:11]] == [
        "Wall time since job start",
        "Productive step time",
        "Restarts",
        "Time lost to recovery",
        "Steps recomputed",
        "Goodput",
    ]
    assert tail[7] == "Restarts: 0" and tail[11:] == ["Training completed successfully."]
    metrics = read_jsonl(logs / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2]
    for m in metrics:
        assert {
            "epoch",
            "world_size",
            "train_loss",
            "train_acc",
            "val_loss",
            "val_acc",
            "epoch_time",
            "throughput",
            "samples_seen",
            "sample_digest",
        } <= m.keys()
        assert m["samples_seen"] == 32 * 3 and m["world_size"] == 1 and m["val_samples"] == 1024
    events = read_jsonl(logs / "rank-0.jsonl")
    assert {"rank", "world_size", "restart", "run_id"} <= events[0].keys()
    assert any(e["event"] == "epoch_end" for e in events)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--epochs", "0"], "--epochs 0 must be >= 1"),
        (["--base-lr", "-0.1"], "--base-lr -0.1 must be > 0"),
        (["--target-accuracy", "2"], "outside (0, 1]"),
        (["--model", "gpt2"], "invalid choice: 'gpt2'"),
        (["--dataset", "tiny-imagenet", "--data-dir", "/nonexistent/tiny"], "/nonexistent/tiny does not exist"),
        (["--dataset", "imagefolder", "--data-dir", "/nonexistent/folder"], "/nonexistent/folder does not exist"),
        (["--batch-size", "8192"], "fewer than one global batch"),
        (["--data-dir", "/nonexistent/folder"], "--dataset synthetic does not read files"),
    ],
)
def test_bad_input_exits_2_with_the_fix_and_leaves_logs_untouched(
    tmp_path: Path, argv: list[str], problem: str
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"epoch": 1}\n')
    done = cli([*argv, "--log-dir", str(logs), "--checkpoint-dir", str(logs / "ckpt")], timeout=90)
    assert done.returncode == 2, done.output
    assert problem in done.stderr and "Fix:" in done.stderr
    assert "Traceback" not in done.output
    assert [p.name for p in logs.iterdir()] == ["metrics.jsonl"]
    assert (logs / "metrics.jsonl").read_text() == '{"epoch": 1}\n'


@pytest.mark.parametrize("flag", ["--log-dir", "--checkpoint-dir"])
def test_an_output_folder_that_cannot_be_created_exits_2_without_a_traceback(tmp_path: Path, flag: str) -> None:
    (tmp_path / "a-file").write_text("")
    folders = {"--log-dir": tmp_path / "logs", "--checkpoint-dir": tmp_path / "ckpt", flag: tmp_path / "a-file" / "out"}
    done = cli([*QUICK, *(item for pair in folders.items() for item in (pair[0], str(pair[1])))], timeout=90)
    assert done.returncode == 2, done.output
    assert f"{flag} {tmp_path / 'a-file' / 'out'} cannot be created: {tmp_path / 'a-file'} is a file" in done.stderr
    assert "Traceback" not in done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "bad input wrote something"


def test_a_corrupt_zip_exits_2_naming_the_archive(tmp_path: Path) -> None:
    (tmp_path / "tiny-imagenet-200.zip").write_bytes(b"PK\x03\x04 this is not really a zip" * 50)
    done = cli(
        [
            "--dataset",
            "tiny-imagenet",
            "--data-dir",
            str(tmp_path),
            "--log-dir",
            str(tmp_path / "logs"),
            "--checkpoint-dir",
            str(tmp_path / "logs" / "ckpt"),
        ]
    )
    assert done.returncode == 2
    assert "tiny-imagenet-200.zip is corrupt" in done.stderr and not (tmp_path / "logs").exists()


def test_amp_on_cpu_trains_in_bf16(tmp_path: Path) -> None:
    args = ["--amp", "--dataset", "digits", "--batch-size", "16", "--max-steps-per-epoch", "2", "--epochs", "1"]
    done = cli([*args, "--log-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert done.returncode == 0, done.output
    assert "precision: bf16" in done.stdout and "amp_on_cpu" in done.stderr


@pytest.mark.parametrize(("model", "dataset"), [("resnet18", "digits"), ("vit", "digits")])
def test_other_models_and_datasets_train(tmp_path: Path, model: str, dataset: str) -> None:
    args = ["--model", model, "--dataset", dataset, "--batch-size", "8", "--max-steps-per-epoch", "2"]
    done = cli(
        [
            *args,
            "--epochs",
            "1",
            "--optimizer",
            "sgd",
            "--image-size",
            "16",
            "--log-dir",
            str(tmp_path),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    assert done.returncode == 0, done.output
    assert f"model: {model}" in done.stdout and f"dataset: {dataset}" in done.stdout and "16px" in done.stdout
