"""Bytes to text for plain-text inputs: BOMs, UTF-8, UTF-16, legacy 8-bit; never crashes."""

from __future__ import annotations

import codecs

_BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)

# Control characters other than tab, newline, vertical tab, form feed and carriage return
# (and the Ctrl-Z some DOS editors append) do not occur in text.
_CONTROL = frozenset(range(0x20)) - {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1A}
_MAX_CONTROL_FRACTION = 0.01  # more control characters than this (of a sample) means binary
_SAMPLE_CHARS = 65536


class NotTextError(ValueError):
    """The bytes are binary data, not text in any encoding we recognise."""


def decode_text(data: bytes) -> tuple[str, str]:
    """Decode a text file's bytes; return ``(text, encoding_name)``.

    Order: a byte-order mark decides; else BOM-less UTF-16 (many NULs on one side);
    else strict UTF-8; else Windows-1252, with Latin-1 for the five bytes 1252 leaves
    undefined. Line endings are normalised to ``\\n``. Raises NotTextError for binary data.
    """
    text, encoding = _decode(data)
    if _looks_binary(text):
        raise NotTextError("binary data, not text")
    return normalise_newlines(text), encoding


def normalise_newlines(text: str) -> str:
    """CRLF and lone CR become LF; a trailing Ctrl-Z (DOS end of file) goes."""
    return text.replace("\r\n", "\n").replace("\r", "\n").rstrip("\x1a")


def _decode(data: bytes) -> tuple[str, str]:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data[len(bom) :].decode(encoding, errors="replace"), encoding + "-bom"
    utf16 = _guess_bomless_utf16(data)
    if utf16:
        return data.decode(utf16, errors="replace"), utf16
    if b"\x00" in data:
        raise NotTextError("binary data (NUL bytes), not text")
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        pass
    try:
        return data.decode("cp1252"), "cp1252"
    except UnicodeDecodeError:  # 0x81, 0x8D, 0x8F, 0x90, 0x9D: undefined in cp1252
        return data.decode("latin-1"), "latin-1"


def _guess_bomless_utf16(data: bytes) -> str | None:
    """UTF-16 without BOM: mostly-ASCII text has a NUL in every other byte."""
    sample = data[:4096]
    if len(sample) < 4:
        return None
    even_nuls = sample[0::2].count(0)
    odd_nuls = sample[1::2].count(0)
    half = len(sample) // 2
    if odd_nuls > 0.4 * half and even_nuls < 0.05 * half:
        return "utf-16-le"
    if even_nuls > 0.4 * half and odd_nuls < 0.05 * half:
        return "utf-16-be"
    return None


def _looks_binary(text: str) -> bool:
    sample = text[:_SAMPLE_CHARS]
    if not sample:
        return False
    controls = sum(1 for char in sample if ord(char) in _CONTROL)
    return controls > _MAX_CONTROL_FRACTION * len(sample) or "\x00" in sample
