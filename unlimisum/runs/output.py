"""What `unlimisum summarize` writes: Markdown and JSON renderings, and atomic file writes.

JSON schema (one object per document; JSON Lines on stdout, one file per input with -o)::

    {
      "schema_version": 3,
      "written_by": "unlimisum",          # only in .summary.json files: marks them as unlimisum's own
      "path": "books/moby.epub",          # the input as given ("-" for standard input)
      "title": "Moby-Dick",               # the title the Markdown heading shows: the document's own,
                                          # else the file name ("" for standard input without one)
      "format": "epub",                   # "text" | "epub" | "pdf"
      "summary": "...",                   # the whole-document summary ("" when the model wrote nothing)
      "warnings": [],                     # what to know about it, e.g. "the summary is empty: ..."
      "coverage": [                       # where the summary looked: shares of its retrieval attention
        {"title": "Loomings", "start_token": 0, "end_token": 4211, "share": 0.031}, ...
      ],                                  # per chapter (sums to 1); a chapter's own summary: per window
      "window_coverage": [...],           # the same per encoding window
      "evidence": [                       # per sentence of the summary, the passages its attention went to
        {"sentence": "...", "start": 0, "end": 42,   # character offsets of the sentence in "summary"
         "sources": [                     # strongest first, at most --evidence-passages
           {"chapter_index": 0,           # 0-based, as `unlimisum ingest --json` lists the chapters
            "chapter": "Loomings",
            "start_char": 1200, "end_char": 1391,  # into that chapter's text (`ingest --json --text`)
            "share": 0.62,                # of the sentence's attention over its listed passages (sum to 1)
            "quote": "...",               # that slice, trimmed, at most ~300 characters ("…" where cut)
            "start_token": 310, "end_token": 343}],  # the passage's input tokens (a decoder-only model:
                                          # of the document's text in the prompt), within its chapter
         "support": 1.8}                  # nats per token the sentence loses with its passages hidden
                                          # (null: not measured: no passages, or a decoder-only model)
      ],                                  # [] with --no-evidence, for an empty summary, when the pass failed
      "chapters": [                       # empty unless --per-chapter
        {"title": "Loomings", "summary": "...", "warnings": [], "coverage": [...], "window_coverage": [...],
         "evidence": [...], "stats": {...}}
      ],
      "stats": {
        "model": "...", "input_tokens": 0, "windows": 0, "window": 0,
        "index_kind": "exact", "index_device": "cpu", "retrieval_k": 0,
        "datastore_bytes": 0,             # the encoded input's store (16-bit states; an approximate index's own)
        "packed_bytes": 0,                # beside it: the packed retrieval kernel's copies, when that kernel ran
        "key_store": "shared",            # where the heads scored: "shared" (the states) or "per-layer" (keys)
        "key_store_bytes": 0,             # beside the store: the per-layer keys, when used (--key-store)
        "key_store_values": false,        # ... and each layer's values with them (dense steps: k >= N)
        "generated_tokens": 0,            # summary tokens: generated tokens other than special tokens
                                          # (the "N summary tokens" of the done line)
        "timings": {"read": 0.0, "tokenize": 0.0, "encode": 0.0, "index": 0.0, "prepare": 0.0,
                    "generate": 0.0, "search": 0.0,        # seconds per stage ("cache_load" instead of
                    "evidence": 0.0, "support": 0.0},      # tokenize/encode/index when cached); evidence:
                                                           # the summary read again (0 when recorded while
                                                           # generating), support: its sentences without
                                                           # their passages
        "peak_rss_bytes": 0, "peak_gpu_bytes": null,      # null unless on CUDA
        "tensor_cache_bytes": null,                        # decoder memory retained, with --tensor-cache
        "cached": false,                                   # the encoded book came from --cache-dir
        "model_dtype": "float32"                           # the weights' dtype (what --dtype auto chose)
      }
    }

A document that failed is, on stdout only, ``{"schema_version": 3, "path": ..., "error": ...,
"error_type": ...}`` so that a JSON Lines consumer sees every input once.

Text from the document or the model reaches a terminal or a file as text (unlimisum/visible.py): the Markdown
shows its control characters as symbols (ESC as ␛) and, in a file or a pipe, escapes every character a renderer
would read as markup (``markdown_text``: a book's ``<img>`` or ``[link](url)`` renders as those characters);
printed on a terminal, where nothing renders it, the text is as written. The JSON keeps the exact characters,
escaped as JSON escapes them (DEL and the C1 controls too).

Files written with -o are marked as unlimisum's own — Markdown with ``MARKDOWN_MARKER`` as its
first line, JSON with ``"written_by": "unlimisum"``, HTML pages (``unlimisum.runs.html``) with the same
marker line before their doctype — so that folder scans skip them and nothing else is ever overwritten
(``is_unlimisum_output``).
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from unlimisum.files import atomic_write_bytes
from unlimisum.visible import json_text, markdown_line, markdown_text, visible

if TYPE_CHECKING:  # the summarizer imports torch; keep `unlimisum --help` and completion fast
    from unlimisum.document import Document
    from unlimisum.evidence import SentenceEvidence, Source
    from unlimisum.results import Summary

MARKDOWN_MARKER = "<!-- written by unlimisum -->"  # also the first line of .summary.html pages (an HTML comment)
WRITTEN_BY = "unlimisum"  # the value of "written_by" in .summary.json files
_MARKER_PROBE_BYTES = 256  # how much of a file is read to recognise an unlimisum summary

# Passages with less of a sentence's attention are not shown to a reader (Markdown footnotes, the terminal, the
# HTML page): the strongest passages of a sentence often take nearly all of it. The JSON keeps every passage.
SHOWN_SHARE = 0.01
FOOTNOTE_INDENT = "    "  # a footnote's continuation lines (Markdown continues a footnote on indented lines)

JSON_SCHEMA_VERSION = 3  # 2: stats.top_k became retrieval_k; 3: coverage counts the returned summary only,
# stats.datastore_bytes the store alone (its packed copies in packed_bytes). Bump when a field changes meaning
# or disappears (adding fields keeps it)


def stats_record(summary: Summary, read_seconds: float | None = None) -> dict:
    """The ``stats`` object of a summary; ``read_seconds`` adds the ``read`` stage to the timings."""
    stats = dataclasses.asdict(summary.stats)
    timings = {"read": read_seconds} if read_seconds is not None else {}
    timings.update(stats["timings"])
    stats["timings"] = timings
    return stats


def summary_record(summary: Summary, document: Document, read_seconds: float | None = None) -> dict:
    """The JSON object for one summarized document (see the module docstring for the schema)."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "path": document.source,
        "title": document_title(document),
        "format": document.format,
        "summary": summary.text,
        "warnings": list(summary.warnings),
        **coverage_record(summary),
        "evidence": evidence_record(summary),
        "chapters": [
            {"title": part.title, "summary": part.text, "warnings": list(part.warnings), **coverage_record(part),
             "evidence": evidence_record(part), "stats": stats_record(part)}
            for part in summary.chapters
        ],
        "stats": stats_record(summary, read_seconds),
    }


