"""PDF ingestion: outline chapters, running headers/footers, hyphenation, encryption, damage."""

from __future__ import annotations

import io

import pytest

from unlimisum.errors import CorruptFileError, NoTextError, PasswordRequiredError
from unlimisum.ingest import read_bytes, read_document
from unlimisum.ingest.chapters import OPENING_PAGES
from unlimisum.ingest.pdf import join_pages, remove_running_lines

fpdf = pytest.importorskip("fpdf")
pypdf = pytest.importorskip("pypdf")

LINE = "The harbour lights came on one by one along the curve of the bay."


def make_pdf(
    chapters: list[tuple[str, list[str]]], header: str | None = "Running Header", outline: bool = True, front: tuple[str, ...] = ()
) -> bytes:
    """A PDF with one or more pages per chapter, a running header and page numbers; ``front``
    pages come first, outside the outline."""

    class PDF(fpdf.FPDF):
        def header(self) -> None:
            if header:
                self.set_font("Helvetica", "", 8)
                self.cell(0, 5, header, new_x="LMARGIN", new_y="NEXT")

        def footer(self) -> None:
            self.set_y(-12)
            self.set_font("Helvetica", "", 8)
            self.cell(0, 5, str(self.page_no()), align="C")

    pdf = PDF()
    pdf.set_title("A Generated Book")
    pdf.set_author("Test Author")
    for lines in front:
        pdf.add_page()
        pdf.set_font("Helvetica", "", 10)
        for line in lines.split("\n"):
            pdf.cell(0, 5, line, new_x="LMARGIN", new_y="NEXT")
    for title, pages in chapters:
        for number, lines in enumerate(pages):
            pdf.add_page()
            if number == 0:
                if outline:
                    pdf.start_section(title)
                pdf.set_font("Helvetica", "B", 14)
                pdf.cell(0, 8, title, new_x="LMARGIN", new_y="NEXT")
            pdf.set_font("Helvetica", "", 10)
            for line in lines.split("\n"):
                pdf.cell(0, 5, line, new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def book(pages_per_chapter: int = 2) -> bytes:
    return make_pdf([(f"Chapter {n}", [f"{LINE} ({n}.{p})" for p in range(pages_per_chapter)]) for n in (1, 2, 3)])


def test_outline_chapters_metadata_and_clean_pages(tmp_path):
    path = tmp_path / "book.pdf"
    path.write_bytes(book())
    document = read_document(path)
    assert (document.format, document.title, document.author) == ("pdf", "A Generated Book", "Test Author")
    assert [chapter.title for chapter in document.chapters] == ["Chapter 1", "Chapter 2", "Chapter 3"]
    assert document.chapters[1].text == f"{LINE} (2.0)\n{LINE} (2.1)"  # no header, page number, title line
    assert document.metadata["pages"] == 6


def test_pages_before_the_first_bookmark_are_opening_pages_or_join_chapter_1():
    chapters = [(f"Chapter {n}", [f"{LINE} ({n})"]) for n in (1, 2, 3)]
    title_page = read_bytes(make_pdf(chapters, front=("A Generated Book\nby Test Author",)), "t.pdf")
    assert [chapter.title for chapter in title_page.chapters] == ["Chapter 1", "Chapter 2", "Chapter 3"]
    assert title_page.chapters[0].text.startswith("A Generated Book\nby Test Author")
    preface = "\n".join([LINE] * 6)
    with_preface = read_bytes(make_pdf(chapters, front=(preface, preface)), "p.pdf")
    assert [chapter.title for chapter in with_preface.chapters] == [OPENING_PAGES, "Chapter 1", "Chapter 2", "Chapter 3"]
    assert with_preface.chapters[0].text.count(LINE) == 12 and with_preface.chapters[1].text == f"{LINE} (1)"


def test_without_outline_the_text_is_one_chapter_and_headers_still_go():
    data = make_pdf([("Notes", [LINE] * 4)], outline=False)
    document = read_bytes(data, "notes.pdf")
    assert len(document.chapters) == 1 and document.chapters[0].title == ""
    assert "Running Header" not in document.text and document.text.count(LINE) == 4


def test_hyphenated_words_are_rejoined_across_lines_and_pages():
    pages = ["the harbour was beauti-\nful that night, said Jean-\nPaul, and the", "sea was calm-", "ly waiting for boats"]
    text = read_bytes(make_pdf([("Chapter 1", pages)], header=None, outline=False), "h.pdf").text
    assert "beautiful that night" in text and "said Jean-Paul" in text and "calmly waiting" in text


def test_join_pages_and_running_lines_units():
    assert join_pages(["a beauti-  \nful day", "wonder-", "ful"]) == "a beautiful day\nwonderful"
    assert join_pages(["ﬁne ﬂour", "soft\u00adware"]) == "fine flour\nsoftware"
    pages = [f"My Book {n}\nbody text {n}\n- {n} -" for n in range(1, 6)]
    assert remove_running_lines(pages) == [f"body text {n}" for n in range(1, 6)]


def test_image_only_pdf_has_no_text_layer():
    pdf = fpdf.FPDF()
    pdf.add_page()
    pdf.rect(20, 20, 100, 150, style="F")
    with pytest.raises(NoTextError, match="no text layer"):
        read_bytes(bytes(pdf.output()), "scan.pdf")


@pytest.mark.parametrize("cut", [100, 0.5, -50])
def test_truncated_pdf_is_corrupt(tmp_path, cut):
    data = book()
    size = int(len(data) * cut) if isinstance(cut, float) else cut
    path = tmp_path / "cut.pdf"
    path.write_bytes(data[:size])
    with pytest.raises((CorruptFileError, NoTextError)) as caught:
        read_document(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_garbage_after_pdf_header_is_corrupt(tmp_path):
    path = tmp_path / "garbage.txt"  # the extension lies too
    path.write_bytes(b"%PDF-1.7\n" + b"\x00\xff garbage " * 200)
    with pytest.raises(CorruptFileError, match="damaged or truncated"):
        read_document(path)


def encrypt(data: bytes, user: str, owner: str, algorithm: str) -> bytes:
    writer = pypdf.PdfWriter(clone_from=io.BytesIO(data))
    writer.encrypt(user_password=user, owner_password=owner, algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


@pytest.mark.parametrize("algorithm", ["RC4-128", "AES-256"])
def test_password_protected_pdf(algorithm):
    data = encrypt(book(1), "secret", "owner-pw", algorithm)
    with pytest.raises(PasswordRequiredError, match="--password"):
        read_bytes(data, "locked.pdf")
    with pytest.raises(PasswordRequiredError, match="wrong"):
        read_bytes(data, "locked.pdf", password="guess")
    assert LINE in read_bytes(data, "locked.pdf", password="secret").text


@pytest.mark.parametrize("algorithm", ["RC4-40", "AES-256"])
def test_empty_user_password_opens_without_asking(algorithm):
    data = encrypt(book(1), "", "owner-pw", algorithm)
    document = read_bytes(data, "perms.pdf")
    assert document.metadata["encrypted"] and LINE in document.text
