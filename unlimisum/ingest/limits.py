"""Size caps for reading untrusted inputs: every byte we read is bounded by these."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class IngestLimits:
    """Caps that keep a hostile or broken file from exhausting memory."""

    max_text_bytes: int = 256 * MiB  # a plain-text book is 0.1-5 MB; 256 MB is a library, not a book
    max_zip_members: int = 20_000  # real EPUBs hold tens to a few thousand members
    max_member_bytes: int = 64 * MiB  # decompressed size of one XHTML/OPF/NCX member we read
    max_book_bytes: int = 1024 * MiB  # declared decompressed size of all members of an EPUB together
    max_read_bytes: int = 512 * MiB  # decompressed bytes actually read from one EPUB, all members
    read_chunk_bytes: int = 64 * 1024  # zip members are read in chunks of this size
    sniff_bytes: int = 4096  # bytes read from the start of a file to detect its format


DEFAULT_LIMITS = IngestLimits()
