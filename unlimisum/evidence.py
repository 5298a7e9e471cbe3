"""Evidence: for each sentence of a summary, the passages of the book its retrieval attention went to.

After generate() the summarize path reads the returned summary once more, teacher-forced, with the same
retrieval (same k, same store or chapter view), and keeps for every summary token the input positions
that received most of its attention mass (all layers and heads): a ``TokenMass``. Here that mass is
summed per sentence of the summary (split by pysbd, a rule-based splitter that knows abbreviations,
decimals and quotes), the input positions are grouped into passages (a bounded span of tokens around each
peak, never across a chapter boundary), and each sentence keeps its strongest passages.

Evidence says where the model looked while writing a sentence, not that the sentence is true: a guide for
checking a summary against its book, not a proof of faithfulness.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import torch

from unlimisum.document import Document

DEFAULT_PASSAGES = 3  # passages kept per sentence (--evidence-passages)
PASSAGE_RADIUS = 16  # tokens each side of a peak that its passage spans (then widened to whole words)
MAX_QUOTE_CHARS = 300  # a longer passage is quoted up to here, with an ellipsis
_WORD_SLACK = 24  # characters a passage may widen by to start and end on whole words
# A sentence whose support (nats per token lost when its passages are hidden) is below this was not carried by
# them: the one a reader should check first.
WEAK_SUPPORT_NATS = 0.1


@dataclass(frozen=True)
class TokenMass:
    """Per summary token, the input positions its retrieval attention went to most (sparse)."""

    positions: torch.Tensor  # [T, M] int64: input token positions (of the whole document)
    mass: torch.Tensor  # [T, M] float32: attention mass summed over layers and heads (0: unused slot)


@dataclass(frozen=True)
class Source:
    """One passage of the book a summary sentence drew on."""

    chapter_index: int  # 0-based, as `unlimisum ingest --json` lists the document's chapters
    chapter: str  # that chapter's title
    start_char: int  # offsets into that chapter's text (`ingest --json --text`): text[start_char:end_char]
    end_char: int
    share: float  # of the sentence's attention mass over its listed passages; a sentence's shares sum to 1
    quote: str  # the passage, at most MAX_QUOTE_CHARS (an ellipsis where cut)
    start_token: int = 0  # the passage's input tokens [start_token, end_token) (of the whole document; for a
    end_token: int = 0  # decoder-only model, of the document's text in the prompt): what the ablation hides


@dataclass(frozen=True)
class SentenceEvidence:
    """One sentence of a summary and the passages it drew on, strongest first."""

    sentence: str
    start: int  # character offsets of the sentence in the summary text
    end: int
    sources: tuple[Source, ...]
    # How much the sentence depends on its listed passages: the drop in its log-probability per token (nats)
    # when they are hidden from retrieval, the summary before it as written. Near 0: the passages did not carry
    # it (check it first). None: not measured (no passages, or the ablation pass was not run).
    support: float | None = None


def weakly_supported(sentence: SentenceEvidence) -> bool:
    """The sentence's listed passages barely carried it (support measured and under WEAK_SUPPORT_NATS)."""
    return sentence.support is not None and sentence.support < WEAK_SUPPORT_NATS


@dataclass(frozen=True)
class _Chapter:
    index: int  # in document.chapters
    title: str
    start: int  # character range in document.text
    end: int


def sentences(text: str) -> list[tuple[int, int]]:
    """Character ranges (start, end) of the sentences of ``text``, surrounding whitespace left out."""
    if not text.strip():
        return []
    spans = []
    for span in _segmenter().segment(text):
        start, end = span.start, span.end
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return spans


@lru_cache(maxsize=1)
def _segmenter():
    import pysbd  # imported on first use: `unlimisum --help` stays fast

    return pysbd.Segmenter(language="en", clean=False, char_span=True)


