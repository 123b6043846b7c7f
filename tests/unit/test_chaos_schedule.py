"""jobs/chaos.py's kill schedule: fixed gaps, or exponential ones (failures as a Poisson process)."""

from __future__ import annotations

import random
import statistics

import pytest

from tests.helpers import load_chaos


def test_fixed_gaps_are_the_mtbf_and_random_ones_are_exponential_with_that_mean() -> None:
    chaos = load_chaos()
    rng = random.Random(1)
    assert {chaos.next_gap(rng, 30.0, "fixed") for _ in range(10)} == {30.0}
    gaps = [chaos.next_gap(rng, 30.0, "random") for _ in range(4000)]
    assert min(gaps) > 0
    # Mean 30 (standard error 30 / sqrt(4000) ~ 0.5); an exponential's median is ln 2 x the mean
    # and about 1 gap in 20 is under 1.5 s (1 - e^-0.05): kills also come back to back.
    assert 28.0 < statistics.fmean(gaps) < 32.0
    assert 18.0 < statistics.median(gaps) < 23.5
    assert 0.02 < sum(g < 1.5 for g in gaps) / len(gaps) < 0.08
    # Seeded: the same schedule again.
    again = random.Random(1)
    assert [chaos.next_gap(again, 30.0, "random") for _ in range(5)] == gaps[:5]
    with pytest.raises(ValueError, match="neither"):
        chaos.next_gap(rng, 30.0, "poisson")
