"""Plain text to chapters: Project Gutenberg boilerplate, title/author, chapter headings."""

from __future__ import annotations

import re
from dataclasses import dataclass

from unlimisum.document import Chapter
from unlimisum.ingest.chapters import name_untitled

_NUMBER_WORD = (
    r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen"
    r"|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy"
    r"|eighty|ninety)(?:[- ](?:one|two|three|four|five|six|seven|eight|nine))?"
)
_NUMBER = rf"(?:\d{{1,4}}|[IVXLCDM]{{1,8}}|[ivxlcdm]{{1,8}}|(?i:{_NUMBER_WORD}))"

# "CHAPTER I.", "Chapter 12: The Storm", "BOOK TWO", "## Part 3 - Home", "Chapter I.]".
# The keyword must be capitalised: a wrapped prose line may start with "chapter".
_STRONG_HEADING = re.compile(
    rf"^[ \t]*(?:\#{{1,6}}[ \t]+)?"
    rf"(?:(?:CHAPTER|Chapter|BOOK|Book|PART|Part|VOLUME|Volume|LETTER|Letter|STAVE|Stave)"
    rf"[ \t]+{_NUMBER}\b[.:]?(?:[ \t]*[-\u2013\u2014:.]?[ \t]*\S[^\n]{{0,70}})?"
    rf"|PROLOGUE|Prologue|EPILOGUE|Epilogue)[.\]]*[ \t]*$",
    re.MULTILINE,
)
# "IV", "IV.", "12.", "III. The Return": only counted when blank lines surround them.
_WEAK_HEADING = re.compile(
    r"^[ \t]*(?:[IVXLC]{1,7}|\d{1,3})\.?(?:[ \t]+[A-Z\u00c0-\u024f][^\n]{0,60})?[ \t]*$",
    re.MULTILINE,
)
_MARKDOWN_HEADING = re.compile(r"^(\#{1,2})[ \t]+(\S[^\n]{0,100})$", re.MULTILINE)

_MIN_BODY_CHARS = 80  # a "chapter" with less text than this is a contents-list entry
_MIN_WEAK_HEADINGS = 3  # bare numerals count as headings only when there are several

_PG_START = re.compile(r"^\*{3}[ \t]*START OF (?:THE|THIS) PROJECT GUTENBERG[^\n]*$", re.MULTILINE | re.I)
_PG_END = re.compile(r"^\*{3}[ \t]*END OF (?:THE|THIS) PROJECT GUTENBERG[^\n]*$", re.MULTILINE | re.I)
_PG_FIELD = re.compile(r"^(Title|Author):[ \t]*(\S[^\n]*)$", re.MULTILINE)
_PG_PRODUCED_BY = re.compile(r"\A\s*(?:Produced by|E-text prepared by|Transcribed from)[^\n]*(?:\n[^\n]+)*")
_BY_LINE = re.compile(r"^[ \t]*by[ \t]+(\S[^\n]{0,80}?)[ \t,.]*$", re.MULTILINE | re.I)


@dataclass(frozen=True)
class ParsedText:
    """What plain text yields: chapters plus whatever title/author the text states."""

    chapters: tuple[Chapter, ...]
    title: str | None
    author: str | None
    gutenberg: bool


def parse_text(text: str) -> ParsedText:
    """Split decoded, newline-normalised text into chapters and find its title and author.

    Text before the first heading is named as ``name_untitled`` does (never "Chapter 1").
    """
    title = author = None
    body, header = strip_gutenberg(text)
    gutenberg = header is not None
    if header is not None:
        fields = {name: value.strip() for name, value in _PG_FIELD.findall(header)}
        title, author = fields.get("Title"), fields.get("Author")
    chapters, preamble = split_chapters(body)
    if title is None:
        title, author = _title_from_preamble(preamble, has_chapters=len(chapters) > 1)
    return ParsedText(tuple(name_untitled(chapters)), title, author, gutenberg)


def strip_gutenberg(text: str) -> tuple[str, str | None]:
    """Return (book text, PG header) when the text has PG START/END markers, else (text, None)."""
    start = _PG_START.search(text)
    if start is None:
        return text, None
    end = _PG_END.search(text, start.end())
    body = text[start.end() : end.start() if end else len(text)]
    body = _PG_PRODUCED_BY.sub("", body, count=1)
    return body, text[: start.start()]


