"""Plain-text ingestion: encodings, boilerplate, chapter headings, bad text inputs."""

from __future__ import annotations

import codecs
import io
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unlimisum.errors import EmptyDocumentError, UnlimisumError, UnsupportedFormatError
from unlimisum.ingest import read_bytes, read_document, read_stdin
from unlimisum.ingest.chapters import MAX_MERGED_OPENING_CHARS, OPENING_PAGES
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
        # 0x81 is undefined in cp1252: a Western paragraph with a stray one is Latin-1
        (("Der Bär läuft über die Straße, während die Vögel im Gebüsch zwitschern. " * 4).encode("cp1252") + b"caf\xe9 \x81\n", "latin-1"),
    ],
)
def test_decodes_every_supported_encoding(data, expected_encoding):
    text, encoding = decode_text(data)
    assert encoding == expected_encoding
    assert "caf" in text and "\ufeff" not in text and "\ufffd" not in text


@pytest.mark.parametrize("data, encoding, replaced", [
    (codecs.BOM_UTF8 + "Grüße, café \ufffd kept\n".encode("utf-8") + b"one \xff bad\n", "utf-8-bom", 1),
    (codecs.BOM_UTF16_LE + "Grüße, café\n".encode("utf-16-le") + b"\x00\xd8" + "ok\n".encode("utf-16-le"),
     "utf-16-le-bom", 1),
    (codecs.BOM_UTF8 + "plain and right\n".encode("utf-8"), "utf-8-bom", 0),
])
def test_bytes_the_named_encoding_cannot_decode_are_counted_and_reported(tmp_path, data, encoding, replaced):
    """A BOM names the encoding: what breaks it becomes U+FFFD, and the reader says so (a U+FFFD the file
    itself holds is text, not counted)."""
    from unlimisum.ingest import read_document
    from unlimisum.ingest.decode import decode_text_counting

    text, found, count = decode_text_counting(data)
    assert (found, count) == (encoding, replaced) and "Gr" in text or "plain" in text
    path = tmp_path / "book.txt"
    path.write_bytes(data)
    warnings = read_document(str(path)).metadata["warnings"]
    assert warnings == ([f"1 byte sequence is not {encoding.removesuffix('-bom')}, which the file's byte-order mark "
                         "says it is: replaced by U+FFFD"] if replaced else [])


# Openings of public-domain books (Tolstoy, Natsume Soseki, Lu Xun), a paragraph or more each.
RUSSIAN = (
    "Все счастливые семьи похожи друг на друга, каждая несчастливая семья несчастлива по-своему.\n\n"
    "Всё смешалось в доме Облонских. Жена узнала, что муж был в связи с бывшею в их доме "
    "француженкою-гувернанткой, и объявила мужу, что не может жить с ним в одном доме. Положение "
    "это продолжалось уже третий день и мучительно чувствовалось и самими супругами, и всеми "
    "членами семьи, и домочадцами.\n"
)
JAPANESE = (
    "吾輩は猫である。名前はまだ無い。\n\n"
    "どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所でニャーニャー泣いていた事だけは"
    "記憶している。吾輩はここで始めて人間というものを見た。しかもあとで聞くとそれは書生という"
    "人間中で一番獰悪な種族であったそうだ。この書生というのは時々我々を捕えて煮て食うという話である。\n"
)
CHINESE = (
    "我冒了严寒，回到相隔二千余里，别了二十余年的故乡去。\n\n"
    "时候既然是深冬；渐近故乡时，天气又阴晦了，冷风吹进船舱中，呜呜的响，从篷隙向外一望，"
    "苍黄的天底下，远近横着几个萧索的荒村，没有一些活气。我的心禁不住悲凉起来了。"
    "阿！这不是我二十年来时时记得的故乡？\n"
)
FRENCH = (
    "À la fin de l'été, où êtes-vous allés ? Là-bas, près de la rivière, la forêt était très "
    "belle et l'eau très fraîche. Ce n'était qu'un rêve, déjà oublié.\n"
)  # charset-normalizer alone reads this as Baltic cp1257: "Ą la fin de l'été, oł źtes-vous"


