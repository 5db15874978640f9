"""Statistics of alternated rounds, shared by the benchmarks that measure a ratio of step times
(bench_online.py, bench_recording.py): a bootstrap interval, the median with its interval, and
the ratio of two arms' total step times with an interval over whole rounds."""

from __future__ import annotations

import statistics


def bootstrap_95(stat, items: list, resamples: int = 10_000, seed: int = 0) -> list[float]:
    """The 2.5th and 97.5th percentiles of `stat` over `resamples` samples of `items` drawn with
    replacement (each as many as `items`)."""
    import random

    draw = random.Random(seed).choices
    got = sorted(stat(draw(items, k=len(items))) for _ in range(resamples))
    return [got[int(0.025 * resamples)], got[int(0.975 * resamples) - 1]]


def median_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> dict:
    """The median of `values`, its bootstrap 95% interval and the middle half of the values themselves."""
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "bootstrap_95": bootstrap_95(statistics.median, values, resamples, seed),
            "middle_half": [quartiles[0], quartiles[2]], "n": len(values)}


def ratio_of_means(rounds: list[dict], resamples: int = 10_000, seed: int = 0, arms=("observed", "paused")) -> dict:
    """One arm's total step time over the other's (each round: a dict of the arms' measured step
    times), and its bootstrap 95% interval over rounds drawn with replacement."""
    top, bottom = arms

    def ratio(sample):
        return sum(sum(r[top]) for r in sample) / sum(sum(r[bottom]) for r in sample)

    return {"ratio": ratio(rounds), "bootstrap_95": bootstrap_95(ratio, rounds, resamples, seed), "n": len(rounds)}
