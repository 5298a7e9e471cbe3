"""Ingestion: files, folders and standard input to Documents.

Public API: ``read_document``, ``read_stdin``, ``expand_paths``, ``SUPPORTED_SUFFIXES``,
``IngestLimits``. Formats are told apart by content, never by file name; every failure
is an UnlimisumError whose one-line message names the input. Inputs are only read.
"""

from __future__ import annotations

import dataclasses
import io
import os
import stat
import sys
from pathlib import Path
from typing import BinaryIO

from unlimisum.document import Document
from unlimisum.errors import (
    EmptyDocumentError,
    InputError,
    InputNotFoundError,
    InputTooLargeError,
    UnsupportedFormatError,
)
from unlimisum.ingest.decode import NotTextError, decode_text
from unlimisum.ingest.detect import PDF, ZIP, sniff_format
from unlimisum.ingest.limits import DEFAULT_LIMITS, MiB, IngestLimits
from unlimisum.ingest.paths import STDIN, SUPPORTED_SUFFIXES, expand_paths
from unlimisum.ingest.text import parse_text

__all__ = [
    "IngestLimits",
    "STDIN",
    "SUPPORTED_SUFFIXES",
    "expand_paths",
    "read_bytes",
    "read_document",
    "read_stdin",
]


def read_document(
    path: str | Path, *, password: str | None = None, limits: IngestLimits = DEFAULT_LIMITS
) -> Document:
    """Read a text, EPUB or PDF file (format detected from its content) into a Document.

    ``password`` opens password-protected PDFs. Raises an UnlimisumError subclass whose
    message names the file: InputNotFoundError, EmptyDocumentError, UnsupportedFormatError,
    CorruptFileError, UnsafeFileError, NoTextError, PasswordRequiredError, InputTooLargeError.
    """
    if str(path) == STDIN:
        return read_stdin(password=password, limits=limits)
    source = str(path)
    path = Path(path)
    info = _stat_regular_file(path, source)
    with open(path, "rb") as file:
        head = file.read(limits.sniff_bytes)
        kind = _sniff(head, source)
        if kind in (PDF, ZIP):
            file.seek(0)
            document = _read_container(kind, file, source, password, limits)
            return document if document.title else dataclasses.replace(document, title=path.stem)
        if info.st_size > limits.max_text_bytes:
            raise InputTooLargeError(
                f"text file of {info.st_size / MiB:,.0f} MiB exceeds the {limits.max_text_bytes / MiB:,.0f} MiB limit",
                source=source,
            )
        data = head + file.read(limits.max_text_bytes + 1 - len(head))
    return _text_document(data, source, default_title=path.stem)


def read_stdin(
    stream: BinaryIO | io.TextIOBase | None = None,
    *,
    name: str = STDIN,
    password: str | None = None,
    limits: IngestLimits = DEFAULT_LIMITS,
) -> Document:
    """Read standard input (or ``stream``) as a document named ``name``.

    Bytes are decoded like text files; PDF or EPUB bytes piped in are recognised too.
    A text stream (``io.StringIO``) is taken as already decoded.
    """
    stream = stream if stream is not None else sys.stdin
    source = name
    binary = getattr(stream, "buffer", stream)
    data = binary.read(limits.max_text_bytes + 1)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) > limits.max_text_bytes:
        raise InputTooLargeError(f"input exceeds the {limits.max_text_bytes / MiB:,.0f} MiB limit", source=source)
    return read_bytes(data, source, password=password, limits=limits)


def read_bytes(
    data: bytes, source: str, *, password: str | None = None, limits: IngestLimits = DEFAULT_LIMITS
) -> Document:
    """Read a whole input already in memory (text, EPUB or PDF bytes)."""
    kind = _sniff(data[: limits.sniff_bytes], source)
    if kind in (PDF, ZIP):
        return _read_container(kind, io.BytesIO(data), source, password, limits)
    return _text_document(data, source, default_title="")


def _read_container(kind: str, file: BinaryIO, source: str, password: str | None, limits: IngestLimits) -> Document:
    if kind == PDF:
        from unlimisum.ingest.pdf import read_pdf  # pypdf is imported only when needed

        return read_pdf(file, source, password=password)
    from unlimisum.ingest.epub import read_epub

    return read_epub(file, source, limits)


def _stat_regular_file(path: Path, source: str) -> os.stat_result:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InputNotFoundError("no such file or directory", source=source) from None
    except PermissionError:
        raise InputError("permission denied", source=source) from None
    except OSError as error:
        raise InputError(f"cannot open ({error.strerror or error})", source=source) from None
    if stat.S_ISDIR(info.st_mode):
        suffixes = ", ".join(sorted(SUPPORTED_SUFFIXES))
        raise UnsupportedFormatError(f"directory holds no supported files ({suffixes})", source=source)
    if not stat.S_ISREG(info.st_mode):
        raise UnsupportedFormatError("not a regular file (device, pipe or socket)", source=source)
    if not os.access(path, os.R_OK):
        raise InputError("permission denied", source=source)
    return info


def _sniff(head: bytes, source: str) -> str:
    try:
        return sniff_format(head)
    except ValueError as description:
        raise UnsupportedFormatError(f"{description}, not text, EPUB or PDF", source=source) from None


def _text_document(data: bytes, source: str, default_title: str) -> Document:
    if not data.strip():
        raise EmptyDocumentError("empty file" if not data else "file holds only whitespace", source=source)
    try:
        text, encoding = decode_text(data)
    except NotTextError:
        raise UnsupportedFormatError("binary data, not text, EPUB or PDF", source=source) from None
    if not text.strip():
        raise EmptyDocumentError("file holds only whitespace", source=source)
    parsed = parse_text(text)
    if not parsed.chapters:
        raise EmptyDocumentError("no text after removing boilerplate", source=source)
    return Document(
        title=parsed.title or default_title,
        author=parsed.author,
        chapters=parsed.chapters,
        source=source,
        format="text",
        metadata={"encoding": encoding, "gutenberg": parsed.gutenberg, "warnings": []},
    )