def coverage_record(summary: Summary) -> dict:
    """``coverage`` and ``window_coverage``: lists of {title, start_token, end_token, share}."""
    return {
        "coverage": [dataclasses.asdict(span) for span in summary.coverage],
        "window_coverage": [dataclasses.asdict(span) for span in summary.window_coverage],
    }


def evidence_record(summary: Summary) -> list[dict]:
    """``evidence``: per sentence {sentence, start, end, sources: [{chapter_index, chapter, start_char, end_char,
    share, quote}]}."""
    return [dataclasses.asdict(sentence) for sentence in summary.evidence]


def error_record(source: str, problem: str, error_type: str) -> dict:
    """The JSON object for an input that could not be summarized."""
    return {"schema_version": JSON_SCHEMA_VERSION, "path": source, "error": problem, "error_type": error_type}


def to_json_line(record: dict) -> str:
    """One line of JSON (no newline inside, non-ASCII kept readable, every control character escaped)."""
    return json_text(json.dumps(record, ensure_ascii=False))


def to_json_file(record: dict) -> str:
    """Indented JSON for a ``.summary.json`` file, marked as unlimisum's, ending with a newline."""
    marked = {"schema_version": record.get("schema_version"), "written_by": WRITTEN_BY, **record}
    return json_text(json.dumps(marked, ensure_ascii=False, indent=2)) + "\n"


