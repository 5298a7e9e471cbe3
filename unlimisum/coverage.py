"""Where a summary looked: the retrieval attention mass per token range of the input, and the token
ranges themselves (chapters, windows) that both model families report coverage by.

The evidence pass (``EncoderDecoderSummarizer.reread``: the returned summary read once more,
teacher-forced) adds every cross-attention head's softmax weights over the input tokens to one vector
per document, over the positions that produced the returned sequence only (no padding after its end
in a batch, no dropped beams). Without that pass (``RetrievalConfig(evidence=False)``, decoder-only
models) the vector is filled during generation instead (``Datastore.attend(..., coverage=...)``): all
steps, rows and beams. The vector, cut at chapter or window boundaries and normalised, says which share
of the attention each part of the book received.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

import torch

from unlimisum.document import Document


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


@dataclass(frozen=True)
class TokenRange:
    """A titled range ``[start, end)`` of the document's tokens."""

    title: str
    start: int
    end: int


def chapter_char_ranges(document: Document) -> list[tuple[str, int, int]]:
    """(title, start, end) character ranges of the non-empty chapters in ``document.text``."""
    ranges, position = [], 0
    for chapter in document.chapters:
        if not chapter.text:
            continue
        if ranges:
            position += 2  # Document.text joins chapters with a blank line
        ranges.append((chapter.title, position, position + len(chapter.text)))
        position += len(chapter.text)
    return ranges


def chapter_token_ranges(document: Document, token_ends: list[int] | None, n_tokens: int) -> tuple[TokenRange, ...]:
    """Token ranges of the chapters, tiling ``[0, n_tokens)``.

    ``token_ends``: the character offset where each token ends (a fast tokenizer's offsets,
    special tokens given their predecessor's so the list never decreases). A chapter starts at
    its first token that ends after the chapter's first character: SentencePiece tokens
    (``▁Chapter``) start at the space before a word, byte-level BPE tokens after it, and both end
    inside it. Without offsets (slow tokenizers) the boundaries are placed in proportion to the
    characters.
    """
    # a blank chapter's characters go with the chapter before it: it gets no summary of its own
    text = document.text
    characters = [(title, start, end) for title, start, end in chapter_char_ranges(document)
                  if text[start:end].strip()]
    if not characters:
        return (TokenRange(document.title, 0, n_tokens),)
    total_chars = max(1, len(text))
    bounds = [0]
    for _, char_start, _ in characters[1:]:
        if token_ends is not None:
            boundary = bisect_right(token_ends, char_start)
        else:
            boundary = round(char_start / total_chars * n_tokens)
        bounds.append(min(max(boundary, bounds[-1]), n_tokens))
    bounds.append(n_tokens)
    ranges = [TokenRange(title, start, end) for (title, _, _), start, end in zip(characters, bounds, bounds[1:])]
    return _merge_empty(ranges)


def _merge_empty(ranges: list[TokenRange]) -> tuple[TokenRange, ...]:
    """A chapter too short to own a token goes with its neighbour (titles of both kept)."""
    merged: list[TokenRange] = []
    for chapter in ranges:
        if chapter.end > chapter.start:
            merged.append(chapter)
        elif merged:
            last = merged[-1]
            merged[-1] = TokenRange(f"{last.title} / {chapter.title}".strip(" /"), last.start, last.end)
    if not merged:
        return (TokenRange(ranges[0].title, ranges[0].start, ranges[-1].end),)
    if merged[0].start != 0:  # leading empty chapters
        merged[0] = TokenRange(merged[0].title, 0, merged[0].end)
    return tuple(merged)


def token_char_ends(offsets: list[tuple[int, int]]) -> list[int]:
    """Each token's end character from a fast tokenizer's offset mapping, never decreasing
    (special tokens, whose offsets are (0, 0), take their predecessor's)."""
    ends, last = [], 0
    for start, end in offsets:
        if end > start and end >= last:
            last = end
        ends.append(last)
    return ends
