"""Format detection by content: the first bytes decide, never the file name."""

from __future__ import annotations

PDF = "pdf"
ZIP = "zip"  # an EPUB candidate; epub.py checks that the zip really is an EPUB
TEXT = "text"

# Signatures of common binary formats that are neither text, EPUB nor PDF, so that a
# JPEG renamed to .txt gets "is a JPEG image" instead of a page of mojibake.
_BINARY_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (0, b"\xff\xd8\xff", "a JPEG image"),
    (0, b"GIF87a", "a GIF image"),
    (0, b"GIF89a", "a GIF image"),
    (0, b"\x1f\x8b", "a gzip archive"),
    (0, b"\xfd7zXZ\x00", "an xz archive"),
    (0, b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (0, b"Rar!\x1a\x07", "a RAR archive"),
    (0, b"\x7fELF", "an executable (ELF)"),
    (0, b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old Microsoft Office file"),
    (0, b"SQLite format 3\x00", "an SQLite database"),
    (0, b"OggS", "an Ogg media file"),
    (0, b"ID3", "an MP3 audio file"),
    (0, b"AT&TFORM", "a DjVu document"),
    (4, b"ftyp", "an MP4/MOV media file"),
    (60, b"BOOKMOBI", "a MOBI/AZW e-book (convert it to EPUB first)"),
)

_PDF_SEARCH_WINDOW = 1024  # the PDF spec lets readers accept junk before "%PDF-"


def sniff_format(head: bytes) -> str:
    """Return ``"pdf"``, ``"zip"`` or ``"text"`` for the first bytes of a file.

    Raises ValueError with a description (e.g. ``"a PNG image"``) for recognised
    binary formats; the caller turns it into an UnsupportedFormatError for its file.
    Whether a text candidate really is text is decided when decoding it.
    """
    if b"%PDF-" in head[:_PDF_SEARCH_WINDOW]:
        return PDF
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return ZIP
    for offset, signature, description in _BINARY_SIGNATURES:
        if head[offset : offset + len(signature)] == signature:
            raise ValueError(description)
    return TEXT
