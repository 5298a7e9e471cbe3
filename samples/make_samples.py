"""Render samples/story.txt as samples/story.epub and samples/story.pdf.

    python samples/make_samples.py

story.txt is the source: a title line, a "by ..." line, a short note, then chapters
headed "Chapter N: Title", paragraphs separated by blank lines. The EPUB is written by
hand with zipfile (EPUB 3 with a nav document and an NCX); the PDF with fpdf2 (a test
dependency), with an outline, a running header and page numbers, so that both readers'
chapter and header/footer handling have something to do. Output is deterministic:
fixed timestamps and identifiers, so regenerating changes nothing unless the story does.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXED_ZIP_TIME = (2025, 1, 1, 0, 0, 0)
FIXED_MODIFIED = "2025-01-01T00:00:00Z"
BOOK_ID = "urn:unlimisum:samples:story"


@dataclass
class Story:
    title: str
    author: str
    note: list[str]
    chapters: list[tuple[str, list[str]]]  # (heading, paragraphs)


def parse_story(text: str) -> Story:
    """Split the story file into title, author, front note and chapters."""
    blocks = [block.strip() for block in re.split(r"\n\s*\n", text.strip()) if block.strip()]
    title, byline = blocks[0], blocks[1]
    note: list[str] = []
    chapters: list[tuple[str, list[str]]] = []
    for block in blocks[2:]:
        if re.match(r"Chapter \d+:", block):
            chapters.append((block, []))
        elif chapters:
            chapters[-1][1].append(" ".join(block.split()))
        else:
            note.append(" ".join(block.split()))
    return Story(title, re.sub(r"^by\s+", "", byline), note, chapters)


# --- EPUB --------------------------------------------------------------------------------

CONTAINER = """<?xml version="1.0" encoding="UTF-8"?>
<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">
  <rootfiles>
    <rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>
  </rootfiles>
</container>
"""


def _xhtml(title: str, body: str, body_type: str) -> str:
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE html>
<html xmlns="http://www.w3.org/1999/xhtml" xmlns:epub="http://www.idpf.org/2007/ops" xml:lang="en" lang="en">
<head><title>{escape(title)}</title></head>
<body epub:type="{body_type}">
{body}
</body>
</html>
"""


def epub_members(story: Story) -> dict[str, str]:
    """Every member of the EPUB except the mimetype, by zip name."""
    files = {"META-INF/container.xml": CONTAINER}
    title_page = f"<h1>{escape(story.title)}</h1>\n<p>by {escape(story.author)}</p>\n" + "".join(
        f"<p><em>{escape(p)}</em></p>\n" for p in story.note
    )
    files["OEBPS/title.xhtml"] = _xhtml(story.title, title_page, "frontmatter titlepage")
    chapter_names = []
    for number, (heading, paragraphs) in enumerate(story.chapters, start=1):
        name = f"chapter-{number}.xhtml"
        chapter_names.append(name)
        body = f'<section epub:type="chapter" id="chapter-{number}">\n<h2>{escape(heading)}</h2>\n'
        body += "".join(f"<p>{escape(p)}</p>\n" for p in paragraphs) + "</section>"
        files[f"OEBPS/{name}"] = _xhtml(heading, body, "bodymatter")
    links = "".join(
        f'    <li><a href="{name}">{escape(heading)}</a></li>\n'
        for name, (heading, _) in zip(chapter_names, story.chapters)
    )
    nav_body = f'<nav epub:type="toc" id="toc">\n  <h1>Contents</h1>\n  <ol>\n{links}  </ol>\n</nav>'
    files["OEBPS/nav.xhtml"] = _xhtml("Contents", nav_body, "frontmatter toc")
    nav_points = "".join(
        f'    <navPoint id="np-{n}" playOrder="{n}"><navLabel><text>{escape(heading)}</text></navLabel>'
        f'<content src="{name}"/></navPoint>\n'
        for n, (name, (heading, _)) in enumerate(zip(chapter_names, story.chapters), start=1)
    )
    files["OEBPS/toc.ncx"] = f"""<?xml version="1.0" encoding="UTF-8"?>
<ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" version="2005-1">
  <head><meta name="dtb:uid" content="{BOOK_ID}"/></head>
  <docTitle><text>{escape(story.title)}</text></docTitle>
  <navMap>
{nav_points}  </navMap>
</ncx>
"""
    manifest = "".join(
        f'    <item id="c{n}" href="{name}" media-type="application/xhtml+xml"/>\n'
        for n, name in enumerate(chapter_names, start=1)
    )
    spine = "".join(f'    <itemref idref="c{n}"/>\n' for n in range(1, len(chapter_names) + 1))
    files["OEBPS/content.opf"] = f"""<?xml version="1.0" encoding="UTF-8"?>
<package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="book-id" xml:lang="en">
  <metadata xmlns:dc="http://purl.org/dc/elements/1.1/">
    <dc:identifier id="book-id">{BOOK_ID}</dc:identifier>
    <dc:title>{escape(story.title)}</dc:title>
    <dc:creator>{escape(story.author)}</dc:creator>
    <dc:language>en</dc:language>
    <dc:rights>Free to use for any purpose.</dc:rights>
    <meta property="dcterms:modified">{FIXED_MODIFIED}</meta>
  </metadata>
  <manifest>
    <item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>
    <item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>
    <item id="title" href="title.xhtml" media-type="application/xhtml+xml"/>
{manifest}  </manifest>
  <spine toc="ncx">
    <itemref idref="title"/>
{spine}  </spine>
</package>
"""
    return files


