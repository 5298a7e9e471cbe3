"""Plain-text ingestion: encodings, boilerplate, chapter headings, bad text inputs."""

from __future__ import annotations

import codecs
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unlimisum.errors import EmptyDocumentError, UnlimisumError, UnsupportedFormatError
from unlimisum.ingest import read_bytes, read_document, read_stdin
from unlimisum.ingest.decode import decode_text
from unlimisum.ingest.text import parse_text, split_chapters

BOOK = """My Little Book

by Jane Writer


Chapter 1: Beginnings

{p}

Chapter 2: Middles

{p}

Chapter 3: Endings

{p}
""".format(p="The quick brown fox jumps over the lazy dog. " * 5)


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


# --- encodings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected_encoding",
    [
        ("Grüße, café — naïve\n".encode("utf-8"), "utf-8"),
        (codecs.BOM_UTF8 + "Grüße, café\n".encode("utf-8"), "utf-8-bom"),
        (codecs.BOM_UTF16_LE + "Grüße, café\n".encode("utf-16-le"), "utf-16-le-bom"),
        (codecs.BOM_UTF16_BE + "Grüße, café\n".encode("utf-16-be"), "utf-16-be-bom"),
        ("Grüße, café and plenty of ASCII text\n".encode("utf-16-le"), "utf-16-le"),
        ("Grüße, café — “quoted”\n".encode("cp1252"), "cp1252"),
        (b"caf\xe9 \x81 undefined in cp1252\n", "latin-1"),
    ],
)
def test_decodes_every_supported_encoding(data, expected_encoding):
    text, encoding = decode_text(data)
    assert encoding == expected_encoding
    assert "caf" in text and "\ufeff" not in text and "\ufffd" not in text


def test_bom_is_stripped_and_crlf_normalised(tmp_path):
    path = write(tmp_path, "bom.txt", codecs.BOM_UTF8 + b"Hello\r\nworld\rend\r\n")
    document = read_document(path)
    assert document.text == "Hello\nworld\nend"
    assert document.metadata["encoding"] == "utf-8-bom"


def test_cp1252_file_reads_with_smart_quotes(tmp_path):
    path = write(tmp_path, "legacy.txt", "He said “hello” — and left.\r\n".encode("cp1252"))
    assert read_document(path).text == "He said “hello” — and left."


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_never_crash(data):
    try:
        document = read_bytes(data, "fuzz.txt")
    except UnlimisumError as error:
        assert str(error).startswith("fuzz.txt: ") and "\n" not in str(error)
    else:
        assert document.char_count > 0


