"""An evaluation's data: JSON Lines, one document a line, with its reference summaries.

Each line is an object with

- ``id`` (optional): the document's name in the results; the line number otherwise;
- ``text`` or ``path``: the document itself, or a file unlimisum reads (text, EPUB, PDF), relative to the data
  file's folder;
- ``reference``: a reference summary, or a list of them (a document scored against several references gets, per
  metric, the best of its scores against each, as SCROLLS scores them).

A line that is not such an object is one error naming its line number; a ``path`` that cannot be read names the
file; an empty reference is refused. Blank lines are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from unlimisum.document import Document
from unlimisum.errors import InputError, UnlimisumError


class EvaluationDataError(UnlimisumError):
    """A line of the data file is not a document with its reference: its line number says which."""


@dataclass(frozen=True)
class Item:
    """One document of the data and what it is scored against."""

    id: str
    line: int  # 1-based line of the data file
    references: tuple[str, ...]
    text: str | None = None  # the document's text, when the line gave it
    path: Path | None = None  # else the file it is read from

    def document(self, read) -> Document:
        """The Document: the line's text, or its file read by ``read(path) -> Document``."""
        if self.text is not None:
            return Document.from_text(self.text, source=self.id)
        return read(str(self.path))


def read_items(data: Path) -> list[Item]:
    """The data file's documents, in order; EvaluationDataError for the first line that is not one (its number),
    or for ids that repeat."""
    try:
        lines = data.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise EvaluationDataError(f"cannot be read ({getattr(error, 'strerror', None) or error})",
                                  source=str(data)) from None
    items, seen = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = parse_line(line, number, data.parent)
        except EvaluationDataError as error:  # the data file named, as for every other problem with it
            raise EvaluationDataError(error.problem, source=str(data)) from None
        if item.id in seen:
            raise EvaluationDataError(f"line {number}: id '{item.id}' is already line {seen[item.id]}'s",
                                      source=str(data))
        seen[item.id] = number
        items.append(item)
    if not items:
        raise EvaluationDataError("holds no document (one JSON object a line: text or path, and reference)",
                                  source=str(data))
    return items


def parse_line(line: str, number: int, folder: Path) -> Item:
    """One line: an Item, or EvaluationDataError naming ``number`` and what is wrong."""
    def wrong(problem: str) -> EvaluationDataError:
        return EvaluationDataError(f"line {number}: {problem}")

    try:
        record = json.loads(line)
    except ValueError as error:
        raise wrong(f"not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise wrong(f"not a JSON object but {type(record).__name__}")
    has_text, has_path = "text" in record, "path" in record
    if has_text == has_path:
        raise wrong("needs exactly one of 'text' (the document) and 'path' (a file relative to the data file)")
    identity = record.get("id", number)
    if not isinstance(identity, (str, int)) or isinstance(identity, bool) or str(identity) == "":
        raise wrong("'id' must be a nonempty string or an integer")
    references = record.get("reference")
    if isinstance(references, str):
        references = [references]
    if not isinstance(references, list) or not references or not all(isinstance(r, str) for r in references):
        raise wrong("'reference' must be a string or a nonempty list of strings")
    if any(not reference.strip() for reference in references):
        raise wrong("a reference is empty: nothing could be scored against it")
    if has_text:
        if not isinstance(record["text"], str) or not record["text"].strip():
            raise wrong("'text' must be nonempty text")
        return Item(str(identity), number, tuple(references), text=record["text"])
    if not isinstance(record["path"], str) or not record["path"]:
        raise wrong("'path' must be a file name")
    return Item(str(identity), number, tuple(references), path=folder / record["path"])


def read_document_of(item: Item, read) -> Document:
    """``item.document(read)``, an unreadable file's error naming the line that points at it."""
    try:
        return item.document(read)
    except InputError as error:
        raise type(error)(f"{error.problem} (line {item.line} of the data)", source=error.source) from None
