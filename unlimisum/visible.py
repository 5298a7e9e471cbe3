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

Markup is never the text's own: Rich is given these strings escaped or as ``Text`` (never as markup), the page
escapes them as HTML, and a Markdown file or pipe gets them through ``markdown_text``: every character Markdown
could read as the start of markup escaped with a backslash (CommonMark shows any backslash-escaped ASCII
punctuation as the character itself), so that a renderer shows a book's ``<img src=...>``, ``[text](url)``,
``<!--``, ``_italics_`` or a line starting ``# `` as the characters the book holds: no image is fetched, no link
made, nothing hidden, no heading or list begun. Printed on a terminal, where nothing renders it, the text is left
as written (``visible`` alone).
"""

from __future__ import annotations

import re

_PICTURES = {code: chr(0x2400 + code) for code in range(0x20) if code not in (0x09, 0x0A)}
_PICTURES[0x7F] = "\u2421"
_PICTURES.update({code: "\ufffd" for code in range(0x80, 0xA0)})
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in [0x7F, *range(0x80, 0xA0)]}
# Markdown reads these anywhere in a line as markup: a backslash escape, a code span or fence, emphasis, a link,
# image or footnote ([ ]), raw HTML, a comment or an autolink (<), an entity (&), a table cell (|),
# strikethrough or a fence (~), and in some renderers math ($)
_MARKDOWN_INLINE = re.compile(r"([\\`*_\[\]<&|~$])")
_MARKDOWN_INLINE_IN_LINE = re.compile(r"([\\`*_\[\]<&|~$#])")
# ... and these at the start of a line: a heading, a quote, a list item, a setext heading's underline or a
# thematic break, and an ordered list item's number (its "." or ")" escaped); a line's indent goes (four spaces
# or a tab would begin a code block, which shows backslashes as written; a paragraph drops its lines' indents)
_MARKDOWN_LINE_MARK = re.compile(r"^([#>+=-])", re.MULTILINE)
_MARKDOWN_NUMBER_MARK = re.compile(r"^(\d{1,9})([.)])", re.MULTILINE)
_MARKDOWN_INDENT = re.compile(r"^[ \t]+", re.MULTILINE)


def visible(text: str) -> str:
    """``text`` with every control character but tab and newline shown as a symbol (see the module docstring)."""
    return text.translate(_PICTURES)


def json_text(dumped: str) -> str:
    """JSON text from ``json.dumps(..., ensure_ascii=False)`` with DEL and the C1 controls escaped as ``\\u00XX``
    (JSON itself escapes the C0 ones): the same value when parsed, nothing a terminal acts on when printed. Outside
    strings JSON holds ASCII punctuation only, so every such character is inside a string."""
    return dumped.translate(_JSON_ESCAPES)


def markdown_text(text: str, line_start: bool = True) -> str:
    """``text`` (a document's or a model's) for Markdown that a renderer reads: its control characters shown as
    symbols (``visible``) and every character Markdown could read as markup escaped with a backslash, so that it
    renders as the characters themselves (see the module docstring). ``line_start``: whether ``text`` begins a
    line (a piece from the middle of one cannot begin a heading or a list)."""
    return _markdown_escaped(visible(text), _MARKDOWN_INLINE, line_start)


def markdown_line(text: str) -> str:
    """``markdown_text`` for a place within one line, after a mark of its own (a heading, a table cell, a
    footnote): its whitespace (newlines too) made single spaces, and ``#`` escaped wherever it stands (a heading's
    closing #s are not its text)."""
    return _markdown_escaped(visible(" ".join(text.split())), _MARKDOWN_INLINE_IN_LINE, False)


def _markdown_escaped(text: str, inline: re.Pattern, line_start: bool) -> str:
    lead = "" if line_start else "x"  # a character before it: its first line's start is no line start
    marked = _MARKDOWN_INDENT.sub("", lead + inline.sub(r"\\\1", text))
    return _MARKDOWN_NUMBER_MARK.sub(r"\1\\\2", _MARKDOWN_LINE_MARK.sub(r"\\\1", marked))[len(lead):]
