"""Bytes to text for plain-text inputs: BOMs, UTF-8, UTF-16, legacy encodings; never crashes.

Legacy (non-UTF) encodings are detected with charset-normalizer, limited to the encodings
books are actually written in (so German text does not come out as Mac Turkish); Windows-1252
wins when another Latin code page fits no better, and names the result when it gives the
same text. Latin code pages stay ambiguous for short texts and for some languages (Hungarian
or Croatian in cp1250 may read as cp1252): other scripts (Cyrillic, Greek, CJK...) do not.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from charset_normalizer import CharsetMatch

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

# The legacy encodings plain-text books come in (Python codec names): Windows code pages
# and their ISO 8859 cousins, the Cyrillic KOI8/DOS pages, and the East Asian encodings.
LEGACY_ENCODINGS: tuple[str, ...] = (
    "cp1252", "latin_1", "iso8859_15",  # Western European
    "cp1250", "iso8859_2",  # Central European
    "cp1251", "koi8_r", "koi8_u", "cp866", "iso8859_5",  # Cyrillic
    "cp1253", "iso8859_7",  # Greek
    "cp1254", "iso8859_9",  # Turkish
    "cp1255", "iso8859_8",  # Hebrew
    "cp1256", "iso8859_6",  # Arabic
    "cp1257", "iso8859_13",  # Baltic
    "cp1258",  # Vietnamese
    "cp874", "tis_620",  # Thai
    "shift_jis", "cp932", "euc_jp", "iso2022_jp",  # Japanese
    "gb2312", "gbk", "gb18030", "big5", "big5hkscs", "cp950",  # Chinese
    "euc_kr", "cp949", "iso2022_kr",  # Korean
)  # fmt: skip
# When the detected encoding decodes the bytes to the same text as one of these, that
# familiar name is reported (German text is "cp1252", not "cp1250" or "iso8859_13").
_FAMILIAR_ENCODINGS: tuple[str, ...] = ("cp1252", "latin-1")
_COHERENCE_MARGIN = 0.01  # another code page must read this much more like a language than cp1252
# Supersets charset-normalizer tends to report, named after their base when that decodes the
# bytes to the same text (a Shift-JIS file is "shift_jis" unless it uses Microsoft's extras).
_BASE_ENCODINGS = {"cp932": "shift_jis", "gb18030": "gbk", "cp949": "euc_kr", "cp950": "big5"}


class NotTextError(ValueError):
    """The bytes are binary data, not text in any encoding we recognise; ``str()`` says why."""


def decode_text(data: bytes) -> tuple[str, str]:
    """Decode a text file's bytes; return ``(text, encoding_name)``.

    Order: a byte-order mark decides; else BOM-less UTF-16 (many NULs on one side);
    else strict UTF-8; else the legacy encoding charset-normalizer finds among
    LEGACY_ENCODINGS (Windows-1251, Shift-JIS, GBK, Windows-1252...). Line endings are
    normalised to ``\\n``. Raises NotTextError for binary data and for bytes that no
    encoding explains. Where a BOM (or BOM-less UTF-16) names the encoding, bytes it cannot
    decode become U+FFFD: ``decode_text_counting`` says how many.
    """
    text, encoding, _ = decode_text_counting(data)
    return text, encoding


def decode_text_counting(data: bytes) -> tuple[str, str, int]:
    """``decode_text``, and how many byte sequences the named encoding could not decode (each now U+FFFD)."""
    text, encoding, replaced = _decode(data)
    if _looks_binary(text):
        raise NotTextError("binary data")
    return normalise_newlines(text), encoding, replaced


def normalise_newlines(text: str) -> str:
    """CRLF and lone CR become LF; a trailing Ctrl-Z (DOS end of file) goes."""
    return text.replace("\r\n", "\n").replace("\r", "\n").rstrip("\x1a")


def _decode(data: bytes) -> tuple[str, str, int]:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            text, replaced = _decode_replacing(data[len(bom) :], encoding)
            return text, encoding + "-bom", replaced
    utf16 = _guess_bomless_utf16(data)
    if utf16:
        text, replaced = _decode_replacing(data, utf16)
        return text, utf16, replaced
    if b"\x00" in data:
        raise NotTextError("binary data (NUL bytes)")
    try:
        return data.decode("utf-8"), "utf-8", 0
    except UnicodeDecodeError:
        return (*detect_legacy(data), 0)


def _decode_replacing(data: bytes, encoding: str) -> tuple[str, int]:
    """(text, how many sequences became U+FFFD): ``data`` decoded in ``encoding``, bytes it cannot decode
    replaced (a U+FFFD the file itself holds is not counted)."""
    try:
        return data.decode(encoding), 0
    except UnicodeDecodeError:
        text = data.decode(encoding, errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode(encoding))


def detect_legacy(data: bytes) -> tuple[str, str]:
    """Decode bytes in a legacy encoding found by charset-normalizer; ``(text, encoding)``.

    Windows-1252 wins unless another code page reads more clearly as a language (see
    ``_prefer_western``). Raises NotTextError when no encoding in LEGACY_ENCODINGS explains
    the bytes.
    """
    from charset_normalizer import from_bytes  # imported only for non-UTF-8 files

    matches = list(from_bytes(data, cp_isolation=list(LEGACY_ENCODINGS)))
    if not matches:
        raise NotTextError("binary data (no text encoding explains its bytes)")
    best = _prefer_western(matches)
    text = str(best)
    return text, _familiar_name(data, text, best.encoding)


def _prefer_western(matches: list[CharsetMatch]) -> CharsetMatch:
    """The match that reads as Windows-1252, unless another reads as a language more clearly.

    Latin-script code pages decode most letters alike, so several usually fit as well as
    each other; then the most common one, cp1252, is the better bet than charset-normalizer's
    first pick (French must not come out as Baltic cp1257). Polish in cp1250 or Turkish in
    cp1254 read more coherently in their own code page, and other scripts (Cyrillic, Greek,
    CJK) do not read as cp1252 at all.
    """
    best = matches[0]
    western = next((m for m in matches if m.encoding == "cp1252" or "cp1252" in m.could_be_from_charset), None)
    if western is None or best.coherence > western.coherence + _COHERENCE_MARGIN:
        return best
    return western


def _familiar_name(data: bytes, text: str, encoding: str) -> str:
    """cp1252 or latin-1 when they decode to the same text, else the base of a superset, else ``encoding``."""
    for familiar in (*_FAMILIAR_ENCODINGS, _BASE_ENCODINGS.get(encoding)):
        try:
            if familiar and data.decode(familiar) == text:
                return familiar
        except UnicodeDecodeError:
            continue
    return encoding


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
