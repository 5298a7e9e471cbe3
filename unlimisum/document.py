"""The document every input becomes: a title and ordered chapters of clean text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Chapter:
    """One chapter: its title (may be empty) and its clean text."""

    title: str
    text: str


@dataclass(frozen=True)
class Document:
    """A readable input: text, EPUB, PDF or standard input.

    ``source`` is the path as given (``"-"`` for standard input); ``format`` is one of
    ``"text"``, ``"epub"``, ``"pdf"``. ``metadata`` holds what the reader found besides
    the text: ``"warnings"`` (always), ``"encoding"`` (text), ``"pages"`` (PDF), and
    ``"left_out"`` (EPUB: parts left out of the chapters, see ``left_out``).
    """

    title: str
    chapters: tuple[Chapter, ...]
    source: str = "-"
    format: str = "text"
    author: str | None = None
    metadata: dict = field(default_factory=dict, compare=False)

    @property
    def text(self) -> str:
        """The whole document: chapter texts joined by blank lines."""
        return "\n\n".join(chapter.text for chapter in self.chapters if chapter.text)

    @property
    def left_out(self) -> tuple[str, ...]:
        """Short descriptions of what the reader left out, e.g. ``"cover (cover.xhtml)"``."""
        return tuple(self.metadata.get("left_out", ()))

    @property
    def char_count(self) -> int:
        """Characters over all chapters."""
        return sum(len(chapter.text) for chapter in self.chapters)

    @classmethod
    def from_text(cls, text: str, title: str = "", source: str = "-") -> "Document":
        """A one-chapter document from a string (no chapter detection)."""
        return cls(title=title, chapters=(Chapter(title="", text=text),), source=source)
