"""What every summarize path returns: ``Summary`` and ``SummaryStats``; and the two measurements both
families take while generating (summary tokens written, peak memory)."""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from unlimisum.coverage import CoverageSpan
from unlimisum.evidence import SentenceEvidence

# Summary.warnings of a summary the model ended at once (it emitted its end token first).
EMPTY_SUMMARY = ("the summary is empty: the model ended it at once; a minimum length (--min-new-tokens N, "
                 "min_new_tokens=N) makes it write")


@dataclass(frozen=True)
class SummaryStats:
    """What one summary cost: sizes, choices made, time per stage, memory."""

    model: str
    input_tokens: int
    windows: int
    window: int
    index_kind: str
    index_device: str
    retrieval_k: int  # input tokens each cross-attention head attended to per step
    datastore_bytes: int  # the encoded input's one store (16-bit states, plus an approximate index's own)
    generated_tokens: int  # summary tokens: generated tokens other than special tokens
    timings: dict  # stage -> seconds: tokenize, encode, index (or cache_load), prepare, generate, search
    peak_rss_bytes: int  # the process's peak resident memory so far
    peak_gpu_bytes: int | None  # peak CUDA memory during this call, when on CUDA
    tensor_cache_bytes: int | None = None  # decoder self-attention state retained, with --tensor-cache
    cached: bool = False  # the encoded document came from the cache of encoded books
    model_dtype: str = ""  # the weights' dtype ("--dtype auto" chooses bfloat16 where measured faster)
    positions: str | None = None  # decoder-only: "true", or "fixed distance W" when prompt + summary exceed them
    packed_bytes: int = 0  # beside the store: the packed retrieval kernel's copies of it, when that kernel ran
    key_store: str = "shared"  # where the heads scored: "shared" (the store of states) or "per-layer" (keys per layer)
    key_store_bytes: int = 0  # beside the store: the per-layer keys (L x H x N x d_head 16-bit numbers), when used
    key_store_values: bool = False  # the key store holds each layer's values too (their bytes in key_store_bytes)


@dataclass(frozen=True)
class Summary:
    """The summary of one document (and of each chapter, when asked for).

    ``coverage``: where the summary looked, as shares of its retrieval attention mass (all layers and
    heads, over the returned sequence's tokens; with ``RetrievalConfig(evidence=False)``, every generation
    step of every row and beam) per chapter of the document (per window for a chapter's own summary);
    ``window_coverage``: the same per encoding window. Each sums to 1. ``evidence``: per sentence of
    ``text``, the passages of the book its attention went to (``unlimisum/evidence.py``); empty without
    the evidence pass (``evidence=False``); each sentence's ``support`` is measured for encoder-decoder models.
    """

    text: str
    title: str
    source: str
    stats: SummaryStats
    chapters: tuple["Summary", ...] = ()
    token_ids: tuple[int, ...] = ()  # the generated ids, special tokens included
    coverage: tuple[CoverageSpan, ...] = ()
    window_coverage: tuple[CoverageSpan, ...] = ()
    warnings: tuple[str, ...] = ()  # what the reader of this summary should know (EMPTY_SUMMARY)
    evidence: tuple[SentenceEvidence, ...] = ()  # per sentence of `text`: the passages it drew on

    def to_dict(self) -> dict:
        """Plain data (for JSON): every field, chapters and stats included."""
        return asdict(self)


class GenerationProgress:
    """A stopping criterion that never stops: it reports the summary tokens written so far.

    A step counts when some row's new token is not a special token (the forced start and end tokens and
    the padding after a row's end are not summary tokens), so that the count ends where the statistics'
    ``generated_tokens`` does for one summary.
    """

    def __init__(self, report: Callable[[int], None], special_ids: Sequence[int] = ()):
        self.report = report
        self.special = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
        self.written = 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        newest = input_ids[:, -1]  # [rows]
        if not torch.isin(newest, self.special.to(newest.device)).all():
            self.written += 1
            self.report(self.written)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
