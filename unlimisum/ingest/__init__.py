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
from unlimisum.ingest.decode import NotTextError, decode_text_counting
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
    path: str | Path,
    *,
    password: str | None = None,
    limits: IngestLimits = DEFAULT_LIMITS,
    keep_all: bool = False,
) -> Document:
    """Read a text, EPUB or PDF file (format detected from its content) into a Document.

    ``password`` opens password-protected PDFs. ``keep_all`` keeps what is otherwise left
    out of an EPUB as not part of the running text (cover, front and back matter, notes,
    non-linear items); either way ``document.metadata["left_out"]`` lists what was left
    out. Pipes and character devices (``<(cmd)``, ``/dev/stdin``) are read like standard
    input, up to the same size limit. Raises an UnlimisumError subclass whose message
    names the file: InputNotFoundError, EmptyDocumentError, UnsupportedFormatError,
    CorruptFileError, UnsafeFileError, NoTextError, PasswordRequiredError, InputTooLargeError.
    """
    options = dict(password=password, limits=limits, keep_all=keep_all)
    if str(path) == STDIN:
        return read_stdin(**options)
    source = str(path)
    path = Path(path)
    info = _stat_input(path, source)
    if not stat.S_ISREG(info.st_mode):
        return _read_stream_file(path, source, **options)
    with open(path, "rb") as file:
        head = file.read(limits.sniff_bytes)
        kind = _sniff(head, source)
        if kind in (PDF, ZIP):
            file.seek(0)
            document = _read_container(kind, file, source, **options)
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
    keep_all: bool = False,
) -> Document:
    """Read standard input (or ``stream``) as a document named ``name``.

    Bytes are decoded like text files; PDF or EPUB bytes piped in are recognised too.
    A text stream (``io.StringIO``) is taken as already decoded. At most
    ``limits.max_text_bytes`` are read; more is an InputTooLargeError.
    """
    stream = stream if stream is not None else sys.stdin
    source = name
    binary = getattr(stream, "buffer", stream)
    data = binary.read(limits.max_text_bytes + 1)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) > limits.max_text_bytes:
        raise InputTooLargeError(f"input exceeds the {limits.max_text_bytes / MiB:,.0f} MiB limit", source=source)
    return read_bytes(data, source, password=password, limits=limits, keep_all=keep_all)


def read_bytes(
    data: bytes,
    source: str,
    *,
    password: str | None = None,
    limits: IngestLimits = DEFAULT_LIMITS,
    keep_all: bool = False,
) -> Document:
    """Read a whole input already in memory (text, EPUB or PDF bytes)."""
    kind = _sniff(data[: limits.sniff_bytes], source)
    if kind in (PDF, ZIP):
        return _read_container(kind, io.BytesIO(data), source, password=password, limits=limits, keep_all=keep_all)
    return _text_document(data, source, default_title="")


def _read_container(
    kind: str, file: BinaryIO, source: str, *, password: str | None, limits: IngestLimits, keep_all: bool
) -> Document:
    if kind == PDF:
        from unlimisum.ingest.pdf import read_pdf  # pypdf is imported only when needed

        return read_pdf(file, source, password=password)
    from unlimisum.ingest.epub import read_epub

    return read_epub(file, source, limits, keep_all=keep_all)


def _read_stream_file(
    path: Path, source: str, *, password: str | None, limits: IngestLimits, keep_all: bool
) -> Document:
    """A pipe or character device: read it once, like standard input (it cannot seek)."""
    try:
        with open(path, "rb") as stream:  # a named pipe blocks here until a writer opens it
            return read_stdin(stream, name=source, password=password, limits=limits, keep_all=keep_all)
    except PermissionError:
        raise InputError("permission denied", source=source) from None
    except OSError as error:
        raise InputError(f"cannot read ({error.strerror or error})", source=source) from None


def _stat_input(path: Path, source: str) -> os.stat_result:
    """Stat an input: regular files, pipes and character devices pass; the rest is refused."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InputNotFoundError("no such file or directory", source=source) from None
    except PermissionError:
        raise InputError("permission denied", source=source) from None
    except OSError as error:
        raise InputError(f"cannot open ({error.strerror or error})", source=source) from None
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        suffixes = ", ".join(sorted(SUPPORTED_SUFFIXES))
        raise UnsupportedFormatError(f"directory holds no supported files ({suffixes})", source=source)
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        kind = "a socket" if stat.S_ISSOCK(mode) else "a block device" if stat.S_ISBLK(mode) else "a special file"
        raise UnsupportedFormatError(f"{kind}, not a file or pipe that can be read", source=source)
    if not os.access(path, os.R_OK):
        raise InputError("permission denied", source=source)
    return info


def _sniff(head: bytes, source: str) -> str:
    try:
        return sniff_format(head)
    except ValueError as description:
        raise UnsupportedFormatError(f"{description}, not text, EPUB or PDF", source=source) from None


def _replaced_warning(replaced: int, encoding: str) -> str:
    """What became U+FFFD where the file named its encoding (a BOM, or UTF-16's NUL bytes) but broke it."""
    named, by = (encoding.removesuffix("-bom"), "byte-order mark") if encoding.endswith("-bom") else (encoding,
                                                                                                      "NUL bytes")
    return (f"{replaced:,} byte sequence{'s are' if replaced > 1 else ' is'} not {named}, which the file's {by} "
            f"say{'' if by == 'NUL bytes' else 's'} it is: replaced by U+FFFD")


def _text_document(data: bytes, source: str, default_title: str) -> Document:
    if not data.strip():
        raise EmptyDocumentError("empty file" if not data else "file holds only whitespace", source=source)
    try:
        text, encoding, replaced = decode_text_counting(data)
    except NotTextError as problem:
        raise UnsupportedFormatError(f"{problem}, not text, EPUB or PDF", source=source) from None
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
        metadata={"encoding": encoding, "gutenberg": parsed.gutenberg,
                  "warnings": [_replaced_warning(replaced, encoding)] if replaced else []},
    )
