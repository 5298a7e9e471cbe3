"""PDF to Document with pypdf: text per page, running headers/footers and page numbers
removed, words hyphenated across line ends rejoined, chapters from the outline."""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import BinaryIO

from unlimisum.document import Chapter, Document
from unlimisum.errors import CorruptFileError, NoTextError, PasswordRequiredError, UnsupportedFormatError
from unlimisum.ingest.chapters import name_untitled
from unlimisum.ingest.text import split_chapters

_EDGE_LINES = 2  # lines at the top and at the bottom of a page that may be a header/footer
_MIN_REPEATS = 3  # a header/footer repeats on at least this many pages...
_MIN_REPEAT_FRACTION = 0.25  # ...and on at least this fraction of all pages
_LIGATURES = str.maketrans({"\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl", "\ufb05": "st", "\ufb06": "st"})
_PAGE_NUMBER = re.compile(
    r"^\s*(?:[-\u2013\u2014]\s*)?(?:(?:page|seite|p\.)\s*)?(?:\d{1,5}|[ivxlcdm]{1,7})"
    r"(?:\s*(?:/|of|von)\s*\d{1,5})?(?:\s*[-\u2013\u2014])?\s*$",
    re.I,
)


def read_pdf(file: str | BinaryIO, source: str, password: str | None = None) -> Document:
    """Read a PDF (path or binary file object) into a Document.

    Encrypted PDFs with an empty user password open without one; others need
    ``password`` and raise PasswordRequiredError without it or with a wrong one.
    """
    import pypdf
    from pypdf.errors import DependencyError, FileNotDecryptedError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # repairs of broken files are routine
    try:
        reader = pypdf.PdfReader(file, strict=False)
        _decrypt(reader, source, password)
        pages = list(reader.pages)
    except (PasswordRequiredError, NoTextError):
        raise
    except DependencyError as error:
        raise UnsupportedFormatError(f"PDF needs an optional dependency: {error} (pip install 'pypdf[crypto]')", source=source) from None
    except FileNotDecryptedError:
        raise PasswordRequiredError("PDF is password-protected: give the password with --password", source=source) from None
    except Exception as error:  # pypdf raises many kinds of errors on damaged files
        raise CorruptFileError(f"PDF is damaged or truncated and cannot be read ({_describe(error)})", source=source) from None
    if not pages:
        raise CorruptFileError("PDF has no pages", source=source)

    page_texts, failed = _extract_pages(pages)
    if failed == len(pages):
        raise CorruptFileError("PDF text cannot be extracted from any page", source=source)
    page_texts = remove_running_lines(page_texts)
    if not any(text.strip() for text in page_texts):
        raise NoTextError(
            f"PDF has no text layer ({len(pages)} page(s) of images, e.g. a scan): run OCR on it first",
            source=source,
        )
    chapters = name_untitled(_outline_chapters(reader, page_texts) or _heading_chapters(page_texts))
    info = _metadata(reader)
    warnings = [f"text of {failed} page(s) could not be extracted"] if failed else []
    return Document(
        title=info.get("title") or "",
        author=info.get("author"),
        chapters=tuple(chapters),
        source=source,
        format="pdf",
        metadata={"pages": len(pages), "encrypted": bool(reader.is_encrypted), "warnings": warnings},
    )


def _decrypt(reader, source: str, password: str | None) -> None:
    if not reader.is_encrypted:
        return
    from pypdf import PasswordType

    for candidate in ([password] if password is not None else []) + [""]:
        if reader.decrypt(candidate) != PasswordType.NOT_DECRYPTED:
            return
    if password is None:
        raise PasswordRequiredError("PDF is password-protected: give the password with --password", source=source)
    raise PasswordRequiredError("PDF password is wrong", source=source)


def _extract_pages(pages) -> tuple[list[str], int]:
    texts, failed = [], 0
    for page in pages:
        try:
            texts.append(page.extract_text() or "")
        except Exception:  # one damaged page must not lose the rest of the book
            texts.append("")
            failed += 1
    return texts, failed


