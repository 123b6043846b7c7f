"""Metric sums, the sample digest, the seed's console formats and early stopping."""

from __future__ import annotations

import re

import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic_train.early_stop import EarlyStopper
from elastic_train.metrics import DIGEST_PRIME, EpochRecord, MetricSums
from elastic_train.trainer import Summary

SEED_EPOCH_LINE = re.compile(
    r"^Epoch \d+/\d+: time=\d+\.\d{3}s, train_loss=\d+\.\d{4}, train_acc=\d\.\d{4}, "
    r"val_loss=\d+\.\d{4}, val_acc=\d\.\d{4}, throughput=\d+\.\d img/s$"
)


def digest_of(indices: list[int], chunks: int = 1) -> tuple[int, int]:
    sums = MetricSums(torch.device("cpu"))
    for part in range(chunks):
        sums.add_indices(torch.tensor(indices[part::chunks], dtype=torch.int64))
    return int(sums.digest[0]), int(sums.digest[1])


@given(st.lists(st.integers(0, 10**9), max_size=300), st.integers(1, 5), st.randoms())
def test_digest_ignores_order_and_batching(indices: list[int], chunks: int, rnd: object) -> None:
    shuffled = list(indices)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert digest_of(indices) == digest_of(shuffled, chunks)


@given(st.lists(st.integers(0, 10**6), min_size=2, max_size=300, unique=True), st.data())
def test_digest_changes_when_a_sample_is_skipped_or_repeated(indices: list[int], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(indices) - 1))
    assert digest_of(indices[:i] + indices[i + 1 :]) != digest_of(indices), "a skipped sample went unnoticed"
    assert digest_of([*indices, indices[i]]) != digest_of(indices), "a repeated sample went unnoticed"
    # Skipping one sample and repeating another (same count) must also show.
    j = (i + 1) % len(indices)
    assert digest_of(indices[:i] + indices[i + 1 :] + [indices[j]]) != digest_of(indices)


def test_digest_values_stay_below_the_prime() -> None:
    s, q = digest_of(list(range(10**5)))
    assert 0 <= s < DIGEST_PRIME and 0 <= q < DIGEST_PRIME


def test_metric_sums_are_raw_counts_not_averages() -> None:
    sums = MetricSums(torch.device("cpu"))
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    sums.add_batch(logits, torch.tensor([0, 1, 1]), torch.tensor(0.5))
    sums.add_batch(logits[:1], torch.tensor([1]), torch.tensor(2.0))
    correct, loss_sum, samples = sums.sums.tolist()
    assert (correct, loss_sum, samples) == (2.0, 0.5 * 3 + 2.0, 4.0)


def test_epoch_line_and_summary_use_the_seeds_formats() -> None:
    record = EpochRecord(95, 4, 0.0077, 0.9997, 1.0301, 0.7474, 2.0, 24572.71, 49152, "0-0", 10000, 9500)
    line = record.console_line(100)
    assert line == (
        "Epoch 95/100: time=2.000s, train_loss=0.0077, train_acc=0.9997, val_loss=1.0301, val_acc=0.7474, "
        "throughput=24572.7 img/s"
    )
    assert SEED_EPOCH_LINE.match(line)
    summary = Summary(201.998, 24332.868, 4, 4, 100, False, 0.75)
    assert summary.console_lines() == [
        "Training Summary:",
        "Total training time: 201.998 seconds",
        "Throughput: 24332.868 images/second",
        "Total GPUs used: 4",
        "Total processes used: 4",
    ]


def test_early_stop_on_target_accuracy() -> None:
    stopper = EarlyStopper(target_accuracy=0.9, patience=5)
    assert not stopper.update(0.5)
    assert stopper.update(0.91)
    assert "target" in stopper.reason


def test_early_stop_on_patience_counts_epochs_without_improvement() -> None:
    stopper = EarlyStopper(target_accuracy=1.0, patience=2)
    assert [stopper.update(a) for a in (0.5, 0.6, 0.6, 0.55)] == [False, False, False, True]
    assert stopper.best_accuracy == 0.6 and "2 epoch" in stopper.reason


def test_patience_zero_never_stops_on_patience() -> None:
    stopper = EarlyStopper(target_accuracy=1.0, patience=0)
    assert not any(stopper.update(0.5) for _ in range(50))
