"""Hardened XML parsing and XHTML-to-text for EPUB members.

The parser never loads DTDs, never touches the network, never expands entities and
keeps libxml2's size limits on; documents that declare entities are refused outright
(that is how XXE and "billion laughs" attacks start, and real books never need it).
"""

from __future__ import annotations

import html.entities
import re
from collections import Counter
from dataclasses import dataclass, field

from lxml import etree

_PARSER_OPTIONS = dict(
    resolve_entities=False,
    no_network=True,
    huge_tree=False,
    load_dtd=False,
    dtd_validation=False,
    remove_comments=True,
    remove_pis=True,
)
_STRICT_PARSER = etree.XMLParser(**_PARSER_OPTIONS)
_LENIENT_PARSER = etree.XMLParser(recover=True, **_PARSER_OPTIONS)

_ENTITY_DECLARATION = re.compile(rb"<!ENTITY", re.I)
_NAMED_REFERENCE = re.compile(rb"&([A-Za-z][A-Za-z0-9]{1,31});")
_XML_ENTITIES = frozenset({b"amp", b"lt", b"gt", b"quot", b"apos"})

EPUB_NS = "http://www.idpf.org/2007/ops"


class MarkupProblem(Exception):
    """The XML cannot be used; ``unsafe`` is True when it looked like an attack."""

    def __init__(self, message: str, unsafe: bool = False):
        super().__init__(message)
        self.unsafe = unsafe


def parse_xml(data: bytes) -> etree._Element:
    """Parse untrusted XML/XHTML bytes into an element tree, safely.

    HTML named entities such as ``&nbsp;`` (common in EPUBs, undefined in XML without
    the DTD we refuse to load) become numeric references first. Malformed markup is
    parsed in recovery mode; hopeless markup raises MarkupProblem.
    """
    if _ENTITY_DECLARATION.search(data):
        raise MarkupProblem("declares XML entities (external-entity or entity-expansion attack?)", unsafe=True)
    data = _NAMED_REFERENCE.sub(_numeric_reference, data)
    try:
        return etree.fromstring(data, _STRICT_PARSER)
    except etree.XMLSyntaxError as error:
        message = str(error).lower()
        if "amplification" in message or ("entity" in message and "loop" in message):
            raise MarkupProblem(f"entity expansion refused ({error})", unsafe=True) from None
        strict_error = error
    try:
        root = etree.fromstring(data, _LENIENT_PARSER)
    except etree.XMLSyntaxError:
        root = None
    if root is None:
        raise MarkupProblem(f"malformed XML ({strict_error})")
    return root


def _numeric_reference(match: re.Match) -> bytes:
    name = match.group(1)
    if name in _XML_ENTITIES:
        return match.group(0)
    codepoint = html.entities.name2codepoint.get(name.decode("ascii"))
    return b"&#%d;" % codepoint if codepoint is not None else match.group(0)


def local_name(element) -> str:
    """Tag name without namespace ("" for comments, entities and the like)."""
    tag = element.tag
    if not isinstance(tag, str):
        return ""
    return tag.rsplit("}", 1)[-1].lower()


def epub_types(element) -> set[str]:
    """The element's epub:type values plus its ARIA doc-* role values (without "doc-")."""
    values = (element.get(f"{{{EPUB_NS}}}type") or element.get("epub:type") or "").split()
    values += [role.removeprefix("doc-") for role in (element.get("role") or "").split()]
    return {value.split(":")[-1].lower() for value in values}


# --- XHTML to text --------------------------------------------------------------------

