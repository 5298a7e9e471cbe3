"""Where a summary looked: the retrieval attention mass per token range of the input.

During generation every cross-attention head of every layer adds its softmax weights over the
input tokens to one vector per document (``Datastore.attend(..., coverage=...)``): all steps,
layers, heads and beams (every beam's queries count, not only the returned sequence's). The
vector, cut at chapter or window boundaries and normalised, says which share of the attention
each part of the book received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class CoverageSpan:
    """One token range of the input and the share of the summary's retrieval attention it received."""

    title: str
    start_token: int
    end_token: int  # exclusive
    share: float  # of the summary's attention mass; the spans of one summary sum to 1


def spans(mass: torch.Tensor, ranges: Sequence[tuple[str, int, int]]) -> tuple[CoverageSpan, ...]:
    """Shares of ``mass`` [N] over ``ranges`` (title, start, end), which must tile [0, N) in order."""
    n = mass.shape[0]
    expected_start = 0
    for _, start, end in ranges:
        if start != expected_start or end <= start:
            raise ValueError(f"coverage ranges must tile [0, {n}) in order, got {list(ranges)}")
        expected_start = end
    if expected_start != n:
        raise ValueError(f"coverage ranges end at {expected_start}, not at {n}")
    mass = mass.double()
    sums = [float(mass[start:end].sum()) for _, start, end in ranges]
    total = sum(sums)
    if total <= 0:
        shares = [(end - start) / n for _, start, end in ranges]  # nothing was retrieved: say so evenly
    else:
        shares = [value / total for value in sums]
    return tuple(CoverageSpan(title, start, end, share) for (title, start, end), share in zip(ranges, shares))


def window_ranges(n_tokens: int, kept: Sequence[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """(title, start, end) per encoding window from its kept token range: "window 3"."""
    return [(f"window {number}", start, end) for number, (start, end) in enumerate(kept, start=1) if end > start]


def bar(coverage: Sequence[CoverageSpan], width: int = 60) -> str:
    """A one-line bar across the input: each span gets columns by its length, shaded by its share."""
    if not coverage:
        return ""
    n = coverage[-1].end_token
    shades = " ░▒▓█"
    peak = max(span.share / max(1, span.end_token - span.start_token) for span in coverage) or 1.0
    columns = []
    for column in range(width):
        token = min(n - 1, int((column + 0.5) * n / width))
        span = next(span for span in coverage if span.start_token <= token < span.end_token)
        density = span.share / max(1, span.end_token - span.start_token) / peak
        columns.append(shades[min(len(shades) - 1, round(density * (len(shades) - 1)))])
    return "".join(columns)