def document_title(document: Document) -> str:
    """The title shown for a document, in JSON and in the Markdown heading alike.

    The document's own title; when it has none (readers fall back to the file's stem), the
    file name; "" for standard input without a title.
    """
    if document.source == "-":
        return document.title
    path = Path(document.source)
    if not document.title or document.title == path.stem:
        return path.name
    return document.title


def document_heading(document: Document) -> str:
    """``Title — path/to/file``, or just the path when the title is the path itself (or there is none)."""
    source = "standard input" if document.source == "-" else document.source
    title = document_title(document)
    if not title or title == source:
        return source
    return f"{title} — {source}"


def render_markdown(summary: Summary, document: Document, *, heading: bool, marker: bool = False,
                    coverage: bool = False, evidence: bool = False, width: int | None = None,
                    escape: bool = True) -> str:
    """The summary as Markdown: the marker line (for files), ``# heading`` (when asked), the text,
    with ``coverage`` a table of where it looked, with ``evidence`` a footnote mark after each sentence and
    the quoted passages under the text, then ``## chapter`` sections (each with its own). ``width``: the
    terminal's columns, when it is printed on one: the footnotes are wrapped to it at spaces. Control characters
    of the document's and the model's text are shown as symbols, and with ``escape`` (Markdown a renderer reads:
    a file, a pipe) every character of theirs that Markdown would read as markup is escaped
    (unlimisum/visible.py); without it (a terminal) the text is as written."""
    parts = [MARKDOWN_MARKER] if marker else []
    line = markdown_line if escape else visible
    if heading:
        parts.append(f"# {line(document_heading(document))}")
    notes = 0  # footnote labels run through the whole file: Markdown's are global
    text, notes = with_evidence(summary, notes, width, escape) if evidence else (_text(summary.text, escape), notes)
    parts.append(text)
    if coverage and summary.coverage:
        parts.append(coverage_table(summary, escape))
    for number, chapter in enumerate(summary.chapters, start=1):
        title = line(chapter.title) if chapter.title else f"Part {number}"  # never a name the book does not have
        text, notes = with_evidence(chapter, notes, width, escape) if evidence else (_text(chapter.text, escape),
                                                                                       notes)
        parts.append(f"## {title}\n\n{text}")
    return visible("\n\n".join(parts) + "\n")


def _text(text: str, escape: bool, line_start: bool = True) -> str:
    """A document's or a model's ``text`` for the Markdown (``render_markdown``'s ``escape``)."""
    return markdown_text(text, line_start) if escape else visible(text)


def shown_sources(sentence: SentenceEvidence) -> tuple[Source, ...]:
    """The passages of ``sentence`` a reader is shown: those with at least SHOWN_SHARE of its attention."""
    return tuple(source for source in sentence.sources if source.share >= SHOWN_SHARE)


def support_note(sentence: SentenceEvidence) -> str:
    """``support 1.80 nats/token``, ``check first: support 0.03 nats/token`` for a sentence its passages barely
    carried (``evidence.weakly_supported``), or "" when its support was not measured."""
    if sentence.support is None:
        return ""
    from unlimisum.evidence import weakly_supported  # imports torch: not at `unlimisum --help`

    measured = f"support {sentence.support:.2f} nats/token"
    return f"check first: {measured}" if weakly_supported(sentence) else measured


