"""The last step of every reader: untitled parts get a neutral name, never a chapter's.

Text before the first titled chapter (a title page, a preface without a heading, a PDF's
pages before its first bookmark) becomes a chapter called "Opening pages"; when it is only
a line or two (a title and an author), it becomes the start of the first chapter instead.
An untitled part after a titled chapter continues that chapter. A document without any
titled chapter is left as it is: its one part is the whole text, not a chapter.
"""

from __future__ import annotations

from collections.abc import Sequence

from unlimisum.document import Chapter

OPENING_PAGES = "Opening pages"
MAX_MERGED_OPENING_CHARS = 200  # shorter untitled opening text joins the first chapter


def name_untitled(chapters: Sequence[Chapter]) -> list[Chapter]:
    """Chapters where only a whole-text single part may be untitled (see the module doc)."""
    first_titled = next((index for index, chapter in enumerate(chapters) if chapter.title), None)
    if first_titled is None:
        return list(chapters)
    named: list[Chapter] = []
    for chapter in chapters[first_titled:]:
        if chapter.title or not named:
            named.append(chapter)
        elif chapter.text.strip():
            named[-1] = Chapter(named[-1].title, _join(named[-1].text, chapter.text))
    opening = _join(*(chapter.text for chapter in chapters[:first_titled]))
    if len(opening) > MAX_MERGED_OPENING_CHARS:
        named.insert(0, Chapter(OPENING_PAGES, opening))
    elif opening:
        named[0] = Chapter(named[0].title, _join(opening, named[0].text))
    return named


def _join(*texts: str) -> str:
    return "\n\n".join(text for text in texts if text.strip())
