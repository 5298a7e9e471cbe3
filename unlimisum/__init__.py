"""unlimisum: summarize whole books with pretrained encoder-decoder models, no truncation.

The package is the API; the CLI is a thin layer over it::

    import unlimisum
    summary = unlimisum.summarize(text, model="abertsch/unlimiformer-bart-booksum-alternating", num_beams=4)

Heavy modules (torch, transformers, faiss) load on first use of what needs them.
"""

from importlib import import_module

from unlimisum.version import __version__  # noqa: E402

from unlimisum.document import Chapter, Document  # noqa: E402
from unlimisum.errors import UnlimisumError  # noqa: E402

_LAZY = {
    "summarize": "unlimisum.summarizer",
    "Summarizer": "unlimisum.summarizer",
    "Summary": "unlimisum.results",
    "SummaryStats": "unlimisum.results",
    "ProgressEvent": "unlimisum.events",
    "load_model": "unlimisum.models",
    "train": "unlimisum.training",
    "EncodedCache": "unlimisum.unlimiformer.cache",
    "EncodedDocument": "unlimisum.unlimiformer.encoded",
    "read_document": "unlimisum.ingest",
    "read_stdin": "unlimisum.ingest",
    "EncodingConfig": "unlimisum.config",
    "GenerationOptions": "unlimisum.config",
    "IndexConfig": "unlimisum.config",
    "ModelConfig": "unlimisum.config",
    "RetrievalConfig": "unlimisum.config",
    "errors": "unlimisum.errors",
}

__all__ = ["Chapter", "Document", "UnlimisumError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'unlimisum' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    return module if name == "errors" else getattr(module, name)
