"""Paths to inputs: directory expansion, hidden files, symlink loops, special files, lying names."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from unlimisum.errors import EmptyDocumentError, InputNotFoundError, InputTooLargeError, UnsupportedFormatError
from unlimisum.ingest import SUPPORTED_SUFFIXES, IngestLimits, expand_paths, read_document

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def touch(path: Path, text: str = "Some text.\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def feed(pipe: Path | int, data: bytes) -> threading.Thread:
    """Write ``data`` into a named pipe (or a pipe's write end) from another thread, then close it."""

    def write() -> None:
        try:
            with open(pipe, "wb") as stream:  # blocks until the reader opens a named pipe
                stream.write(data)
        except BrokenPipeError:  # the reader stopped at its size limit
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_supported_suffixes():
    assert {".txt", ".md", ".epub", ".pdf"} <= SUPPORTED_SUFFIXES


def test_directory_is_expanded_recursively_sorted_skipping_hidden_and_unsupported(tmp_path):
    wanted = [touch(tmp_path / name) for name in ("b.txt", "a.MD", "sub/c.epub", "sub/deeper/d.PDF", "z.text")]
    for name in (".hidden.txt", ".git/config.txt", "sub/.cache/e.txt", "image.png", "README", "notes.docx"):
        touch(tmp_path / name)
    assert expand_paths([tmp_path]) == sorted(wanted)


def test_explicit_paths_pass_through_in_order(tmp_path):
    extensionless = touch(tmp_path / "README")
    hidden = touch(tmp_path / ".notes.txt")
    missing = tmp_path / "missing.txt"
    assert expand_paths(["-", extensionless, hidden, missing]) == ["-", extensionless, hidden, missing]
    assert read_document(extensionless).text == "Some text."  # content decides, not the name
    with pytest.raises(InputNotFoundError, match="no such file") as caught:
        read_document(missing)
    assert str(caught.value) == f"{missing}: no such file or directory"


def test_empty_directory_is_reported_when_read(tmp_path):
    (tmp_path / "empty").mkdir()
    touch(tmp_path / "empty" / "picture.jpg")
    assert expand_paths([tmp_path / "empty"]) == [tmp_path / "empty"]
    with pytest.raises(UnsupportedFormatError, match="directory holds no supported files"):
        read_document(tmp_path / "empty")


def test_symlink_loops_are_not_followed_forever(tmp_path):
    book = touch(tmp_path / "root" / "inner" / "book.txt")
    os.symlink(tmp_path / "root", tmp_path / "root" / "inner" / "loop")
    os.symlink(tmp_path / "root" / "inner", tmp_path / "root" / "again")
    os.symlink(tmp_path / "nowhere", tmp_path / "root" / "dangling.txt")
    found = expand_paths([tmp_path / "root"])
    assert [path.resolve() for path in found] == [book.resolve()]


def test_symlinked_file_is_read(tmp_path):
    book = touch(tmp_path / "real" / "book.txt")
    (tmp_path / "links").mkdir()
    os.symlink(book, tmp_path / "links" / "alias.txt")
    assert expand_paths([tmp_path / "links"]) == [tmp_path / "links" / "alias.txt"]


needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")


@needs_fifo
def test_pipes_are_skipped_in_folders(tmp_path):
    touch(tmp_path / "book.txt")
    os.mkfifo(tmp_path / "pipe.txt")
    assert expand_paths([tmp_path]) == [tmp_path / "book.txt"]  # must not block on opening the pipe


@needs_fifo
@pytest.mark.parametrize("sample, expected_format", [("story.txt", "text"), ("story.pdf", "pdf"), ("story.epub", "epub")])
def test_named_pipe_is_read_and_its_format_detected_from_the_bytes(tmp_path, sample, expected_format):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = feed(fifo, (SAMPLES / sample).read_bytes())
    document = read_document(fifo)
    writer.join(timeout=10)
    assert document.format == expected_format and document.source == str(fifo)
    assert document.title == "The Cartographer of Low Tide"
    assert [chapter.title for chapter in document.chapters][-1] == "Chapter 4: What the Sea Keeps"


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev/fd (what <(command) expands to)")
def test_process_substitution_path_is_read():
    read_end, write_end = os.pipe()
    try:
        writer = feed(write_end, (SAMPLES / "story.txt").read_bytes())
        document = read_document(f"/dev/fd/{read_end}")
        writer.join(timeout=10)
    finally:
        os.close(read_end)
    assert document.source == f"/dev/fd/{read_end}" and len(document.chapters) == 4


@needs_fifo
def test_pipe_longer_than_the_limit_fails_clearly(tmp_path):
    fifo = tmp_path / "big.txt"
    os.mkfifo(fifo)
    writer = feed(fifo, b"All work and no play makes Jack a dull boy.\n" * 1000)
    with pytest.raises(InputTooLargeError) as caught:
        read_document(fifo, limits=IngestLimits(max_text_bytes=10_000))
    writer.join(timeout=10)
    assert str(caught.value).startswith(f"{fifo}: input exceeds the ") and str(caught.value).endswith(" limit")


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_character_device_is_read_like_a_pipe():
    with pytest.raises(EmptyDocumentError, match="^/dev/null: empty file$"):
        read_document("/dev/null")


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs Unix sockets")
def test_sockets_and_directories_are_refused_clearly(tmp_path):
    with tempfile.TemporaryDirectory() as folder, socket.socket(socket.AF_UNIX) as server:
        path = Path(folder) / "s"  # socket paths are limited to about 100 characters
        server.bind(str(path))
        with pytest.raises(UnsupportedFormatError) as caught:
            read_document(path)
        assert str(caught.value) == f"{path}: a socket, not a file or pipe that can be read"
    with pytest.raises(UnsupportedFormatError, match="directory holds no supported files"):
        read_document(tmp_path)


@pytest.mark.parametrize(
    "sample, lie, expected_format",
    [("story.pdf", "story.txt", "pdf"), ("story.epub", "story.pdf", "epub"), ("story.txt", "story.epub", "text")],
)
def test_lying_extensions_are_detected_by_content(tmp_path, sample, lie, expected_format):
    path = tmp_path / lie
    path.write_bytes((SAMPLES / sample).read_bytes())
    document = read_document(path)
    assert document.format == expected_format
    assert len(document.chapters) >= 4
