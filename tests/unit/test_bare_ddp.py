"""The bare DDP baseline (benchmarks/bare_ddp.py) times exactly the steps it reports.

Its throughput is the denominator of the overhead and gpu-check ratios: a batch fetched inside
the window but never trained on would make the baseline look slower than it is.
"""

from __future__ import annotations

from collections.abc import Iterator

from benchmarks.bare_ddp import timed_epoch


class CountingLoader:
    """An endless loader that records which batches were fetched, and whether the clock ran."""

    def __init__(self) -> None:
        self.fetched: list[int] = []
        self.settled = False

    def __iter__(self) -> Iterator[int]:
        index = 0
        while True:
            assert not self.settled, "a batch was fetched after the window closed"
            self.fetched.append(index)
            yield index
            index += 1


def test_only_the_timed_steps_batches_are_fetched_inside_the_window() -> None:
    loader = CountingLoader()
    trained: list[int] = []

    def settle() -> None:
        loader.settled = True

    timed = timed_epoch(loader, 3, lambda batch: trained.append(batch) or 8, settle)
    assert trained == [0, 1, 2]
    assert loader.fetched == [0, 1, 2], "a batch past the timed steps was fetched inside the window"
    assert timed.images == 24 and timed.seconds >= 0


def test_a_loader_shorter_than_the_steps_ends_the_epoch_early() -> None:
    timed = timed_epoch([10, 20], 5, lambda batch: 1, lambda: None)
    assert timed.images == 2
