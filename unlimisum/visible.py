"""Text from a document or a model on its way to a reader: control characters shown, never obeyed.

A book's title, a chapter heading, a passage, a summary, a file name: any of them may hold control characters
(ESC starts the terminal sequences that clear a screen, set a window's title or write the clipboard; a C1 CSI
does the same in one byte; a carriage return overwrites a line). Wherever such text goes to a terminal, a
Markdown file or an HTML page, ``visible`` shows each of them as a symbol instead, so the reader sees that it is
there and nothing acts on it:

- C0 controls other than tab and newline (U+0000-U+001F) as their Control Pictures, U+2400-U+241F (ESC is ␛,
  a carriage return ␍, BEL ␇);
- DEL (U+007F) as ␡ (U+2421);
- C1 controls (U+0080-U+009F), which have no pictures, as � (U+FFFD).

JSON keeps the exact text: JSON escapes control characters in strings, and ``json_text`` makes it escape DEL and
C1 too (``json.dumps(..., ensure_ascii=False)`` writes those as they are), so that a JSON line printed on a terminal
is as inert as the rest and still parses back to the document's own characters.

Markup is the renderer's concern: Rich is given these strings escaped or as ``Text`` (never as markup), the page
escapes them as HTML, and Markdown shows them as written.
"""

from __future__ import annotations

_PICTURES = {code: chr(0x2400 + code) for code in range(0x20) if code not in (0x09, 0x0A)}
_PICTURES[0x7F] = "\u2421"
_PICTURES.update({code: "\ufffd" for code in range(0x80, 0xA0)})
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in [0x7F, *range(0x80, 0xA0)]}


def visible(text: str) -> str:
    """``text`` with every control character but tab and newline shown as a symbol (see the module docstring)."""
    return text.translate(_PICTURES)


def json_text(dumped: str) -> str:
    """JSON text from ``json.dumps(..., ensure_ascii=False)`` with DEL and the C1 controls escaped as ``\\u00XX``
    (JSON itself escapes the C0 ones): the same value when parsed, nothing a terminal acts on when printed. Outside
    strings JSON holds ASCII punctuation only, so every such character is inside a string."""
    return dumped.translate(_JSON_ESCAPES)
