"""sdsie.stats: the paired ratios, bootstrap intervals and rank test the suites, the results generator and the claims
gate share."""

from __future__ import annotations

import pytest

from sdsie.stats import bootstrap_median_ci, paired_ratios, paired_speedup, rank_test_p
from sdsie.telemetry.timing import cuda_event_ms


def test_paired_speedup_is_the_median_ratio_inside_its_own_interval():
    ratios = paired_ratios({"a|p|tokens_per_s": [2.0, 3.0, 4.0], "b|p|tokens_per_s": [2.0, 2.0, 2.0],
                            "a|q|tokens_per_s": [1.0]}, "a", "b", ["p", "q"])  # q has no baseline: left out
    assert ratios == [1.0, 1.5, 2.0]
    median, low, high = paired_speedup(ratios)
    assert median == 1.5 and low <= median <= high and (low, high) == bootstrap_median_ci(ratios)
    assert paired_speedup([]) is None


def test_the_rank_test_tells_shifted_samples_from_the_same_one_and_refuses_an_empty_side():
    base = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.01]
    assert rank_test_p(base, [x + 1.0 for x in base]) < 0.01
    assert rank_test_p(base, list(base)) > 0.5
    with pytest.raises(ValueError, match="both sides"):
        rank_test_p(base, [])


def test_the_cuda_event_timer_refuses_fewer_than_one_call():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        cuda_event_ms(lambda: None, calls=0)