def remove_running_lines(page_texts: list[str]) -> list[str]:
    """Drop page numbers and header/footer lines that repeat at the same edge of many pages.

    Digits are ignored when comparing: "41 THE SIEGE" and "THE SIEGE 42" are one header.
    """
    pages = [[line for line in text.split("\n")] for text in page_texts]
    edge_counts: Counter[str] = Counter()
    for lines in pages:
        content = [line for line in lines if line.strip()]
        edge_counts.update({shape for line in _edges(content) if (shape := _shape(line))})
    threshold = max(_MIN_REPEATS, _MIN_REPEAT_FRACTION * len(pages))
    running = {shape for shape, count in edge_counts.items() if count >= threshold}
    cleaned = []
    for lines in pages:
        content = [index for index, line in enumerate(lines) if line.strip()]
        edge = set(_edges(content))
        kept = [
            line
            for index, line in enumerate(lines)
            if index not in edge or not (_shape(line) in running or _PAGE_NUMBER.match(line))
        ]
        cleaned.append("\n".join(kept).strip())
    return cleaned


def _edges(items: list) -> list:
    """The first and last few items; fewer on short pages, so body text stays out of reach."""
    count = min(_EDGE_LINES, max(1, len(items) // 3))
    return items[:count] + items[-count:]


def _shape(line: str) -> str:
    return " ".join(re.sub(r"\d+", " ", line).split()).lower()


def join_pages(page_texts: list[str]) -> str:
    """Join page texts, rejoin words hyphenated across line (or page) ends, drop soft hyphens."""
    text = "\n".join(text for text in page_texts if text)
    text = "\n".join(line.rstrip() for line in text.split("\n")).translate(_LIGATURES)
    text = text.replace("\u00ad\n", "").replace("\u00ad", "")
    return re.sub(r"(?<=[^\W\d_])-\n[ \t]*(?=[^\W\d_])", _dehyphenate, text)


def _dehyphenate(match: re.Match) -> str:
    following = match.string[match.end() : match.end() + 1]
    return "" if following.islower() else "-"  # "Jean-\nPaul" keeps its hyphen


def _outline_chapters(reader, page_texts: list[str]) -> list[Chapter]:
    """Chapters from the outline's top level (its children, when there is one top entry)."""
    try:
        outline = reader.outline
        entries = [item for item in outline if not isinstance(item, list)]
        if len(entries) == 1:
            children = next((item for item in outline if isinstance(item, list)), [])
            entries = [item for item in children if not isinstance(item, list)] or entries
        starts = []
        for entry in entries:
            page = reader.get_destination_page_number(entry)
            if page is not None and 0 <= page < len(page_texts):
                starts.append((page, " ".join(str(entry.title or "").split())))
    except Exception:
        return []
    starts.sort(key=lambda start: start[0])
    if len(starts) < 2:
        return []
    chapters = []
    if starts[0][0] > 0:
        chapters.append(Chapter("", join_pages(page_texts[: starts[0][0]])))
    for index, (page, title) in enumerate(starts):
        end = starts[index + 1][0] if index + 1 < len(starts) else len(page_texts)
        # Two entries on one page: the page goes with the later one, the earlier keeps its title.
        chapters.append(Chapter(title, _without_heading(join_pages(page_texts[page:end]), title)))
    return [chapter for chapter in chapters if chapter.text.strip()]


def _without_heading(text: str, title: str) -> str:
    """The chapter's text without its first line(s) when they only repeat the title."""
    wanted = _words(title)
    lines = text.split("\n")
    for count in range(1, min(3, len(lines)) + 1):
        if _words(" ".join(lines[:count])) == wanted:
            return "\n".join(lines[count:]).strip()
    return text


def _words(text: str) -> str:
    return " ".join(re.sub(r"\W+", " ", text).split()).lower()


def _heading_chapters(page_texts: list[str]) -> list[Chapter]:
    chapters, _ = split_chapters(join_pages(page_texts))
    return chapters


def _metadata(reader) -> dict[str, str]:
    try:
        info = reader.metadata or {}
        title, author = info.get("/Title"), info.get("/Author")
    except Exception:
        return {}
    return {key: " ".join(str(value).split()) for key, value in (("title", title), ("author", author)) if value and str(value).strip()}


def _describe(error: Exception) -> str:
    message = " ".join(str(error).split())[:160]
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