@pytest.mark.parametrize(
    "text, encoding, names",
    [
        (RUSSIAN, "cp1251", {"cp1251"}),
        (JAPANESE, "shift_jis", {"shift_jis", "cp932"}),
        (CHINESE, "gbk", {"gbk", "gb2312", "gb18030"}),
        (FRENCH, "cp1252", {"cp1252"}),
        (FRENCH * 3, "cp1252", {"cp1252"}),
        ("Der Bär läuft über die Straße. „Schön“, sagt die Kuh … und geht.\n", "cp1252", {"cp1252"}),
        ("Litwo! Ojczyzno moja! ty jesteś jak zdrowie. Ile cię trzeba cenić, ten tylko się dowie, kto cię stracił.\n", "cp1250", {"cp1250"}),
    ],
    ids=["cp1251-russian", "shift_jis-japanese", "gbk-chinese", "cp1252-french", "cp1252-french-long", "cp1252-german", "cp1250-polish"],
)
def test_legacy_encodings_are_detected_not_read_as_cp1252(tmp_path, text, encoding, names):
    path = write(tmp_path, f"{encoding}.txt", text.encode(encoding))
    document = read_document(path)
    assert document.text == text.strip()
    assert document.metadata["encoding"] in names


def test_bytes_no_encoding_explains_are_refused(tmp_path):
    rng = random.Random(7)
    garbage = bytes(byte for byte in rng.randbytes(6000) if byte >= 0x20)  # no NULs, no control characters
    path = write(tmp_path, "noise.txt", garbage)
    with pytest.raises(UnsupportedFormatError) as caught:
        read_document(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: binary data") and "no text encoding" in message and "\n" not in message


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
    # a lone title and author line is no chapter of its own: it opens the first one
    assert titles == ["Chapter 1: Beginnings", "Chapter 2: Middles", "Chapter 3: Endings"]
    assert document.chapters[0].text.startswith("My Little Book\n\nby Jane Writer\n\nThe quick brown fox")
    assert document.chapters[1].text.startswith("The quick brown fox")


def test_untitled_front_matter_is_opening_pages_never_a_chapter_number(tmp_path):
    preface = "A preface without a heading, which says what the book is about at some length. " * 4
    assert len(preface) > MAX_MERGED_OPENING_CHARS
    document = read_document(write(tmp_path, "book.txt", BOOK.replace("by Jane Writer", "by Jane Writer\n\n" + preface).encode()))
    titles = [chapter.title for chapter in document.chapters]
    assert titles == [OPENING_PAGES, "Chapter 1: Beginnings", "Chapter 2: Middles", "Chapter 3: Endings"]
    assert document.chapters[0].text.startswith("My Little Book") and preface.strip() in document.chapters[0].text
    assert document.chapters[1].text.startswith("The quick brown fox")


def test_text_without_headings_stays_one_untitled_part():
    parsed = parse_text("Just a paragraph.\n\nAnd another.\n")
    assert [(chapter.title, chapter.text) for chapter in parsed.chapters] == [("", "Just a paragraph.\n\nAnd another.")]


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


def test_a_heading_loses_only_a_closing_bracket_nothing_opened():
    body = "Some words in this chapter, long enough to be a chapter of a book. " * 3
    text = f"Chapter I.]\n\n{body}\n\nChapter 2: [a] note [b]\n\n{body}\n\nChapter 3: on [x]]\n\n{body}\n"
    chapters, _ = split_chapters(text)
    assert [chapter.title for chapter in chapters] == ["Chapter I.", "Chapter 2: [a] note [b]", "Chapter 3: on [x]"]


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
    assert [chapter.title for chapter in document.chapters] == ["Install", "Use"]
    assert document.chapters[0].text == f"# The Guide\n\n{body}"
    introduction = "An introduction before the first section, long enough to be a part of its own. " * 3
    with_intro = text.replace("# The Guide\n", f"# The Guide\n\n{introduction}\n")
    document = read_document(write(tmp_path, "intro.md", with_intro.encode()))
    assert [chapter.title for chapter in document.chapters] == [OPENING_PAGES, "Install", "Use"]


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
    assert document.source == "-" and len(document.chapters) == 3
    with pytest.raises(EmptyDocumentError, match="^-: empty file$"):
        read_stdin(io.BytesIO(b""))