def token_ends_in_text(ids: Sequence[int], decode: Callable[[Sequence[int]], str], text: str) -> list[int]:
    """Where each generated token ends in ``text`` (the decoded summary, stripped), by decoding prefixes."""
    full = decode(list(ids))
    lead = len(full) - len(full.lstrip())
    ends, last = [], 0
    for count in range(1, len(ids) + 1):
        end = min(len(text), max(last, len(decode(list(ids[:count]))) - lead))
        ends.append(end)
        last = end
    return ends


def sentence_rows(text: str, ids: Sequence[int], decode: Callable[[Sequence[int]], str], special_ids: set[int],
                  n_rows: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The sentences of ``text`` (character ranges) and, per sentence, the indices j into ``ids`` (the returned
    sequence, ``text`` its decoding) of the summary tokens that wrote it: special tokens and rows from ``n_rows``
    on belong to none."""
    spans = sentences(text)
    if not spans:
        return [], []
    ends = token_ends_in_text(ids, decode, text)
    sentence_ends = [end for _, end in spans]
    members: list[list[int]] = [[] for _ in spans]
    for j, token in enumerate(ids):
        if token in special_ids or j >= n_rows:
            continue
        members[min(len(spans) - 1, bisect_left(sentence_ends, ends[j]))].append(j)
    return spans, members


Support = Callable[[list[tuple[list[int], tuple["Source", ...]]]], "list[float | None]"]


def build(text: str, ids: Sequence[int], decode: Callable[[Sequence[int]], str], special_ids: set[int],
          token_mass: TokenMass, document: Document, token_ends: list[int] | None, n_tokens: int,
          passages: int = DEFAULT_PASSAGES, support: Support | None = None) -> tuple[SentenceEvidence, ...]:
    """The evidence of one summary.

    ``ids``: the returned sequence (``token_mass`` row j belongs to ids[j]); ``decode``: ids -> text
    without special tokens; ``token_ends``: each input token's end character in ``document.text`` (None: a
    slow tokenizer, positions mapped in proportion); ``n_tokens``: the document's input tokens.
    ``support([(rows, sources), ...])``: each sentence's support (SentenceEvidence.support), in order, given its
    summary tokens (indices into ``ids``) and its passages (None where it has none); None: not measured.
    """
    spans, members = sentence_rows(text, ids, decode, special_ids, token_mass.positions.shape[0])
    if not spans:
        return ()
    mapper = _Mapper(document, token_ends, n_tokens)
    found = [mapper.passages(token_mass, rows, passages) if rows else () for rows in members]
    measured = support(list(zip(members, found))) if support is not None else [None] * len(found)
    return tuple(SentenceEvidence(text[start:end], start, end, sources, value if sources else None)
                 for (start, end), sources, value in zip(spans, found, measured))


def chapter_starts(document: Document) -> list[int | None]:
    """Where each chapter's text starts in ``document.text`` (None: a chapter with no text, not in it)."""
    starts: list[int | None] = []
    position, first = 0, True
    for chapter in document.chapters:
        if not chapter.text:
            starts.append(None)
            continue
        if not first:
            position += 2  # Document.text joins chapters with a blank line
        starts.append(position)
        position += len(chapter.text)
        first = False
    return starts