# --- bad text inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("data, message", [(b"", "empty file"), (b" \n\t\r\n  ", "only whitespace")])
def test_empty_and_whitespace_files(tmp_path, data, message):
    path = write(tmp_path, "empty.txt", data)
    with pytest.raises(EmptyDocumentError) as caught:
        read_document(path)
    assert str(caught.value) == f"{path}: {'empty file' if not data else 'file holds only whitespace'}"
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "data, description",
    [
        (bytes(range(256)) * 8, "binary data"),
        (b"\x89PNG\r\n\x1a\n" + bytes(200), "PNG image"),
        (b"\x7fELF\x02\x01\x01" + bytes(100), "executable"),
        (b"text with a NUL\x00 in it", "binary data"),
    ],
)
def test_binary_file_with_text_extension(tmp_path, data, description):
    path = write(tmp_path, "notes.txt", data)
    with pytest.raises(UnsupportedFormatError, match=description) as caught:
        read_document(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_input_file_is_not_modified(tmp_path):
    data = codecs.BOM_UTF8 + BOOK.replace("\n", "\r\n").encode("utf-8")
    path = write(tmp_path, "book.txt", data)
    before = path.stat().st_mtime_ns
    read_document(path)
    assert path.read_bytes() == data and path.stat().st_mtime_ns == before


# --- chapters, titles, Project Gutenberg ------------------------------------------------------


def test_chapter_headings_title_and_author(tmp_path):
    document = read_document(write(tmp_path, "book.txt", BOOK.encode()))
    assert document.title == "My Little Book"
    assert document.author == "Jane Writer"
    titles = [chapter.title for chapter in document.chapters]
    assert titles == ["", "Chapter 1: Beginnings", "Chapter 2: Middles", "Chapter 3: Endings"]
    assert document.chapters[1].text.startswith("The quick brown fox")


def test_no_headings_gives_one_chapter_titled_by_file_name(tmp_path):
    document = read_document(write(tmp_path, "plain-notes.txt", b"Just a paragraph.\n\nAnd another.\n"))
    assert len(document.chapters) == 1
    assert document.chapters[0].text == "Just a paragraph.\n\nAnd another."
    assert document.title == "plain-notes" and document.format == "text"


def test_roman_and_uppercase_headings():
    body = "Some words in this chapter, long enough to be a chapter of a book. " * 3
    text = f"CHAPTER I.\n\n{body}\n\nCHAPTER II.\n\n{body}\n\nCHAPTER III\n\n{body}\n"
    chapters, _ = split_chapters(text)
    assert [chapter.title for chapter in chapters] == ["CHAPTER I.", "CHAPTER II.", "CHAPTER III"]


def test_bare_numeral_headings_need_blank_lines_around_them():
    body = "A poem line that goes on for a while, and then a little while longer still. " * 2
    text = "\n\n".join(f"{numeral}.\n\n{body}" for numeral in ("I", "II", "III", "IV"))
    chapters, _ = split_chapters(text)
    assert [chapter.title for chapter in chapters] == ["I.", "II.", "III.", "IV."]


def test_markdown_headings(tmp_path):
    body = "Text of the section, with enough words in it to count as a real chapter body here."
    text = f"# The Guide\n\n## Install\n\n{body}\n\n## Use\n\n{body}\n"
    document = read_document(write(tmp_path, "guide.md", text.encode()))
    assert document.title == "The Guide"
    assert [chapter.title for chapter in document.chapters][-2:] == ["Install", "Use"]


def test_table_of_contents_entries_are_not_chapters():
    body = "The real chapter text runs on here, sentence after sentence, for a good while. " * 3
    text = (
        "CONTENTS\n\nCHAPTER 1. Dawn\n\nCHAPTER 2. Dusk\n\nEpilogue\n\nA FOREWORD\n\n" + body
        + f"\n\nCHAPTER 1. Dawn\n\n{body}\n\nCHAPTER 2. Dusk\n\n{body}\n\nEpilogue\n\n{body}\n"
    )
    chapters, _ = split_chapters(text)
    assert [chapter.title for chapter in chapters] == ["", "CHAPTER 1. Dawn", "CHAPTER 2. Dusk", "Epilogue"]
    assert "CONTENTS" in chapters[0].text and "A FOREWORD" in chapters[0].text


def test_prose_line_starting_with_book_is_not_a_heading():
    paragraph = (
        "BOOK I. (Folio), CHAPTER I. (Sperm Whale).--This whale, among the\n"
        "English of old vaguely known as the Trumpa whale, is the largest\n"
        "inhabitant of the globe."
    )
    body = "Chapter body text that is long enough to count as a chapter of its own. " * 2
    text = f"CHAPTER 1. One\n\n{body}\n\n{paragraph}\n\nCHAPTER 2. Two\n\n{body}\n"
    chapters, _ = split_chapters(text)
    assert [chapter.title for chapter in chapters] == ["CHAPTER 1. One", "CHAPTER 2. Two"]


def test_gutenberg_boilerplate_is_stripped_and_header_gives_title_author():
    text = (
        "The Project Gutenberg eBook of Sample\n\nTitle: A Sample Book\n\nAuthor: Ann Author\n\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK A SAMPLE BOOK ***\n\n"
        "Produced by Volunteers\nat the Online Team\n\nThe story itself.\n\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK A SAMPLE BOOK ***\n\nLicense text, many pages.\n"
    )
    parsed = parse_text(text)
    assert (parsed.title, parsed.author, parsed.gutenberg) == ("A Sample Book", "Ann Author", True)
    assert "".join(chapter.text for chapter in parsed.chapters) == "The story itself."


def test_stdin_bytes_and_text_streams():
    assert read_stdin(io.BytesIO("héllo\r\nworld".encode("cp1252"))).text == "héllo\nworld"
    document = read_stdin(io.StringIO(BOOK))
    assert document.source == "-" and len(document.chapters) == 4
    with pytest.raises(EmptyDocumentError, match="^-: empty file$"):
        read_stdin(io.BytesIO(b""))
