"""What the library reports while it works: ``ProgressEvent``s, given to a progress callback.

Kept apart from the summarizer so that every unit (model loading included) can report progress
without importing the units above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report: ``stage`` is download, cache, keys, tokenize, encode, index, prefill, compile, prepare,
    generate, evidence, support or chapter.

    ``download`` (loading a model whose files are not in the Hugging Face cache yet): ``completed`` of
    ``total`` bytes of the files being fetched, from 0 to ``total``; ``document`` is the repository,
    ``info["file"]`` the file being downloaded, ``info["files"]`` how many files there are.

    ``cache`` (with a cache of encoded books): 0/1 when it is looked up, 1/1 when the encoded
    document came from it (then no tokenize/encode/index events follow). ``keys`` (after a cache hit whose
    per-layer keys or values are built from the cached states): ``completed`` of ``total`` tokens projected.
    ``prefill`` (decoder-only models, instead of encode and index): ``completed`` of ``total`` chunks of the
    prompt read, ``info["tokens"]`` and ``info["chunk"]`` (tokens a chunk).
    ``compile`` (before ``prepare``, on a machine's first run with a long book): ``completed`` of ``total``
    retrieval kernels compiled (unlimisum/search/compiled.py; most of them while the book was encoded),
    ``info["seconds_left"]`` an estimate of the rest; not reported where none is left to compile.
    ``prepare`` (before ``generate``): 0 of ``total`` datastores, then all, made ready for retrieval
    (the kernels measured, once per process, and an exact store's packed copies made: seconds at 100k tokens);
    ``info["packed_bytes"]``: the packed kernel's copies made beside the stores, ``info["seconds"]`` the time it
    took; with one datastore, ``info["bytes"]`` is the store's own size.
    ``generate``: ``completed`` summary tokens written of at most ``total``; the last event's count is the
    summary's (for a batch, the longest one's).
    ``evidence`` (after ``generate``, unless the evidence pass is off): 0 of ``total`` summaries of the batch,
    then one more as each summary has been read again (its evidence) and its sentences read without their
    passages (their support). ``support`` (within ``evidence``, unless support is off): ``completed`` of a
    summary's ``total`` sentences read without their passages.
    ``chapter`` (``summarize(per_chapter=True)``, after the whole-document summary): before each
    batch of chapters, ``completed`` chapters of ``total`` are summarized and ``document`` is the
    title of the next one (``info["titles"]``: the titles of the batch, generated together from
    views of the one encoded document); after the last batch, ``completed == total``.
    """

    stage: str
    completed: int
    total: int | None
    document: str = ""  # title or source of the document the event is about
    info: dict = field(default_factory=dict)


ProgressCallback = Callable[[ProgressEvent], None]
