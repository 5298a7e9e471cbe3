"""Means with 95 % bootstrap intervals, and paired bootstrap differences between two systems.

The documents are resampled with replacement (``RESAMPLES`` times, a fixed seed, so that a report says the same
each time it is made); the interval is the 2.5th and 97.5th percentile of the resampled means. A paired
difference resamples the documents once for both systems, so that what the two share (a hard document) cancels:
its interval excluding 0 says the difference holds beyond the sample of documents.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 0


@dataclass(frozen=True)
class Estimate:
    """A mean and its bootstrap interval."""

    mean: float
    low: float
    high: float

    def record(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high}


def bootstrap_mean(values: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED) -> Estimate:
    """The mean of ``values`` and its 95 % percentile-bootstrap interval (the mean itself for one value)."""
    values = list(values)
    if not values:
        raise ValueError("no values to estimate a mean from")
    mean = sum(values) / len(values)
    if len(values) == 1:
        return Estimate(mean, mean, mean)
    generator = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[generator.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return Estimate(mean, _percentile(means, (1 - CONFIDENCE) / 2), _percentile(means, (1 + CONFIDENCE) / 2))


def paired_difference(first: Sequence[float], second: Sequence[float], resamples: int = RESAMPLES,
                      seed: int = SEED) -> Estimate:
    """The mean of ``first - second`` over the same documents, in order, and its paired bootstrap interval."""
    if len(first) != len(second):
        raise ValueError(f"paired values must be as many: {len(first)} against {len(second)}")
    return bootstrap_mean([a - b for a, b in zip(first, second)], resamples, seed)


def _percentile(ordered: list[float], fraction: float) -> float:
    position = fraction * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
