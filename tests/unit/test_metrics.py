"""Metric sums, the sample digest, the seed's console formats and early stopping."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from elastic_train.early_stop import EarlyStopper
from elastic_train.metrics import LANE_SALTS, EpochRecord, MetricSums, index_digest, splitmix64
from elastic_train.task import argmax_correct
from elastic_train.trainer import Summary
from tests.helpers import SEED_EPOCH_LINE

MASK64 = (1 << 64) - 1
INDICES = st.integers(0, 2**40)


def digest_of(indices: list[int], chunks: int = 1) -> str:
    sums = MetricSums(torch.device("cpu"))
    for part in range(chunks):
        sums.add_indices(torch.tensor(indices[part::chunks], dtype=torch.int64))
    return sums.digest_hex()


def reference_splitmix64(x: int) -> int:
    """Vigna's splitmix64 on Python integers, for checking the vectorised one."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_splitmix64_matches_the_reference_output() -> None:
    # splitmix64 seeded with 0 first returns 0xE220A8397B1DCDAF (Vigna's reference C code).
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    values = [0, 1, 2**32 + 7, 2**63 + 5, MASK64]
    mixed = splitmix64(np.array(values, dtype=np.uint64))
    assert [int(v) for v in mixed] == [reference_splitmix64(v) for v in values]


@given(st.lists(INDICES, max_size=200))
def test_digest_is_the_sum_of_salted_splitmix64_modulo_2_64(indices: list[int]) -> None:
    expected = [sum(reference_splitmix64(i ^ int(salt)) for i in indices) & MASK64 for salt in LANE_SALTS]
    assert [int(v) for v in index_digest(torch.tensor(indices, dtype=torch.int64))] == expected
    assert digest_of(indices) == "-".join(f"{v:016x}" for v in expected)


@given(st.lists(INDICES, max_size=300), st.integers(1, 5), st.randoms())
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


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=200), st.data())
def test_digest_changes_when_any_samples_are_swapped_for_others(indices: list[int], data: st.DataObject) -> None:
    positions = data.draw(st.sets(st.integers(0, len(indices) - 1), min_size=1), label="positions replaced")
    changed = list(indices)
    for p in positions:
        changed[p] = data.draw(st.integers(0, 5000), label=f"new index at {p}")
    assume(Counter(changed) != Counter(indices))  # a different multiset of the same size
    assert digest_of(changed) != digest_of(indices)


def test_three_sample_swaps_that_fooled_the_old_digest_are_caught() -> None:
    # Same sum (9) and same sum of squares (41): the previous digest could not tell them apart.
    assert digest_of([0, 4, 5]) != digest_of([1, 2, 6])
    assert digest_of([*range(10, 100), 0, 4, 5]) != digest_of([*range(10, 100), 1, 2, 6])


@given(st.lists(INDICES, max_size=100), st.lists(INDICES, max_size=100))
def test_merging_digests_equals_the_digest_of_the_union(a: list[int], b: list[int]) -> None:
    merged = MetricSums(torch.device("cpu"))
    merged.add_indices(torch.tensor(a, dtype=torch.int64))
    part = MetricSums(torch.device("cpu"))
    part.add_indices(torch.tensor(b, dtype=torch.int64))
    merged.add_digest(part.digest)  # as a resume at another world size merges the old ranks'
    assert merged.digest_hex() == digest_of(a + b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adding_a_batch_never_synchronises_the_device() -> None:
    sums = MetricSums(torch.device("cuda"))
    logits = torch.randn(8, 10, device="cuda")
    labels = torch.randint(0, 10, (8,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        sums.add_batch(argmax_correct(logits, labels), 8, torch.nn.functional.cross_entropy(logits, labels))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums.sums[2].item() == 8


def test_metric_sums_are_raw_counts_not_averages() -> None:
    sums = MetricSums(torch.device("cpu"))
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    sums.add_batch(argmax_correct(logits, torch.tensor([0, 1, 1])), 3, torch.tensor(0.5))
    sums.add_batch(argmax_correct(logits[:1], torch.tensor([1])), 1, torch.tensor(2.0))
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


def test_an_epoch_line_offered_by_every_replica_that_committed_is_written_once(tmp_path: Path) -> None:
    """Quorum mode: each replica that committed an evaluation round offers its line; the round's
    participant 0 may have failed its vote, so no single writer is trusted to be there."""
    import json
    import time

    from elastic_train.distributed.env import DistEnv
    from elastic_train.logs import MetricsFile

    files = [MetricsFile(tmp_path, DistEnv(run_id="unit")) for _ in range(3)]
    record = {"epoch": 1, "step": 20, "sample_digest": "ab", "val_acc": 0.5}
    start = time.time()
    written = [f.append_once(record, key=("epoch", "step", "sample_digest"), since=start - 1) for f in files[1:]]
    assert written == [True, False]  # replica 0 failed its vote: replica 1 wrote it, replica 2 found it
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1]
    # An earlier run's identical line (before this job started) does not stand for this job's.
    assert files[0].append_once(record, key=("epoch", "step", "sample_digest"), since=time.time() + 1)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_early_stop_watches_any_metric_in_its_direction() -> None:
    stopper = EarlyStopper(target_accuracy=0.10, patience=2, monitor="val_loss", mode="min")
    assert not stopper.update(0.9) and not stopper.update(0.5)
    assert not stopper.update(0.6)  # worse: one epoch without improvement
    assert stopper.update(0.7) and stopper.reason == "no val_loss improvement over 0.5000 for 2 epoch(s)"
    reached = EarlyStopper(target_accuracy=0.10, patience=0, monitor="val_loss", mode="min")
    assert reached.update(0.09) and reached.reason == "val_loss 0.0900 <= target 0.1000"
    patient = EarlyStopper(target_accuracy=None, patience=0, monitor="val_mse", mode="min")
    assert not any(patient.update(v) for v in (3.0, 2.0, 1.0, 0.0))  # no target, no patience: never


def test_a_val_acc_stopper_resumes_from_a_checkpoint_written_before_best_existed() -> None:
    old = {"target_accuracy": 0.9, "patience": 2, "best_accuracy": 0.8, "epochs_without_improvement": 1, "reason": ""}
    stopper = EarlyStopper(target_accuracy=0.95, patience=2)
    stopper.resume(old)
    assert stopper.update(0.7) and stopper.reason == "no val_acc improvement over 0.8000 for 2 epoch(s)"