def with_evidence(summary: Summary, first: int, width: int | None = None, escape: bool = True) -> tuple[str, int]:
    """The summary's text with a footnote mark ``[^n]`` after each sentence that has sources, then the
    footnotes: the sentence's support when measured, and each passage shown (``shown_sources``) quoted with
    its chapter and share. Labels continue after ``first``; returns the text and the last label used.
    ``width``: wrap each footnote at spaces to that many columns, continued on indented lines. ``escape``: the
    summary's and the book's text escaped for a Markdown renderer (``render_markdown``)."""
    text, position, label, notes = summary.text, 0, first, []
    pieces = []
    for sentence in summary.evidence:
        sources = shown_sources(sentence)
        if not sources:
            continue
        label += 1
        piece = _text(text[position:sentence.end], escape, _starts_line(text, position))
        if escape and piece.endswith("!"):  # "![^1]" would be an image where the renderer has no footnotes
            piece = piece[:-1] + "\\!"
        pieces.append(piece + f"[^{label}]")
        position = sentence.end
        quoted = "; ".join(
            f"{_quoted(source.chapter, escape) if source.chapter else f'Part {source.chapter_index + 1}'} "
            f"({source.share:.0%}): “{_quoted(source.quote, escape)}”" for source in sources)
        support = support_note(sentence)
        note = f"[^{label}]: {support[:1].upper() + support[1:]}. {quoted}" if support else f"[^{label}]: {quoted}"
        notes.append(wrap_at_spaces(note, width, FOOTNOTE_INDENT) if width else note)
    pieces.append(_text(text[position:], escape, _starts_line(text, position)))
    return "".join(pieces) + ("\n\n" + "\n".join(notes) if notes else ""), label


def _starts_line(text: str, position: int) -> bool:
    return position == 0 or text[position - 1] == "\n"


def _quoted(text: str, escape: bool) -> str:
    """A chapter's name or a passage, on one line of a footnote."""
    return markdown_line(text) if escape else " ".join(visible(text).split())


def wrap_at_spaces(text: str, width: int, indent: str) -> str:
    """``text`` in lines of at most ``width`` terminal cells, broken at spaces only, the lines after the first
    starting with ``indent``; a word longer than a line keeps a line of its own, whole."""
    lines, line, cells = [], "", 0
    for word in text.split():
        if line and cells + 1 + _cells(word) > width:
            lines.append(line)
            line, cells = indent + word, _cells(indent + word)
        else:
            line, cells = (f"{line} {word}", cells + 1 + _cells(word)) if line else (word, _cells(word))
    lines.append(line)
    return "\n".join(lines)


def _cells(text: str) -> int:
    """Terminal cells ``text`` takes: East Asian wide and full-width characters two, combining marks none."""
    return sum(0 if unicodedata.combining(character) else
               2 if unicodedata.east_asian_width(character) in "WF" else 1 for character in text)


def coverage_table(summary: Summary, escape: bool = True) -> str:
    """A Markdown table: each part of the input, its tokens, and its share of the summary's attention (``escape``:
    the parts' titles escaped for a Markdown renderer, ``render_markdown``; a ``|`` in them always is)."""
    rows = ["| part | tokens | share of attention |", "|---|---:|---:|"]
    for number, span in enumerate(summary.coverage, start=1):
        if not span.title:
            title = f"Part {number}"
        else:
            title = markdown_line(span.title) if escape else visible(span.title).replace("|", "\\|")
        rows.append(f"| {title} | {span.start_token:,}–{span.end_token:,} | {span.share:.1%} |")
    return "Where the summary looked (retrieval attention, all layers, heads and steps):\n\n" + "\n".join(rows)


def is_unlimisum_output(path: Path) -> bool:
    """True when ``path`` is a summary file unlimisum wrote (its marker is there); False otherwise or unreadable."""
    try:
        if path.suffix.lower() == ".json":
            with open(path, "rb") as file:
                record = json.loads(file.read(64 * 2**20))
            return isinstance(record, dict) and record.get("written_by") == WRITTEN_BY
        with open(path, "rb") as file:
            head = file.read(_MARKER_PROBE_BYTES)
    except (OSError, ValueError):
        return False
    return head.startswith(MARKDOWN_MARKER.encode())


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` all at once (see ``unlimisum.files.atomic_write_bytes``)."""
    atomic_write_bytes(path, text.encode("utf-8"))
