"""Every file of the shared real-world corpus ingests correctly or fails with the right message.

The corpus lives beside the repository (``../shared/corpus``); see its SOURCES.md.
These tests are skipped when it is absent. Each file must have an entry below.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from unlimisum import errors
from unlimisum.ingest import expand_paths, read_document
from unlimisum.ingest.chapters import OPENING_PAGES

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"
pytestmark = pytest.mark.skipif(not CORPUS.is_dir(), reason=f"corpus not found at {CORPUS}")

# file -> (format, title contains, author contains, minimum chapters, minimum characters, phrase in text)
READABLE = {
    "txt_pride-and-prejudice_pg1342_utf8.txt": ("text", "pride-and-prejudice", None, 61, 700_000, "It is a truth universally acknowledged"),
    "txt_moby-dick_pg2701_utf8-bom.txt": ("text", "Moby Dick", "Melville", 136, 1_150_000, "Call me Ishmael"),
    "txt_ontboezemingen_pg24675_latin1-crlf.txt": ("text", "Ontboezemingen", "Gabriël", 3, 300_000, "GABRIËL"),
    "epub2_frankenstein_pg84_ncx-only.epub": ("epub", "Frankenstein", "Shelley", 28, 400_000, "You will rejoice to hear"),
    "epub3_moby-dick_idpf.epub": ("epub", "Moby-Dick", "Melville", 136, 1_150_000, "Call me Ishmael"),
    "epub3_childrens-literature_idpf_single-xhtml.epub": ("epub", "Children", "Curry", 20, 250_000, "THE REAL PRINCESS"),
    "epub3_kusamakura_ja_vertical_idpf.epub": ("epub", "草枕", "漱石", 13, 90_000, "山路を登りながら"),
    "epub3_kusamakura_ja_missing-audio_idpf.epub": ("epub", "草枕", "漱石", 13, 90_000, "山路を登りながら"),
    "epub3_regime-anticancer_ar_rtl_idpf.epub": ("epub", "Régime", "Khayat", 1, 25_000, "السرطان"),
    "pdf_geotopo_de_117pages.pdf": ("pdf", "Geometrie und Topologie", "Thoma", 8, 120_000, "Topologische Räume"),
    "pdf_multicolumn.pdf": ("pdf", "multicolumn", None, 1, 6_500, "Lorem ipsum"),
    "pdf_multilang_ar-ru-zh-th-ja.pdf": ("pdf", "multilang", None, 1, 100, "Привет, мир"),
    "pdf_encrypted_rc4-40_empty-user-password.pdf": ("pdf", "", None, 1, 30, "pdf encryption test"),
    "pdf_encrypted_aes256_empty-user-password.pdf": ("pdf", "", None, 1, 30, "pdf encryption test"),
    "pdf_scanned_with-ocr-layer_vicksburg.pdf": ("pdf", "", None, 1, 10_000, "VICKSBURG"),
    "pdf_broken-xref_issue297.pdf": ("pdf", "", None, 1, 10, "test example"),
    "SOURCES.md": ("text", "Real-world input corpus", None, 2, 5_000, "What this means for the ingest code"),
}
FAILING = {
    "epub3_page-blanche_fixed-layout_idpf.epub": (errors.NoTextError, "fixed-layout EPUB"),
    "pdf_encrypted_rc4_password-openpassword.pdf": (errors.PasswordRequiredError, "password-protected"),
    "pdf_image-only_no-text-layer.pdf": (errors.NoTextError, "no text layer"),
    "pdf_malformed_invalid-pages-tree.pdf": (errors.CorruptFileError, "Invalid object in /Pages"),
}


@functools.lru_cache(maxsize=None)
def read(name: str):
    """Each readable book is read once per test session (the 117-page PDF takes seconds)."""
    return read_document(CORPUS / name)


def test_every_corpus_file_has_an_expectation():
    names = {path.name for path in CORPUS.iterdir() if not path.name.startswith(".")}
    assert names == set(READABLE) | set(FAILING)
    assert {path.name for path in expand_paths([CORPUS])} == names


@pytest.mark.parametrize("name", sorted(READABLE))
def test_readable_corpus_file(name):
    file_format, title, author, min_chapters, min_chars, phrase = READABLE[name]
    document = read(name)
    assert document.format == file_format and document.source == str(CORPUS / name)
    assert title in document.title
    assert author is None or author in (document.author or "")
    assert len(document.chapters) >= min_chapters and document.char_count >= min_chars
    assert phrase in document.text
    assert "\r" not in document.text and "\ufeff" not in document.text
    assert all(chapter.text.strip() for chapter in document.chapters)
    if len(document.chapters) > 1:  # every part has a name; none is numbered by whoever lists them
        assert all(chapter.title for chapter in document.chapters)


@pytest.mark.parametrize("name", sorted(FAILING))
def test_failing_corpus_file(name):
    error_class, message = FAILING[name]
    with pytest.raises(error_class, match=message) as caught:
        read_document(CORPUS / name)
    assert str(caught.value).startswith(f"{CORPUS / name}: ") and "\n" not in str(caught.value)


def test_password_opens_the_protected_pdf():
    document = read_document(CORPUS / "pdf_encrypted_rc4_password-openpassword.pdf", password="openpassword")
    assert "Lorem ipsum" in document.text
    with pytest.raises(errors.PasswordRequiredError, match="wrong"):
        read_document(CORPUS / "pdf_encrypted_rc4_password-openpassword.pdf", password="nope")


def test_text_structure_of_gutenberg_books():
    moby = read("txt_moby-dick_pg2701_utf8-bom.txt")
    titles = [chapter.title for chapter in moby.chapters]
    assert titles[1] == "CHAPTER 1. Loomings." and titles[-1] == "Epilogue" and len(titles) == 137
    assert "START OF THE PROJECT GUTENBERG" not in moby.text and "Project Gutenberg License" not in moby.text
    sources = read("SOURCES.md")  # Markdown "##" headings are chapters
    assert sources.chapters[0].title == OPENING_PAGES
    assert [chapter.title for chapter in sources.chapters][1:3] == ["Sources and licenses", "What each file tests, and what ebooklib 0.20 / pypdf 7.1.1 did with it"]
    pride = read("txt_pride-and-prejudice_pg1342_utf8.txt")
    assert pride.chapters[1].title == "Chapter I." and pride.chapters[-1].title == "CHAPTER LXI."


def test_epub_structure():
    moby = read("epub3_moby-dick_idpf.epub")
    assert moby.chapters[0].title == "Chapter 1. Loomings." and moby.chapters[-1].title == "Epilogue"
    assert "Original Transcriber" not in moby.text  # marked frontmatter
    assert moby.metadata["left_out"][:2] == ["non-linear item (cover.xhtml)", "table of contents (toc.xhtml)"]
    assert "copyright page in copyright.xhtml" in moby.metadata["left_out"]
    kept = read_document(CORPUS / "epub3_moby-dick_idpf.epub", keep_all=True)
    assert kept.metadata["left_out"] == ["table of contents (toc.xhtml)"]
    kept_titles = [chapter.title for chapter in kept.chapters]
    assert kept_titles[0].startswith("Original Transcriber") and kept_titles[-1] == "Copyright Page"
    frankenstein = read("epub2_frankenstein_pg84_ncx-only.epub")
    assert "Letter 1" in [chapter.title for chapter in frankenstein.chapters]
    assert "PROJECT GUTENBERG LICENSE" not in frankenstein.text.upper()
    missing_audio = read("epub3_kusamakura_ja_missing-audio_idpf.epub")
    assert missing_audio.chapters == read("epub3_kusamakura_ja_vertical_idpf.epub").chapters
    assert "fmse004b.mp3" in missing_audio.metadata["warnings"][0]


def test_pdf_structure():
    geotopo = read("pdf_geotopo_de_117pages.pdf")
    assert geotopo.metadata["pages"] == 117
    titles = [chapter.title for chapter in geotopo.chapters]
    assert "1 Topologische Grundbegriffe" in titles
    assert titles[0] == OPENING_PAGES and "Vorwort" in geotopo.chapters[0].text  # pages before the first bookmark
    assert "\ufb00" not in geotopo.text  # ligatures unfolded
    vicksburg = read("pdf_scanned_with-ocr-layer_vicksburg.pdf")
    assert "dangerous" in vicksburg.text  # "dan-" + "gerous" rejoined
    assert vicksburg.text.count("SIEGE") < 3  # running header dropped from most pages
