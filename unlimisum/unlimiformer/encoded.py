"""The encoded document: every token of a book encoded once, and where its chapters lie.

``EncodedDocument`` is the centre of a summarize call: the token ids, one datastore of their
encoder states, the kept range of every encoding window and the token range of every chapter.
The whole-book summary searches all of it; each chapter's summary searches a view of the same
store over its own token range, so ``--per-chapter`` costs one encode plus the generations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unlimisum.coverage import TokenRange
from unlimisum.search.datastore import Datastore


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
