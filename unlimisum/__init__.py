"""unlimisum: summarize whole books with pretrained encoder-decoder models, no truncation."""

__version__ = "0.1.0"

from unlimisum.document import Chapter, Document  # noqa: E402
from unlimisum.errors import UnlimisumError  # noqa: E402

__all__ = ["Chapter", "Document", "UnlimisumError", "__version__"]