_DROPPED_TAGS = frozenset(
    "head title script style noscript template nav svg math rt rp button select textarea "
    "iframe object embed audio video canvas map".split()
)
# Navigation and reference markers (contents lists, note and page-break markers): never text.
NAVIGATION_EPUB_TYPES = frozenset("toc landmarks page-list loi lot noteref annoref pagebreak".split())
# Marked parts outside the running text: left out (and listed) unless everything is kept.
# Ordered from specific to general: "frontmatter titlepage" is a title page.
LEFT_OUT_EPUB_TYPES: dict[str, str] = {
    "cover": "cover",
    "titlepage": "title page",
    "halftitlepage": "half-title page",
    "copyright-page": "copyright page",
    "colophon": "colophon",
    "imprint": "imprint",
    "index": "index",
    **dict.fromkeys("footnote footnotes endnote endnotes rearnote rearnotes annotation".split(), "notes"),
    "frontmatter": "front matter",
    "backmatter": "back matter",
}
DROPPED_EPUB_TYPES = NAVIGATION_EPUB_TYPES | frozenset(LEFT_OUT_EPUB_TYPES)


def left_out_label(types: set[str]) -> str | None:
    """What a part marked with these epub:types is ("title page", "notes"...), if left out."""
    return next((label for name, label in LEFT_OUT_EPUB_TYPES.items() if name in types), None)


_BLOCK_TAGS = frozenset(
    "body section article main aside header footer div p h1 h2 h3 h4 h5 h6 ul ol li dl dt dd "
    "blockquote pre table thead tbody tfoot tr td th caption figure figcaption hr address "
    "details summary center".split()
)
_LINE_BREAK = "\ue000"  # stands in for <br/> while whitespace is collapsed


@dataclass
class Segment:
    """Text from one anchor (an element id the table of contents points at) to the next."""

    anchor: str | None
    paragraphs: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


def xhtml_segments(
    root, anchors: frozenset[str] = frozenset(), *, keep_marked: bool = False, left_out: Counter | None = None
) -> list[Segment]:
    """Clean paragraphs of an XHTML document's body, split where an id in ``anchors`` starts.

    Scripts, styles, navigation, ruby annotations, note markers and hidden elements are
    dropped; so are marked notes and front/back matter unless ``keep_marked``, each counted
    in ``left_out`` under its label (see ``left_out_label``). Paragraphs are kept,
    whitespace inside them collapsed.
    """
    body = next((el for el in root.iter() if local_name(el) == "body"), root)
    segments = [Segment(anchor=None)]
    buffer: list[str] = []
    preformatted = 0

    def flush() -> None:
        paragraph = "".join(buffer)
        buffer.clear()
        if preformatted:
            paragraph = paragraph.strip("\n")
        else:
            paragraph = re.sub(r"\s+", " ", paragraph)
            paragraph = re.sub(rf" ?{_LINE_BREAK} ?", "\n", paragraph).strip()
        if paragraph.strip():
            segments[-1].paragraphs.append(paragraph)

    walker = etree.iterwalk(body, events=("start", "end"))
    for event, element in walker:
        name = local_name(element)
        if event == "start":
            if not name:  # entity reference or other non-element node: only its tail counts
                continue
            if _skipped(element, name, keep_marked, left_out):
                walker.skip_subtree()  # its "end" event still comes, and adds its tail
                continue
            element_id = element.get("id")
            if element_id and element_id in anchors:
                flush()
                segments.append(Segment(anchor=element_id))
            if name in _BLOCK_TAGS:
                flush()
            if name == "pre":
                preformatted += 1
            if name == "br":
                buffer.append(_LINE_BREAK)
            _append(buffer, element.text)
        else:
            if name in _BLOCK_TAGS:
                flush()
            if name == "pre":
                preformatted -= 1
            if element is not body:
                _append(buffer, element.tail)
    flush()
    return segments


def _skipped(element, name: str, keep_marked: bool, left_out: Counter | None) -> bool:
    types = epub_types(element)
    if name in _DROPPED_TAGS or element.get("hidden") is not None or types & NAVIGATION_EPUB_TYPES:
        return True
    label = None if keep_marked else left_out_label(types)
    if label is not None and left_out is not None:
        left_out[label] += 1
    return label is not None


def _append(buffer: list[str], text: str | None) -> None:
    if text:
        buffer.append(text)
