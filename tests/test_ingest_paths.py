"""Paths to inputs: directory expansion, hidden files, symlink loops, special files, lying names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unlimisum.errors import InputNotFoundError, UnsupportedFormatError
from unlimisum.ingest import SUPPORTED_SUFFIXES, expand_paths, read_document

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def touch(path: Path, text: str = "Some text.\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


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


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_special_files_are_skipped_in_folders_and_refused_when_named(tmp_path):
    touch(tmp_path / "book.txt")
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    assert expand_paths([tmp_path]) == [tmp_path / "book.txt"]
    with pytest.raises(UnsupportedFormatError, match="not a regular file"):
        read_document(fifo)  # must not block on opening the pipe


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