def write_epub(story: Story, path: Path) -> None:
    """EPUB container rules: "mimetype" first and stored, then everything deflated."""
    with zipfile.ZipFile(path, "w") as archive:
        mimetype = zipfile.ZipInfo("mimetype", FIXED_ZIP_TIME)
        archive.writestr(mimetype, "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        for name, content in epub_members(story).items():
            info = zipfile.ZipInfo(name, FIXED_ZIP_TIME)
            archive.writestr(info, content.encode("utf-8"), compress_type=zipfile.ZIP_DEFLATED)


# --- PDF ---------------------------------------------------------------------------------


def write_pdf(story: Story, path: Path) -> None:
    """A5 pages, core Helvetica (the story is ASCII), outline entry per chapter."""
    import datetime

    from fpdf import FPDF

    class StoryPDF(FPDF):
        def header(self) -> None:
            if self.page_no() > 1:
                self.set_font("Helvetica", "I", 8)
                self.cell(0, 6, story.title, align="C", new_x="LMARGIN", new_y="NEXT")
                self.ln(2)

        def footer(self) -> None:
            self.set_y(-12)
            self.set_font("Helvetica", "", 8)
            self.cell(0, 6, str(self.page_no()), align="C")

    pdf = StoryPDF(format=(148, 210))  # A5 in millimetres
    pdf.set_title(story.title)
    pdf.set_author(story.author)
    pdf.set_creator("samples/make_samples.py")
    pdf.set_producer("fpdf2")
    pdf.set_creation_date(datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc))
    pdf.set_auto_page_break(auto=True, margin=16)
    pdf.add_page()
    pdf.set_font("Helvetica", "B", 18)
    pdf.multi_cell(0, 9, story.title, align="C", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", "", 11)
    pdf.multi_cell(0, 7, f"by {story.author}", align="C", new_x="LMARGIN", new_y="NEXT")
    pdf.ln(6)
    pdf.set_font("Helvetica", "I", 10)
    for paragraph in story.note:
        pdf.multi_cell(0, 5, paragraph, align="C", new_x="LMARGIN", new_y="NEXT")
    for heading, paragraphs in story.chapters:
        pdf.add_page()
        pdf.start_section(heading)
        pdf.set_font("Helvetica", "B", 13)
        pdf.multi_cell(0, 7, heading, new_x="LMARGIN", new_y="NEXT")
        pdf.ln(3)
        pdf.set_font("Helvetica", "", 10)
        for paragraph in paragraphs:
            pdf.multi_cell(0, 5, paragraph, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(2)
    pdf.output(str(path))


def main() -> None:
    story = parse_story((HERE / "story.txt").read_text(encoding="utf-8"))
    write_epub(story, HERE / "story.epub")
    write_pdf(story, HERE / "story.pdf")
    print(f"wrote {HERE / 'story.epub'} and {HERE / 'story.pdf'} ({len(story.chapters)} chapters)")


if __name__ == "__main__":
    main()
