"""Statistics shared by the suites, the results generator and the claims gate: paired ratios of runs of one trial,
seeded bootstrap intervals of a median, and the rank test behind a drift verdict."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence


def geomean(values: Sequence[float]) -> float:
    """The geometric mean of positive values (speedups, time ratios)."""
    return math.exp(sum(math.log(v) for v in values) / len(values))


def bootstrap_median_ci(values: Sequence[float], level: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of values (seeded, so a record recomputes to the same; the values
    are sorted first, so the interval does not depend on the order they were collected in)."""
    if not values:
        raise ValueError("bootstrap_median_ci needs at least one value")
    rng = random.Random(seed)
    values = sorted(values)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return meds[int(tail * (resamples - 1))], meds[int(round((1.0 - tail) * (resamples - 1)))]


def paired_ratios(samples: Mapping[str, list[float]], variant: str, baseline: str,
                  prompts: Iterable[str]) -> list[float]:
    """tokens/s of each run of `variant` over its `baseline` run of the same prompt and trial.

    samples: a record's `<variant>|<prompt>|tokens_per_s` lists, in trial order (the suite appends trial by trial).
    A ratio against the run beside it in the same trial cancels what drifts between trials (the host's speed
    moved plain decoding between 32 and 63 tok/s within one record), which a ratio of medians does not."""
    out: list[float] = []
    for pr in prompts:
        a, b = samples.get(f"{variant}|{pr}|tokens_per_s"), samples.get(f"{baseline}|{pr}|tokens_per_s")
        if a and b:
            if len(a) != len(b):
                raise ValueError(f"{variant} and {baseline} on {pr}: {len(a)} and {len(b)} runs, cannot pair by trial")
            out += [x / y for x, y in zip(a, b, strict=True)]
    return out


def paired_speedup(ratios: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, 95% bootstrap interval low, high) of paired tokens/s ratios; None without any."""
    if not ratios:
        return None
    low, high = bootstrap_median_ci(ratios)
    return statistics.median(ratios), low, high


def rank_test_p(reference: Sequence[float], measured: Sequence[float]) -> float:
    """Two-sided Mann-Whitney U p-value of two independent samples (scipy, the `test` extra)."""
    from scipy.stats import mannwhitneyu

    if not reference or not measured:
        raise ValueError(f"a rank test needs samples on both sides, got {len(reference)} and {len(measured)}")
    return float(mannwhitneyu(reference, measured, alternative="two-sided").pvalue)
