"""EPUB 2/3 to Document: container -> OPF -> spine documents, titled from the nav or NCX.

ebooklib is deliberately not used for reading: it loads every member (images, fonts,
audio) into memory, raises a raw KeyError for a manifest entry missing from the zip,
parses with a default XML parser and will read arbitrary paths from an unpacked folder.
Here the zip is read through SafeZip (bounded, name-checked) and every XML member
through the hardened parser; only the members needed for text are ever decompressed.
"""

from __future__ import annotations

import posixpath
import re
from collections import Counter
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import unquote

from unlimisum.document import Chapter, Document
from unlimisum.errors import CorruptFileError, NoTextError, UnsafeFileError, UnsupportedFormatError
from unlimisum.ingest.chapters import name_untitled
from unlimisum.ingest.limits import DEFAULT_LIMITS, IngestLimits
from unlimisum.ingest.markup import (
    NAVIGATION_EPUB_TYPES,
    MarkupProblem,
    epub_types,
    left_out_label,
    local_name,
    parse_xml,
    xhtml_segments,
)
from unlimisum.ingest.safezip import SafeZip, ZipProblem, resolve_href
from unlimisum.ingest.text import strip_gutenberg_chapters

EPUB_MIMETYPE = b"application/epub+zip"
_DOCUMENT_TYPES = frozenset({"application/xhtml+xml", "text/html", "application/xml", "text/xml"})
_MIN_CHARS_PER_FIXED_PAGE = 100  # a fixed-layout book with less text per page is pictures
_MAX_NAMES_LISTED = 3  # "notes in a.xhtml, b.xhtml, c.xhtml and 9 more"


@dataclass(frozen=True)
class TocEntry:
    """One table-of-contents link: the member it points at, its fragment, its label."""

    path: str
    fragment: str | None
    title: str


def read_epub(
    file: str | BinaryIO, source: str, limits: IngestLimits = DEFAULT_LIMITS, *, keep_all: bool = False
) -> Document:
    """Read an EPUB file (path or binary file object) into a Document.

    Covers, title and copyright pages, other marked front and back matter, notes and
    non-linear spine items are left out of the chapters unless ``keep_all``; navigation
    (tables of contents) and non-text spine items always are. ``metadata["left_out"]``
    lists what was left out, in spine order, e.g. ``"cover (cover.xhtml)"``.
    """
    try:
        with SafeZip(file, limits) as archive:
            return _Book(archive, source, keep_all).document()
    except ZipProblem as problem:
        error_class = UnsafeFileError if problem.unsafe else CorruptFileError
        raise error_class(f"EPUB: {problem}", source=source) from None


