"""EPUB ingestion: structure, navigation, cleaning, and every kind of broken or hostile book.

Books are built here in tmp_path with zipfile, so each test shows the exact defect.
"""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from unlimisum.errors import CorruptFileError, NoTextError, UnsafeFileError, UnsupportedFormatError
from unlimisum.ingest import IngestLimits, read_bytes, read_document

CONTAINER = (
    '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
    '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
    "</rootfiles></container>"
)
PARAGRAPH = "It was a bright cold day in April, and the clocks were striking all day long."


def xhtml(body: str, body_attributes: str = "", head: str = "") -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?><html xmlns="http://www.w3.org/1999/xhtml" '
        f'xmlns:epub="http://www.idpf.org/2007/ops"><head><title>t</title>{head}</head>'
        f"<body {body_attributes}>{body}</body></html>"
    )


def chapter(number: int) -> str:
    return xhtml(f"<h1>Chapter {number}</h1><p>{PARAGRAPH} ({number})</p><p>Second paragraph {number}.</p>")


def opf(manifest: str, spine: str, metadata: str = "", spine_attributes: str = "") -> str:
    return (
        '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
        '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>Test Book</dc:title>'
        f"<dc:creator>Ann Author</dc:creator><dc:language>en</dc:language>{metadata}</metadata>"
        f"<manifest>{manifest}</manifest><spine {spine_attributes}>{spine}</spine></package>"
    )


def item(item_id: str, href: str, media_type: str = "application/xhtml+xml", properties: str = "") -> str:
    extra = f' properties="{properties}"' if properties else ""
    return f'<item id="{item_id}" href="{href}" media-type="{media_type}"{extra}/>'


NAV = xhtml(
    '<nav epub:type="toc"><ol><li><a href="c1.xhtml">The First</a></li>'
    '<li><a href="c2.xhtml">The Second</a></li></ol></nav>'
    '<nav epub:type="landmarks"><ol><li><a href="c1.xhtml">Start</a></li></ol></nav>'
)


def basic_members() -> dict[str, str | bytes]:
    return {
        "META-INF/container.xml": CONTAINER,
        "OEBPS/content.opf": opf(
            item("nav", "nav.xhtml", properties="nav") + item("c1", "c1.xhtml") + item("c2", "c2.xhtml"),
            '<itemref idref="nav"/><itemref idref="c1"/><itemref idref="c2"/>',
        ),
        "OEBPS/nav.xhtml": NAV,
        "OEBPS/c1.xhtml": chapter(1),
        "OEBPS/c2.xhtml": chapter(2),
    }


def make_epub(path, members: dict[str, str | bytes], mimetype: bytes | None = b"application/epub+zip"):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        if mimetype is not None:
            archive.writestr("mimetype", mimetype, compress_type=zipfile.ZIP_STORED)
        for name, content in members.items():
            archive.writestr(name, content)
    return path


def epub_with(tmp_path, name="book.epub", **changes) -> object:
    members = basic_members()
    for key, value in changes.items():
        member = key.replace("META_INF", "META-INF").replace("__", "/").replace("_dot_", ".")
        if value is None:
            members.pop(member)
        else:
            members[member] = value
    return make_epub(tmp_path / name, members)


# --- structure and navigation ------------------------------------------------------------


