"""The encoded document: every token of a book encoded once, and where its chapters lie.

``EncodedDocument`` is the centre of a summarize call: the token ids, one datastore of their
encoder states, the kept range of every encoding window and the token range of every chapter.
The whole-book summary searches all of it; each chapter's summary searches a view of the same
store over its own token range, so ``--per-chapter`` costs one encode plus the generations.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from unlimisum.unlimiformer.datastore import Datastore
from unlimisum.document import Document


@dataclass(frozen=True)
class TokenRange:
    """A titled range ``[start, end)`` of the document's tokens."""

    title: str
    start: int
    end: int


@dataclass
class EncodedDocument:
    """A document's tokens, their encoder states in one datastore, and its windows and chapters."""

    name: str  # title or source, for progress reports
    token_ids: torch.Tensor  # [N] int64, special tokens included
    store: Datastore  # [N, d] encoder states
    windows: tuple[tuple[int, int], ...]  # kept token range of every encoding window, in order
    chapters: tuple[TokenRange, ...]  # non-empty chapters' token ranges, tiling [0, N) in order
    seconds: dict = field(default_factory=dict)  # tokenize / encode / index (or load, from the cache)
    cached: bool = False  # loaded from the cache of encoded books
    token_ends: list[int] | None = None  # each token's end character in the text (None: no offsets)

    @property
    def n_tokens(self) -> int:
        """Tokens of the whole document."""
        return int(self.token_ids.shape[0])

    def chapter_store(self, chapter: TokenRange) -> Datastore:
        """The datastore a chapter summary reads: a zero-copy view of the chapter's tokens."""
        return self.store.view(chapter.start, chapter.end)


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