class _Book:
    def __init__(self, archive: SafeZip, source: str, keep_all: bool = False):
        self.archive = archive
        self.source = source
        self.keep_all = keep_all
        self.warnings: list[str] = []
        self._left_out: list[tuple[int, str]] = []  # (spine position, description)
        self._spine_positions: dict[str, int] = {}
        self._marked_inside: dict[str, list[str]] = {}  # label -> documents it was cut from

    # --- structure ---------------------------------------------------------------------

    def document(self) -> Document:
        self._check_is_epub()
        opf_path = self._package_path()
        package = self._xml(opf_path, "package document (OPF)")
        opf_dir = posixpath.dirname(opf_path)
        metadata = _child(package, "metadata")
        manifest = self._manifest(package, opf_dir)
        spine = _child(package, "spine")
        if spine is None:
            raise CorruptFileError("EPUB package document has no spine", source=self.source)
        toc = self._toc(manifest, spine)
        documents = self._spine_documents(spine, manifest)
        chapters = name_untitled(strip_gutenberg_chapters(self._chapters(documents, toc)))
        self._check_has_text(chapters, metadata, len(documents))
        missing = sorted(path for path, _, _ in manifest.values() if not self._has(path))
        if missing:
            self.warnings.append(f"{len(missing)} manifest item(s) missing from the zip (not text, skipped): {', '.join(missing[:5])}")
        return Document(
            title=_first_text(metadata, "title") or "",
            author=", ".join(_all_texts(metadata, "creator")) or None,
            chapters=tuple(chapters),
            source=self.source,
            format="epub",
            metadata={
                "language": _first_text(metadata, "language"),
                "layout": _rendition_layout(metadata),
                "spine_documents": len(documents),
                "toc_entries": len(toc),
                "left_out": self._left_out_descriptions(),
                "warnings": self.warnings,
            },
        )

    def _check_is_epub(self) -> None:
        if self._has("mimetype"):
            mimetype = self.archive.read("mimetype", max_bytes=1024).strip()
            if mimetype == EPUB_MIMETYPE:
                return
            if not self._has("META-INF/container.xml"):
                kind = mimetype.decode("ascii", "replace")[:60]
                raise UnsupportedFormatError(f"zip archive of type {kind!r}, not an EPUB", source=self.source)
        if self._has("META-INF/container.xml"):
            return
        if self._has("word/document.xml"):
            raise UnsupportedFormatError("Word document (.docx), not text, EPUB or PDF", source=self.source)
        raise UnsupportedFormatError("zip archive but not an EPUB (no mimetype, no META-INF/container.xml)", source=self.source)

    def _package_path(self) -> str:
        if not self._has("META-INF/container.xml"):
            raise CorruptFileError("EPUB lacks META-INF/container.xml", source=self.source)
        container = self._xml("META-INF/container.xml", "container")
        rootfiles = [el for el in container.iter() if local_name(el) == "rootfile" and el.get("full-path")]
        if not rootfiles:
            raise CorruptFileError("EPUB container.xml names no package document", source=self.source)
        preferred = [el for el in rootfiles if el.get("media-type") == "application/oebps-package+xml"]
        path = resolve_href("", (preferred or rootfiles)[0].get("full-path"))
        if path is None:
            raise UnsafeFileError("EPUB container.xml points outside the book", source=self.source)
        if not self._has(path):
            raise CorruptFileError(f"EPUB package document {path!r} is missing from the zip", source=self.source)
        return self._member(path)

    def _manifest(self, package, opf_dir: str) -> dict[str, tuple[str, str, set[str]]]:
        """id -> (member path, media type, properties)."""
        manifest_element = _child(package, "manifest")
        if manifest_element is None:
            raise CorruptFileError("EPUB package document has no manifest", source=self.source)
        items = {}
        for item in manifest_element:
            if local_name(item) != "item" or not item.get("id") or not item.get("href"):
                continue
            href = item.get("href").split("#", 1)[0]
            if "://" in href:  # remote resources are not part of the book
                continue
            path = resolve_href(opf_dir, href)
            if path is None:
                raise UnsafeFileError(f"EPUB manifest item {href!r} points outside the book", source=self.source)
            properties = set((item.get("properties") or "").split())
            items[item.get("id")] = (self._member(path), (item.get("media-type") or "").lower(), properties)
        return items

    def _spine_documents(self, spine, manifest) -> list[str]:
        """Member paths of the spine documents to read, in order; the others are left out.

        Navigation documents and non-text items are always left out, non-linear items
        unless ``keep_all``; an entry missing from the manifest is a warning.
        """
        documents = []
        itemrefs = [el for el in spine if local_name(el) == "itemref"]
        for position, itemref in enumerate(itemrefs):
            item = manifest.get(itemref.get("idref"))
            if item is None:
                self.warnings.append(f"spine entry {itemref.get('idref')!r} is not in the manifest (skipped)")
                continue
            path, media_type, properties = item
            self._spine_positions.setdefault(path, position)
            reason = self._spine_reason(itemref, media_type, properties)
            if reason is not None:
                self._leave_out(reason, path)
                continue
            if not self._has(path):
                if itemref.get("linear", "yes").lower() == "no":  # kept only by keep_all
                    self.warnings.append(f"non-linear spine document {path!r} is missing from the zip (skipped)")
                    continue
                raise CorruptFileError(f"EPUB spine document {path!r} is missing from the zip", source=self.source)
            documents.append(path)
        if not documents and not itemrefs:
            raise CorruptFileError("EPUB spine lists no documents", source=self.source)
        return documents

    def _spine_reason(self, itemref, media_type: str, properties: set[str]) -> str | None:
        """Why a spine item is left out, or None when it is read."""
        if "nav" in properties:
            return "table of contents"
        if media_type not in _DOCUMENT_TYPES:
            return f"{media_type or 'untyped'} item, not text"
        if itemref.get("linear", "yes").lower() == "no" and not self.keep_all:
            return "non-linear item"
        return None

    def _leave_out(self, what: str, path: str) -> None:
        self._left_out.append((self._spine_positions.get(path, 0), f"{what} ({posixpath.basename(path)})"))

    def _left_out_descriptions(self) -> list[str]:
        """Spine items left out, in spine order, then marked parts cut from inside documents
        ("notes in c1.xhtml, c2.xhtml")."""
        descriptions = [description for _, description in sorted(self._left_out, key=lambda entry: entry[0])]
        for label, paths in self._marked_inside.items():
            names = [posixpath.basename(path) for path in paths]
            more = len(names) - _MAX_NAMES_LISTED
            listed = ", ".join(names[:_MAX_NAMES_LISTED]) + (f" and {more} more" if more > 0 else "")
            descriptions.append(f"{label} in {listed}")
        return descriptions

    # --- table of contents ---------------------------------------------------------------

    def _toc(self, manifest, spine) -> list[TocEntry]:
        nav = next((item for item in manifest.values() if "nav" in item[2]), None)
        if nav and self._has(nav[0]):
            entries = self._nav_entries(nav[0])
            if entries:
                return entries
        ncx = manifest.get(spine.get("toc") or "") or next(
            (item for item in manifest.values() if item[1] == "application/x-dtbncx+xml"), None
        )
        if ncx and self._has(ncx[0]):
            return self._ncx_entries(ncx[0])
        return []

    def _nav_entries(self, path: str) -> list[TocEntry]:
        try:
            root = self._xml(path, "navigation document")
        except CorruptFileError as error:
            self.warnings.append(str(error.problem))
            return []
        navs = [el for el in root.iter() if local_name(el) == "nav"]
        toc_nav = next((el for el in navs if "toc" in epub_types(el)), navs[0] if navs else None)
        if toc_nav is None:
            return []
        links = ((a.get("href"), _text_of(a)) for a in toc_nav.iter() if local_name(a) == "a")
        return self._entries(posixpath.dirname(path), links)

    def _ncx_entries(self, path: str) -> list[TocEntry]:
        try:
            root = self._xml(path, "NCX table of contents")
        except CorruptFileError as error:
            self.warnings.append(str(error.problem))
            return []
        links = []
        for point in root.iter():
            if local_name(point) != "navPoint".lower():
                continue
            label = next((el for el in point if local_name(el) == "navlabel"), None)
            content = next((el for el in point if local_name(el) == "content"), None)
            if content is not None:
                links.append((content.get("src"), _text_of(label) if label is not None else ""))
        return self._entries(posixpath.dirname(path), links)

    def _entries(self, base_dir: str, links) -> list[TocEntry]:
        entries = []
        for href, title in links:
            if not href:
                continue
            target, _, fragment = href.partition("#")
            path = resolve_href(base_dir, target) if target else None
            if path is not None:
                entries.append(TocEntry(self._member(path), unquote(fragment) or None, title))
        return entries

    # --- text ------------------------------------------------------------------------------

    def _chapters(self, documents: list[str], toc: list[TocEntry]) -> list[Chapter]:
        """Split spine documents into chapters at the TOC's targets.

        A document the TOC never points at continues the previous chapter (books are often
        split into files by size) unless it has its own heading; before the first TOC
        target, or in a book without a TOC, it is a chapter titled by its first heading.
        """
        by_path: dict[str, list[TocEntry]] = {}
        for entry in toc:
            by_path.setdefault(entry.path, []).append(entry)
        chapters: list[Chapter] = []
        for path in documents:  # parsed one at a time: only one tree is in memory
            root = self._spine_document(path)
            if self._whole_document_left_out(root, path):
                continue
            entries = by_path.get(path, [])
            anchor_titles: dict[str, str] = {}
            for entry in entries:
                if entry.fragment:
                    anchor_titles.setdefault(entry.fragment, entry.title)
            document_title = next((entry.title for entry in entries if not entry.fragment), None)
            segments = self._segments(root, path, frozenset(anchor_titles))
            for segment in segments:
                if not segment.paragraphs:
                    continue
                if segment.anchor is not None:
                    chapters.append(_chapter(anchor_titles[segment.anchor], segment.paragraphs))
                elif document_title is not None:
                    chapters.append(_chapter(document_title, segment.paragraphs))
                elif chapters and not entries and not _heading(root):
                    previous = chapters.pop()
                    chapters.append(Chapter(previous.title, previous.text + "\n\n" + segment.text))
                else:
                    chapters.append(_chapter(_heading(root) or "", segment.paragraphs))
        return chapters

    def _whole_document_left_out(self, root, path: str) -> bool:
        """True (and noted) when the document is marked navigation, or front/back matter or
        notes that are not kept."""
        body_types = set().union(*(epub_types(el) for el in root.iter() if local_name(el) in ("html", "body")))
        if body_types & NAVIGATION_EPUB_TYPES:
            self._leave_out("table of contents" if "toc" in body_types else "navigation", path)
            return True
        label = None if self.keep_all else left_out_label(body_types)
        if label is not None:
            self._leave_out(label, path)
        return label is not None

    def _segments(self, root, path: str, anchors: frozenset[str]) -> list:
        """The document's segments; marked parts cut from it are noted under the document."""
        marked: Counter[str] = Counter()
        segments = xhtml_segments(root, anchors, keep_marked=self.keep_all, left_out=marked)
        for label in marked:
            self._marked_inside.setdefault(label, []).append(path)
        return segments

    def _check_has_text(self, chapters: list[Chapter], metadata, page_count: int) -> None:
        chars = sum(len(chapter.text) for chapter in chapters)
        if _rendition_layout(metadata) == "pre-paginated" and chars < _MIN_CHARS_PER_FIXED_PAGE * max(page_count, 1):
            raise NoTextError(
                f"fixed-layout EPUB whose pages are images ({chars} characters of text in {page_count} pages): no text to summarize",
                source=self.source,
            )
        if not chars:
            raise NoTextError("EPUB has no text (image-only book?)", source=self.source)

    # --- members -------------------------------------------------------------------------

    def _member(self, path: str) -> str:
        """The zip name for a path: as written, or percent-decoded (hrefs are URLs)."""
        if self.archive.has(path):
            return path
        decoded = unquote(path)
        return decoded if self.archive.has(decoded) else path

    def _has(self, path: str) -> bool:
        return self.archive.has(path)

    def _spine_document(self, path: str):
        try:
            return self._xml(path, "spine document")
        except CorruptFileError:
            if self._has("META-INF/rights.xml") or self._has("META-INF/encryption.xml"):
                raise UnsupportedFormatError("EPUB is DRM-protected (its text is encrypted)", source=self.source) from None
            raise

    def _xml(self, path: str, what: str):
        try:
            return parse_xml(self.archive.read(path))
        except MarkupProblem as problem:
            error_class = UnsafeFileError if problem.unsafe else CorruptFileError
            raise error_class(f"EPUB {what} {path!r}: {problem}", source=self.source) from None