class _Mapper:
    """Input token positions -> characters of the document -> chapters, and passages around peaks."""

    def __init__(self, document: Document, token_ends: list[int] | None, n_tokens: int):
        self.document = document
        self.token_ends = token_ends
        self.n_tokens = n_tokens
        self.chapters = [_Chapter(index, chapter.title, start, start + len(chapter.text))
                         for index, (chapter, start) in enumerate(zip(document.chapters, chapter_starts(document)))
                         if start is not None]
        self.chapter_starts = [chapter.start for chapter in self.chapters]

    def char_end(self, position: int) -> int:
        """The character (in document.text) where input token ``position`` ends."""
        if position < 0:
            return 0
        if self.token_ends is not None:
            return self.token_ends[min(position, len(self.token_ends) - 1)]
        return round((position + 1) / max(1, self.n_tokens) * len(self.document.text))

    def chapter_of(self, char: int) -> _Chapter:
        return self.chapters[max(0, bisect_right(self.chapter_starts, char) - 1)]

    def token_range(self, chapter: _Chapter) -> tuple[int, int]:
        """The input tokens [start, end) that ``chapter_of`` places in ``chapter`` (those whose last character
        is in it): a passage never takes tokens of another chapter."""
        number = self.chapters.index(chapter)
        start = 0 if number == 0 else bisect_right(range(self.n_tokens), chapter.start, key=self.char_end)
        if number + 1 == len(self.chapters):
            return start, self.n_tokens
        return start, bisect_right(range(self.n_tokens), self.chapters[number + 1].start, key=self.char_end)

    def passages(self, token_mass: TokenMass, rows: list[int], count: int) -> tuple[Source, ...]:
        """The ``count`` strongest passages the summary tokens ``rows`` attended to."""
        positions = token_mass.positions[rows].reshape(-1)
        mass = token_mass.mass[rows].reshape(-1).double()
        used = mass > 0
        positions, mass = positions[used], mass[used]
        if not positions.numel() or not self.chapters:
            return ()
        unique, inverse = torch.unique(positions, return_inverse=True)
        summed = torch.zeros(unique.shape[0], dtype=torch.float64).index_add_(0, inverse, mass)
        order = torch.argsort(summed, descending=True).tolist()
        unique_list, summed_list = unique.tolist(), summed.tolist()
        taken: list[tuple[int, int]] = []  # token ranges of the passages made so far
        found = []
        for peak_index in order[: 8 * count]:  # peaks enough to find the strongest passages among them
            peak = unique_list[peak_index]
            if any(a <= peak < b for a, b in taken):
                continue
            chapter = self.chapter_of(max(0, self.char_end(peak) - 1))
            first, last = self.token_range(chapter)  # the passage stays in its peak's chapter
            a, b = max(first, peak - PASSAGE_RADIUS), min(last, peak + PASSAGE_RADIUS + 1)
            for t_start, t_end in taken:  # passages never overlap: the earlier, stronger one keeps its tokens
                if t_end <= peak:
                    a = max(a, t_end)
                elif t_start > peak:
                    b = min(b, t_start)
            start_char, end_char = self._chars(a, b, chapter)
            lo, hi = bisect_left(unique_list, a), bisect_left(unique_list, b)
            weight = sum(summed_list[lo:hi])
            taken.append((a, b))
            if end_char > start_char:
                found.append((weight, chapter, start_char, end_char, a, b))
        found.sort(key=lambda item: -item[0])
        kept = found[:count]
        total = sum(weight for weight, *_ in kept)
        return tuple(self._source(chapter, start, end, weight / total if total > 0 else 1 / len(kept), a, b)
                     for weight, chapter, start, end, a, b in kept)

    def _chars(self, a: int, b: int, chapter: _Chapter) -> tuple[int, int]:
        """Tokens [a, b) as characters of ``chapter``'s text, on whole words, whitespace trimmed."""
        text = self.document.text
        start = max(chapter.start, self.char_end(a - 1))
        end = min(chapter.end, max(start, self.char_end(b - 1)))
        floor = max(chapter.start, start - _WORD_SLACK)
        while start > floor and not text[start - 1].isspace():
            start -= 1
        ceiling = min(chapter.end, end + _WORD_SLACK)
        while end < ceiling and not text[end].isspace():
            end += 1
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        return start - chapter.start, end - chapter.start

    def _source(self, chapter: _Chapter, start: int, end: int, share: float, first_token: int,
                end_token: int) -> Source:
        passage = self.document.chapters[chapter.index].text[start:end]
        return Source(chapter.index, chapter.title, start, end, share, quote(passage), first_token, end_token)


def quote(passage: str) -> str:
    """``passage`` trimmed, cut at a word near MAX_QUOTE_CHARS with an ellipsis when longer."""
    passage = passage.strip()
    if len(passage) <= MAX_QUOTE_CHARS:
        return passage
    cut = passage[: MAX_QUOTE_CHARS - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > MAX_QUOTE_CHARS // 2 else cut).rstrip() + "…"