def test_epub3_chapters_in_spine_order_titled_from_nav(tmp_path):
    path = epub_with(tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    document = read_document(path)
    assert (document.title, document.author, document.format) == ("Test Book", "Ann Author", "epub")
    assert [chapter.title for chapter in document.chapters] == ["The First", "The Second"]
    assert document.chapters[0].text.startswith("Chapter 1\n\n" + PARAGRAPH)
    assert "Start" not in document.text  # the nav document in the spine is not content
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest  # input untouched


def test_epub2_titles_from_ncx(tmp_path):
    ncx = (
        '<?xml version="1.0"?><ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" version="2005-1"><navMap>'
        '<navPoint id="a"><navLabel><text>Letter One</text></navLabel><content src="c1.xhtml"/></navPoint>'
        '<navPoint id="b"><navLabel><text>Letter Two</text></navLabel><content src="c2.xhtml"/></navPoint>'
        "</navMap></ncx>"
    )
    package = opf(
        item("ncx", "toc.ncx", "application/x-dtbncx+xml") + item("c1", "c1.xhtml") + item("c2", "c2.xhtml"),
        '<itemref idref="c1"/><itemref idref="c2"/>',
        spine_attributes='toc="ncx"',
    )
    path = epub_with(tmp_path, OEBPS__content_dot_opf=package, OEBPS__nav_dot_xhtml=None, OEBPS__toc_dot_ncx=ncx)
    assert [chapter.title for chapter in read_document(path).chapters] == ["Letter One", "Letter Two"]


def test_single_file_book_is_split_at_toc_anchors(tmp_path):
    body = "".join(f'<section id="s{n}"><h2>Part {n}</h2><p>{PARAGRAPH} {n}</p></section>' for n in (1, 2, 3))
    nav = xhtml(
        '<nav epub:type="toc"><ol>'
        + "".join(f'<li><a href="book.xhtml#s{n}">Part {n}</a></li>' for n in (1, 2, 3))
        + "</ol></nav>"
    )
    package = opf(
        item("nav", "nav.xhtml", properties="nav") + item("b", "book.xhtml"), '<itemref idref="b"/>'
    )
    path = epub_with(
        tmp_path,
        OEBPS__content_dot_opf=package,
        OEBPS__nav_dot_xhtml=nav,
        OEBPS__book_dot_xhtml=xhtml(body),
    )
    chapters = read_document(path).chapters
    assert [chapter.title for chapter in chapters] == ["Part 1", "Part 2", "Part 3"]
    assert chapters[1].text == f"{PARAGRAPH} 2"  # heading that repeats the title is dropped


def matter_book(tmp_path):
    """Cover (non-linear), nav, copyright page, two chapters with a footnote, endnotes, a picture."""
    manifest = (
        item("nav", "nav.xhtml", properties="nav") + item("cover", "cover.xhtml") + item("front", "front.xhtml")
        + item("c1", "c1.xhtml") + item("c2", "c2.xhtml") + item("back", "back.xhtml")
        + item("notes", "notes.xhtml") + item("plate", "plate.jpg", "image/jpeg")
    )
    spine = (
        '<itemref idref="cover" linear="no"/><itemref idref="nav"/><itemref idref="front"/><itemref idref="c1"/>'
        '<itemref idref="c2"/><itemref idref="plate"/><itemref idref="back"/><itemref idref="notes"/>'
    )
    footnote = '<aside epub:type="footnote" id="n1"><p>FOOTNOTE TEXT</p></aside>'
    return epub_with(
        tmp_path,
        OEBPS__content_dot_opf=opf(manifest, spine),
        OEBPS__cover_dot_xhtml=xhtml("<p>COVER TEXT</p>"),
        OEBPS__front_dot_xhtml=xhtml("<p>COPYRIGHT TEXT</p>", 'epub:type="frontmatter copyright-page"'),
        OEBPS__c1_dot_xhtml=xhtml(f"<h1>Chapter 1</h1><p>{PARAGRAPH} (1)</p>{footnote}"),
        OEBPS__back_dot_xhtml=xhtml('<section epub:type="backmatter"><p>INDEX TEXT</p></section>'),
        OEBPS__notes_dot_xhtml=xhtml("<h1>Notes</h1><p>ENDNOTE TEXT</p>", 'epub:type="endnotes"'),
        OEBPS__plate_dot_jpg=b"\xff\xd8\xff",
    )


def test_front_and_back_matter_and_non_linear_items_are_left_out_and_listed(tmp_path):
    document = read_document(matter_book(tmp_path))
    text = document.text
    for marked in ("COVER", "COPYRIGHT", "INDEX", "FOOTNOTE", "ENDNOTE"):
        assert marked not in text
    assert PARAGRAPH in text
    assert [chapter.title for chapter in document.chapters] == ["The First", "The Second"]
    expected = [
        "non-linear item (cover.xhtml)",
        "table of contents (nav.xhtml)",
        "copyright page (front.xhtml)",
        "image/jpeg item, not text (plate.jpg)",
        "notes (notes.xhtml)",
        "notes in c1.xhtml",  # parts cut from inside documents that were read come last
        "back matter in back.xhtml",
    ]
    assert document.metadata["left_out"] == expected and document.left_out == tuple(expected)


def test_keep_all_keeps_matter_and_notes_but_not_navigation(tmp_path):
    path = matter_book(tmp_path)
    document = read_document(path, keep_all=True)
    for marked in ("COVER", "COPYRIGHT", "INDEX", "FOOTNOTE", "ENDNOTE"):
        assert marked in document.text
    assert "Start" not in document.text  # the landmarks of the nav document are never text
    assert document.metadata["left_out"] == ["table of contents (nav.xhtml)", "image/jpeg item, not text (plate.jpg)"]
    titles = [chapter.title for chapter in document.chapters]
    assert titles[-1] == "Notes" and "The First" in titles and "" not in titles
    assert read_bytes(path.read_bytes(), "-", keep_all=True).chapters == document.chapters  # threaded through


def test_untitled_opening_document_is_opening_pages_or_joins_the_first_chapter(tmp_path):
    manifest = item("a", "a.xhtml") + item("c1", "c1.xhtml") + item("c2", "c2.xhtml")
    spine = '<itemref idref="a"/><itemref idref="c1"/><itemref idref="c2"/>'
    long_preface = f"<p>{PARAGRAPH}</p>" * 4
    for opening, expected in [(long_preface, ["Opening pages", "Chapter 1", "Chapter 2"]), ("<p>For M.</p>", ["Chapter 1", "Chapter 2"])]:
        path = epub_with(
            tmp_path, name=f"{len(expected)}.epub", OEBPS__content_dot_opf=opf(manifest, spine),
            OEBPS__nav_dot_xhtml=None, OEBPS__a_dot_xhtml=xhtml(opening),
        )
        document = read_document(path)
        assert [chapter.title for chapter in document.chapters] == expected
        assert document.chapters[0].text.startswith(PARAGRAPH if len(expected) == 3 else "For M.")


def test_xhtml_cleaning(tmp_path):
    body = (
        "<h1>Chapter 1</h1><script>var secret = 1;</script><style>p { color: red }</style>"
        '<p>Tokyo&nbsp;is <ruby>東京<rt>とうきょう</rt></ruby> &amp; more.<a epub:type="noteref" href="#n">1</a></p>'
        '<aside epub:type="footnote" id="n"><p>FOOTNOTE</p></aside><p hidden="">HIDDEN</p>'
        "<p>Line one<br/>line two</p>"
    )
    path = epub_with(tmp_path, OEBPS__c1_dot_xhtml=xhtml(body))
    text = read_document(path).chapters[0].text
    assert text == "Chapter 1\n\nTokyo is 東京 & more.\n\nLine one\nline two"


def test_missing_non_document_member_is_a_warning_not_an_error(tmp_path):
    package = opf(
        item("nav", "nav.xhtml", properties="nav") + item("c1", "c1.xhtml") + item("c2", "c2.xhtml")
        + item("audio", "audio/missing.mp3", "audio/mpeg") + item("img", "images/missing.jpg", "image/jpeg"),
        '<itemref idref="c1"/><itemref idref="c2"/>',
    )
    document = read_document(epub_with(tmp_path, OEBPS__content_dot_opf=package))
    assert len(document.chapters) == 2
    assert "OEBPS/audio/missing.mp3" in document.metadata["warnings"][0]


def test_epub_detected_by_content_whatever_the_extension(tmp_path):
    data = epub_with(tmp_path).read_bytes()
    (tmp_path / "book.pdf").write_bytes(data)
    assert read_document(tmp_path / "book.pdf").format == "epub"
    assert read_bytes(data, "-").format == "epub"  # e.g. piped on standard input


# --- broken books -----------------------------------------------------------------------------


def test_missing_spine_document_is_corrupt(tmp_path):
    path = epub_with(tmp_path, OEBPS__c2_dot_xhtml=None)
    with pytest.raises(CorruptFileError, match=r"spine document 'OEBPS/c2.xhtml' is missing") as caught:
        read_document(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_missing_container_or_package(tmp_path):
    with pytest.raises(CorruptFileError, match="lacks META-INF/container.xml"):
        read_document(make_epub(tmp_path / "a.epub", {"OEBPS/c1.xhtml": chapter(1)}))
    with pytest.raises(CorruptFileError, match="package document 'OEBPS/content.opf' is missing"):
        read_document(epub_with(tmp_path, name="b.epub", OEBPS__content_dot_opf=None))


def test_malformed_package_document(tmp_path):
    with pytest.raises(CorruptFileError, match="malformed XML|no spine|no manifest"):
        read_document(epub_with(tmp_path, OEBPS__content_dot_opf="<package><<<not xml"))


def test_truncated_and_non_zip_epubs(tmp_path):
    data = epub_with(tmp_path).read_bytes()
    truncated = tmp_path / "truncated.epub"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match="not a readable zip"):
        read_document(truncated)
    garbage = tmp_path / "garbage.epub"
    garbage.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(UnsupportedFormatError, match="binary data"):
        read_document(garbage)


def test_zip_that_is_not_an_epub(tmp_path):
    path = make_epub(tmp_path / "archive.epub", {"readme.txt": "hello"}, mimetype=None)
    with pytest.raises(UnsupportedFormatError, match="zip archive but not an EPUB"):
        read_document(path)
    odt = make_epub(tmp_path / "doc.epub", {"content.xml": "<x/>"}, mimetype=b"application/vnd.oasis.opendocument.text")
    with pytest.raises(UnsupportedFormatError, match="opendocument"):
        read_document(odt)


def test_image_only_and_fixed_layout_books_have_no_text(tmp_path):
    images = xhtml('<div><img src="page.jpg" alt="page 1"/></div>')
    path = epub_with(tmp_path, OEBPS__c1_dot_xhtml=images, OEBPS__c2_dot_xhtml=images)
    with pytest.raises(NoTextError, match="no text"):
        read_document(path)
    package = opf(
        item("c1", "c1.xhtml") + item("c2", "c2.xhtml"),
        '<itemref idref="c1"/><itemref idref="c2"/>',
        metadata='<meta property="rendition:layout">pre-paginated</meta>',
    )
    pages = xhtml('<div><img src="page.jpg"/><p>p. 1</p></div>')
    fixed = epub_with(tmp_path, name="fixed.epub", OEBPS__content_dot_opf=package, OEBPS__c1_dot_xhtml=pages, OEBPS__c2_dot_xhtml=pages)
    with pytest.raises(NoTextError, match="fixed-layout"):
        read_document(fixed)


# --- hostile books ----------------------------------------------------------------------------


def test_zip_bomb_member_is_refused_without_reading_it_all(tmp_path):
    limits = IngestLimits(max_member_bytes=1 << 20, max_read_bytes=4 << 20)
    path = epub_with(tmp_path, OEBPS__c1_dot_xhtml=xhtml("<p>" + "a" * (3 << 20) + "</p>"))
    assert path.stat().st_size < 100_000  # compresses ~1000:1
    with pytest.raises(UnsafeFileError, match="decompress"):
        read_document(path, limits=limits)


def test_zip_bomb_whole_book_is_refused(tmp_path):
    members = basic_members()
    members.update({f"OEBPS/filler{n}.bin": bytes(1 << 20) for n in range(6)})
    path = make_epub(tmp_path / "bomb.epub", members)
    with pytest.raises(UnsafeFileError, match="zip bomb"):
        read_document(path, limits=IngestLimits(max_book_bytes=4 << 20))
    with pytest.raises(UnsafeFileError, match="members"):
        read_document(path, limits=IngestLimits(max_zip_members=5))


def test_zip_member_header_that_lies_about_its_size(tmp_path):
    path = epub_with(tmp_path)
    data = bytearray(path.read_bytes())
    # Shrink the declared size of c1.xhtml in the central directory: the content is longer.
    name = b"OEBPS/c1.xhtml"
    central = data.rfind(b"PK\x01\x02", 0, data.rfind(name))
    data[central + 24 : central + 28] = (10).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises((CorruptFileError, UnsafeFileError)):
        read_document(path)


@pytest.mark.parametrize("bad_name", ["../evil.xhtml", "/etc/evil.xhtml", "OEBPS/../../evil.xhtml", "C:\\evil.xhtml"])
def test_traversal_member_names_are_refused(tmp_path, bad_name):
    members = basic_members()
    members[bad_name] = "x"
    with pytest.raises(UnsafeFileError, match="unsafe member name"):
        read_document(make_epub(tmp_path / "evil.epub", members))


def test_manifest_href_outside_the_book_is_refused(tmp_path):
    package = opf(item("c1", "../../../etc/passwd"), '<itemref idref="c1"/>')
    with pytest.raises(UnsafeFileError, match="outside the book"):
        read_document(epub_with(tmp_path, OEBPS__content_dot_opf=package))


XXE = (
    '<?xml version="1.0"?><!DOCTYPE html [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>'
    '<html xmlns="http://www.w3.org/1999/xhtml"><body><p>&xxe;</p></body></html>'
)
LAUGHS = (
    '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
    + "".join(f'<!ENTITY lol{n} "{("&lol" + str(n - 1 if n > 1 else "") + ";") * 10}">' for n in range(1, 10))
    + ']><html xmlns="http://www.w3.org/1999/xhtml"><body><p>&lol9;</p></body></html>'
)


@pytest.mark.parametrize("hostile", [XXE, LAUGHS], ids=["xxe", "billion-laughs"])
@pytest.mark.parametrize("member", ["OEBPS/c1.xhtml", "OEBPS/content.opf", "META-INF/container.xml"])
def test_entity_attacks_are_refused(tmp_path, hostile, member):
    members = basic_members()
    members[member] = hostile
    with pytest.raises(UnsafeFileError, match="entities") as caught:
        read_document(make_epub(tmp_path / "hostile.epub", members))
    assert "root:" not in str(caught.value)


def test_entities_never_expanded_even_in_lenient_parsing():
    from unlimisum.ingest.markup import parse_xml, xhtml_segments

    root = parse_xml(b'<html xmlns="http://www.w3.org/1999/xhtml"><body><p>a &undefined; b &eacute;</p></body></html>')
    assert [segment.text for segment in xhtml_segments(root)] == ["a b é"]


def test_unpacked_folder_is_not_read_as_an_epub(tmp_path):
    folder = tmp_path / "unpacked"
    (folder / "META-INF").mkdir(parents=True)
    (folder / "META-INF" / "container.xml").write_text(CONTAINER)
    with pytest.raises(UnsupportedFormatError, match="directory"):
        read_document(folder)


def test_read_from_memory_matches_read_from_file(tmp_path):
    path = epub_with(tmp_path)
    assert read_bytes(path.read_bytes(), str(path)) == read_document(path)


def test_drm_protected_epub_is_named_as_such(tmp_path):
    encryption = '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container"/>'
    path = epub_with(tmp_path, OEBPS__c1_dot_xhtml=bytes(range(256)) * 8, META_INF__encryption_dot_xml=encryption)
    with pytest.raises(UnsupportedFormatError, match="DRM"):
        read_document(path)