def _chapter(title: str, paragraphs: list[str]) -> Chapter:
    """A chapter; its first paragraph goes when it only repeats the title."""
    if len(paragraphs) > 1 and _same_words(paragraphs[0], title):
        paragraphs = paragraphs[1:]
    return Chapter(title, "\n\n".join(paragraphs))


def _same_words(a: str, b: str) -> bool:
    return re.sub(r"\W+", " ", a).strip().lower() == re.sub(r"\W+", " ", b).strip().lower()


def _heading(root) -> str | None:
    heading = next((el for el in root.iter() if local_name(el) in ("h1", "h2", "h3")), None)
    return _text_of(heading) if heading is not None else None


def _text_of(element) -> str:
    return " ".join("".join(element.itertext()).split())


def _child(parent, name: str):
    return next((el for el in parent if local_name(el) == name), None)


def _all_texts(parent, name: str) -> list[str]:
    if parent is None:
        return []
    return [text for el in parent if local_name(el) == name and (text := _text_of(el))]


def _first_text(parent, name: str) -> str | None:
    texts = _all_texts(parent, name)
    return texts[0] if texts else None


def _rendition_layout(metadata) -> str | None:
    if metadata is None:
        return None
    for meta in metadata:
        if local_name(meta) == "meta" and meta.get("property") == "rendition:layout":
            return _text_of(meta)
    return None