def split_chapters(text: str) -> tuple[list[Chapter], str]:
    """Split text at chapter headings; return (chapters, text before the first heading).

    Headings: "Chapter 1"-style lines first; else (at least three) bare numeral lines
    with blank lines around them; else Markdown "#"/"##" headings. Entries of a table of
    contents (headings with almost no text under them) are kept as text, not chapters.
    Without headings the whole text is one untitled chapter.
    """
    headings = _find_headings(text)
    if not headings:
        stripped = text.strip("\n")
        return ([Chapter("", _tidy(stripped))] if stripped.strip() else []), stripped
    # Walk headings; a heading whose body is tiny (a contents entry), or that follows such
    # an entry and recurs later (the contents list's last line), stays in the text.
    later_counts: dict[str, int] = {}
    for _, _, title in headings:
        later_counts[_norm(title)] = later_counts.get(_norm(title), 0) + 1
    kept: list[tuple[int, int, str]] = []
    previous_demoted = False
    for index, (start, end, title) in enumerate(headings):
        later_counts[_norm(title)] -= 1
        next_start = headings[index + 1][0] if index + 1 < len(headings) else len(text)
        tiny = len(text[end:next_start].strip()) < _MIN_BODY_CHARS
        demote = tiny or (previous_demoted and later_counts[_norm(title)] > 0)
        previous_demoted = demote
        if not demote:
            kept.append((start, end, title))
    if not kept:
        stripped = text.strip("\n")
        return [Chapter("", _tidy(stripped))], stripped
    chapters: list[Chapter] = []
    preamble = text[: kept[0][0]]
    if preamble.strip():
        chapters.append(Chapter("", _tidy(preamble)))
    for index, (_, end, title) in enumerate(kept):
        next_start = kept[index + 1][0] if index + 1 < len(kept) else len(text)
        chapters.append(Chapter(title, _tidy(text[end:next_start])))
    return chapters, preamble


def _find_headings(text: str) -> list[tuple[int, int, str]]:
    strong = [heading for m in _STRONG_HEADING.finditer(text) if (heading := _standalone(text, m))]
    if len(strong) >= 2:
        return strong
    weak = [m for m in _WEAK_HEADING.finditer(text) if _blank_before(text, m.start()) and _blank_after(text, m.end())]
    if len(weak) >= _MIN_WEAK_HEADINGS:
        return [(m.start(), m.end(), _clean_title(m.group(0))) for m in weak]
    markdown = list(_MARKDOWN_HEADING.finditer(text))
    for level in ("#", "##"):
        matches = [m for m in markdown if m.group(1) == level]
        if len(matches) >= 2:
            return [(m.start(), m.end(), _clean_title(m.group(2))) for m in matches]
    return []


def _standalone(text: str, match: re.Match) -> tuple[int, int, str] | None:
    """A heading stands alone: a blank line follows it, or (after a blank line) it is short
    or wraps onto exactly one more line. A prose paragraph may begin "BOOK I. (Folio),
    CHAPTER I. ..." and run on for several lines: that is no heading."""
    start, end, line = match.start(), match.end(), match.group(0)
    if _blank_after(text, end):
        return start, end, _clean_title(line)
    if not _blank_before(text, start):
        return None
    if len(line.strip()) <= 40:
        return start, end, _clean_title(line)
    next_end = text.find("\n", end + 1)
    if next_end != -1 and _blank_after(text, next_end):
        return start, next_end, _clean_title(text[start:next_end])
    return None


def _blank_before(text: str, position: int) -> bool:
    if position == 0:
        return True
    previous_line_start = text.rfind("\n", 0, position - 1) + 1
    return not text[previous_line_start : position - 1].strip()


def _blank_after(text: str, position: int) -> bool:
    if position >= len(text):
        return True
    next_line_end = text.find("\n", position + 1)
    return not text[position + 1 : next_line_end if next_line_end != -1 else len(text)].strip()


def _clean_title(line: str) -> str:
    """A heading line as a title: its Markdown #s and spacing gone, and a closing "]" no "[" opened ("Chapter I.]")."""
    title = line.strip().lstrip("#").strip()
    while title.endswith("]") and title.count("]") > title.count("["):
        title = title[:-1]
    return " ".join(title.split())


def _norm(title: str) -> str:
    return re.sub(r"\W+", " ", title).strip().lower()


def _tidy(text: str) -> str:
    """Trailing spaces off each line, runs of blank lines shortened, ends trimmed."""
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def _title_from_preamble(preamble: str, has_chapters: bool) -> tuple[str | None, str | None]:
    """A short first line before the first chapter heading is the title; "by X" the author."""
    lines = [line.strip() for line in preamble.strip().split("\n")]
    markdown_title = re.match(r"#[ \t]+(\S.*)", lines[0]) if lines else None
    if markdown_title:
        title = markdown_title.group(1).strip()
    elif has_chapters and lines and lines[0] and len(lines[0]) <= 80 and len(preamble) < 2000:
        title = lines[0]
    else:
        return None, None
    by = _BY_LINE.search("\n".join(lines[1:10]))
    return title, (by.group(1).strip() if by else None)


def strip_gutenberg_chapters(chapters: list[Chapter]) -> list[Chapter]:
    """Drop Project Gutenberg boilerplate from chapters (PG EPUBs carry it as chapters)."""
    start = next((i for i, chapter in enumerate(chapters) if _PG_START.search(chapter.text)), None)
    if start is None:
        return chapters
    end = next((i for i in range(len(chapters) - 1, start - 1, -1) if _PG_END.search(chapters[i].text)), None)
    kept = list(chapters[start : (end + 1 if end is not None else len(chapters))])
    first = kept[0]
    kept[0] = Chapter(first.title, first.text[_PG_START.search(first.text).end() :].strip())
    if end is not None:
        last = kept[-1]
        kept[-1] = Chapter(last.title, last.text[: _PG_END.search(last.text).start()].strip())
    return [chapter for chapter in kept if chapter.text]
