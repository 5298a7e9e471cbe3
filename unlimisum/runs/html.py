"""The summary as one self-contained HTML page: each sentence beside the passages of the book it drew on.

``render_html(summary, document)`` returns the page: the summary on top, every sentence with evidence a
link; clicking it marks (``<mark>``) its passages in the chapter's own text, scrolls the strongest into
view and lists them with their share of the sentence's attention and, when measured, its support. A strip
over the book's length (chapters as segments, as long as their tokens; darker where the summary's
attention went, per encoding window) links to each chapter; per-chapter summaries follow as sections. It
reads at a phone's width and prints (summary, evidence, chapter summaries; not the book).

Nothing is fetched: styles and the one script are inline, and a Content-Security-Policy allows no other
script (the script's own hash), no network, no images but data URLs. Text from the book is data: every
piece of it in the markup is escaped; the chapters' texts travel as JSON strings in inert
``<script type="application/json">`` blocks (``<`` written ``\\u003c``, so that neither ``</script>`` nor
``<!--`` can end them) and are put on the page with ``textContent``, only when a chapter is first needed
or scrolled near, so that a book of a million characters opens at once.

Offsets: Python counts code points, JavaScript UTF-16 units; the passages' offsets are converted here.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from bisect import bisect_right
from typing import TYPE_CHECKING, Sequence

from unlimisum.evidence import weakly_supported
from unlimisum.runs.output import MARKDOWN_MARKER, document_title, shown_sources, support_note
from unlimisum.version import __version__
from unlimisum.visible import visible

if TYPE_CHECKING:  # names for annotations only
    from unlimisum.coverage import CoverageSpan
    from unlimisum.document import Document
    from unlimisum.evidence import SentenceEvidence
    from unlimisum.results import Summary

# The first line of every page unlimisum writes: an HTML comment (before the doctype, which keeps the page in
# standards mode), the same marker as the Markdown files', so that ``is_unlimisum_output`` knows it.
HTML_MARKER = MARKDOWN_MARKER


def render_html(summary: Summary, document: Document) -> str:
    """The page for ``summary`` of ``document`` (see the module docstring): one string, UTF-8 when written."""
    page = _Page(summary, document)
    return page.render()


def script_json(value) -> str:
    """``value`` as JSON that is inert inside a ``<script type="application/json">`` element: every ``<`` is
    escaped (``\\u003c``), so no ``</script>`` or ``<!--`` can occur in it; its strings' control characters shown
    as symbols (unlimisum/visible.py: one character for one, so offsets into them hold)."""
    return json.dumps(_visible_strings(value), ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def _visible_strings(value):
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {key: _visible_strings(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_visible_strings(item) for item in value]
    return value


def utf16_offsets(text: str, offsets: Sequence[int]) -> list[int]:
    """Code-point offsets into ``text`` as UTF-16 offsets (what JavaScript's strings count)."""
    if len(text.encode("utf-16-le")) == 2 * len(text):  # no character outside the Basic Multilingual Plane
        return list(offsets)
    astral = [index for index, character in enumerate(text) if ord(character) > 0xFFFF]
    return [offset + bisect_right(astral, offset - 1) for offset in offsets]


def _escape(text: str) -> str:
    """Text of the document or the model as the page shows it: HTML-escaped, control characters as symbols."""
    return html.escape(visible(text), quote=True)


def _percent(share: float) -> str:
    return f"{share:.0%}" if share >= 0.01 else "<1%"


class _Page:
    """One page being written: sentence numbers run through the whole summary and its chapter summaries."""

    def __init__(self, summary: Summary, document: Document):
        self.summary = summary
        self.document = document
        self.chapters = [(index, chapter) for index, chapter in enumerate(document.chapters) if chapter.text.strip()]
        self.span_chapters = _chapters_of_spans(document, summary.coverage)
        self.sentences: list[SentenceEvidence] = []  # every clickable sentence, in page order (its number)
        # per clickable sentence: {"passages": [[chapter, start, end, share, where on the strip]...], "support",
        # "weak"}; start and end in UTF-16 units of the chapter's text
        self.sources: list[dict] = []

    def render(self) -> str:
        title = document_title(self.document) or "Summary"
        summary_html = self.summary_text(self.summary)
        parts_html = self.chapter_summaries()
        notes_html = self.notes()
        body = (f'<div class="page"><div class="reading" id="reading">'
                f"<header><h1>{_escape(title)}</h1>{self.meta()}</header>"
                f'<section class="summary" aria-labelledby="summary-heading"><h2 id="summary-heading">Summary</h2>'
                f"{self.warnings(self.summary)}{summary_html}{self.hint()}</section>"
                f"{self.strip()}{notes_html}{parts_html}</div>"
                f"{self.book()}</div>"
                '<a class="back" id="back" href="#summary-heading" hidden>Back to the summary</a>'
                f'<script type="application/json" id="unlimisum-evidence">{script_json(self.sources)}</script>'
                f"<script>{_SCRIPT}</script>")
        script_hash = base64.b64encode(hashlib.sha256(_SCRIPT.encode("utf-8")).digest()).decode("ascii")
        policy = (f"default-src 'none'; script-src 'sha256-{script_hash}'; style-src 'unsafe-inline'; "
                  "img-src data:; base-uri 'none'; form-action 'none'")
        return (f"{HTML_MARKER}\n<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
                '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
                f'<meta name="generator" content="unlimisum {__version__}">\n'
                f"<title>{_escape(title)} — summary</title>\n<style>{_STYLE}</style>\n</head>\n"
                f"<body>\n{body}\n</body>\n</html>\n")

    # -- the reading column ---------------------------------------------------------------------

    def meta(self) -> str:
        stats = self.summary.stats
        source = "standard input" if self.document.source == "-" else self.document.source
        facts = [f"{stats.input_tokens:,} tokens in {stats.windows:,} window{'s' if stats.windows != 1 else ''}",
                 f"summarized by {stats.model}" if stats.model else "",
                 f"{stats.generated_tokens:,} summary tokens", f"unlimisum {__version__}"]
        return (f'<p class="meta">{_escape(source)}</p>'
                f'<p class="meta">{_escape(" · ".join(fact for fact in facts if fact))}</p>')

    def warnings(self, summary: Summary) -> str:
        return "".join(f'<p class="warning">{_escape(warning)}</p>' for warning in summary.warnings)

    def hint(self) -> str:
        if not self.sentences:  # no sentence has a passage to show
            return ('<p class="hint">No evidence was recorded for this summary (a run with --no-evidence, or a '
                    "model that records none): its sentences link to no passages.</p>")
        return ('<p class="hint">Click a sentence to see the passages of the book it drew on, marked in the '
                "chapter's text.</p>")

    def summary_text(self, summary: Summary) -> str:
        """The text, each sentence with listed passages a link that selects it."""
        text, position, pieces = summary.text, 0, []
        for sentence in summary.evidence:
            pieces.append(_escape(text[position:sentence.start]))
            pieces.append(self.sentence_link(sentence))
            position = sentence.end
        pieces.append(_escape(text[position:]))
        return f'<p class="text">{"".join(pieces)}</p>'

    def sentence_link(self, sentence: SentenceEvidence) -> str:
        sources = shown_sources(sentence)
        if not sources:
            return _escape(sentence.sentence)
        number, weak = len(self.sentences), weakly_supported(sentence)
        self.sentences.append(sentence)
        self.sources.append({"passages": [self.source_record(source) for source in sources],
                             "support": None if sentence.support is None else round(sentence.support, 3),
                             "weak": weak})
        label = ' <span class="flag" title="its passages barely carried it">check first</span>' if weak else ""
        return (f'<a class="s{" weak" if weak else ""}" id="s-{number}" href="#s-{number}" data-s="{number}">'
                f"{_escape(sentence.sentence)}</a>{label}")

    def source_record(self, source) -> list:
        text = self.document.chapters[source.chapter_index].text
        start, end = utf16_offsets(text, [source.start_char, source.end_char])
        return [source.chapter_index, start, end, round(source.share, 4),
                round(self.strip_position(source.chapter_index, source.start_char), 5)]

    def strip_position(self, chapter_index: int, start_char: int) -> float:
        """Where a passage lies on the strip, 0 (the book's first token) to 1 (its last)."""
        coverage = self.summary.coverage
        if not coverage:
            return 0.0
        for span, members in zip(coverage, self.span_chapters):
            if chapter_index in members:
                lengths = [len(self.document.chapters[index].text) for index in members]
                before = sum(lengths[: members.index(chapter_index)])
                fraction = (before + start_char) / max(1, sum(lengths))
                return (span.start_token + fraction * (span.end_token - span.start_token)) / coverage[-1].end_token
        return 0.0

    def strip(self) -> str:
        """Chapters as segments across the book (as long as their tokens), shaded by the summary's attention."""
        coverage = self.summary.coverage
        if not coverage:
            return ""
        windows = [span for span in self.summary.window_coverage if span.end_token > span.start_token]
        cells = windows if len(windows) > 1 else list(coverage)
        peak = max(_density(cell) for cell in cells) or 1.0
        segments = []
        for span, members in zip(coverage, self.span_chapters):
            inner = []
            for cell in cells:
                start, end = max(cell.start_token, span.start_token), min(cell.end_token, span.end_token)
                if end > start:
                    inner.append(f'<span class="cell" style="flex-grow:{end - start};--heat:'
                                 f'{_density(cell) / peak:.3f}"></span>')
            name = span.title or f"tokens {span.start_token:,}–{span.end_token:,}"
            label = _escape(f"{name}: {_percent(span.share)} of the summary's attention")
            target = f' href="#ch-{members[0]}" data-chapter="{members[0]}"' if members else ""
            segments.append(f'<a class="seg"{target} style="flex-grow:{span.end_token - span.start_token}" '
                            f'title="{label}" aria-label="{label}">{"".join(inner)}</a>')
        top = max(coverage, key=lambda span: span.share)
        top_name = top.title or f"tokens {top.start_token:,}–{top.end_token:,}"
        return ('<section class="where" aria-labelledby="where-heading"><h2 id="where-heading">Where the summary '
                f'looked</h2><div class="strip" id="strip">{"".join(segments)}</div>'
                f'<p class="legend">The book from its first token to its last; each segment a chapter. Darker: '
                f"more of the summary's retrieval attention. Most at “{_escape(top_name)}” "
                f"({_percent(top.share)}). Ticks: the passages of the selected sentence.</p></section>")

    def notes(self) -> str:
        """Per clickable sentence, its passages (share, chapter, quote) and support: the panel a click shows,
        and all of them in print."""
        if not self.sentences:
            return ""
        items = []
        support_caveat = ""
        if any(sentence.support is not None for sentence in self.sentences):
            support_caveat = (" Support: how much less likely the sentence becomes when its passages are hidden (nats "
                            "per token; near 0: check it first).")
        for number, sentence in enumerate(self.sentences):
            support = support_note(sentence)
            weak = " weak" if weakly_supported(sentence) else ""
            support_html = f'<p class="support{weak}">{_escape(support)}</p>' if support else ""
            passages = []
            for rank, source in enumerate(shown_sources(sentence)):
                chapter = source.chapter or f"Part {source.chapter_index + 1}"
                passages.append(
                    f'<li><a class="passage" href="#ch-{source.chapter_index}" data-s="{number}" data-p="{rank}">'
                    f'<span class="share">{_percent(source.share)}</span> {_escape(chapter)}</a>'
                    f"<blockquote>{_escape(' '.join(source.quote.split()))}</blockquote></li>")
            items.append(f'<li class="note" id="e-{number}" data-s="{number}"><p class="said">'
                         f'<a href="#s-{number}">{_escape(sentence.sentence)}</a></p>{support_html}'
                         f'<ol class="passages">{"".join(passages)}</ol></li>')
        return ('<section class="evidence" id="evidence" aria-labelledby="evidence-heading" aria-live="polite">'
                '<h2 id="evidence-heading">Evidence</h2><p class="caveat">Where the model looked while writing a '
                "sentence, with each passage's share of that attention; a guide for checking the summary against "
                f"the book, not proof that a sentence is true.{support_caveat}</p>"
                f'<ol class="notes">{"".join(items)}</ol></section>')

    def chapter_summaries(self) -> str:
        if not self.summary.chapters:
            return ""
        sections = []
        for number, part in enumerate(self.summary.chapters, start=1):
            members = self.span_chapters[number - 1] if number - 1 < len(self.span_chapters) else []
            title = part.title or f"Part {number}"
            link = f' <a class="to-chapter" href="#ch-{members[0]}" data-chapter="{members[0]}">text</a>' if members else ""
            sections.append(f'<section class="part"><h3>{_escape(title)}{link}</h3>{self.warnings(part)}'
                            f"{self.summary_text(part)}</section>")
        return ('<section class="parts" aria-labelledby="parts-heading"><h2 id="parts-heading">Chapter by chapter'
                f'</h2>{"".join(sections)}</section>')

    # -- the book column --------------------------------------------------------------------------

    def book(self) -> str:
        """Every chapter with text: its title, and its text as inert JSON that the script puts on the page."""
        sections = []
        for index, chapter in self.chapters:
            title = chapter.title or f"Part {index + 1}"
            words = len(chapter.text.split())
            sections.append(
                f'<section class="chapter" id="ch-{index}" data-chapter="{index}" data-chars="{len(chapter.text)}">'
                f'<h3>{_escape(title)}</h3><div class="text" aria-busy="true"><p class="pending">{words:,} words'
                "</p></div>"
                f'<script type="application/json" id="text-{index}">{script_json(chapter.text)}</script></section>')
        return ('<div class="book" id="book"><h2>The book</h2><noscript><p class="hint">The chapters\' text needs '
                "JavaScript; the summary and the quoted passages above are complete without it.</p></noscript>"
                f'{"".join(sections)}</div>')


def _density(span: CoverageSpan) -> float:
    return span.share / max(1, span.end_token - span.start_token)


def _chapters_of_spans(document: Document, coverage: Sequence[CoverageSpan]) -> list[list[int]]:
    """The chapters (indices into ``document.chapters``) each coverage span covers.

    A whole document's coverage has one span per chapter with text, except that a chapter too short to own
    a token shares its neighbour's (``unlimisum.coverage.chapter_token_ranges``); then chapters go to the
    span where their first character falls, in proportion to the characters.
    """
    chapters = [index for index, chapter in enumerate(document.chapters) if chapter.text.strip()]
    if not coverage:
        return []
    if len(chapters) == len(coverage):
        return [[index] for index in chapters]
    members: list[list[int]] = [[] for _ in coverage]
    total = max(1, sum(len(document.chapters[index].text) for index in chapters))
    starts = [span.start_token for span in coverage]
    position = 0
    for index in chapters:
        token = position / total * coverage[-1].end_token
        members[max(0, bisect_right(starts, token) - 1)].append(index)
        position += len(document.chapters[index].text)
    return members


_STYLE = """
:root{--bg:#fdfdfb;--fg:#1d1d1f;--muted:#5f6368;--line:#d9d9d6;--accent:37 99 235;--mark:#ffe58a;
--mark-current:#ffc940;--weak:#b45309;color-scheme:light dark}
@media (prefers-color-scheme:dark){:root{--bg:#17181a;--fg:#e8e6e3;--muted:#a0a4a8;--line:#3a3c40;
--accent:96 150 255;--mark:#6b5300;--mark-current:#8f6f00;--weak:#f0a040}}
*{box-sizing:border-box}
html{scroll-padding-top:1rem}
body{margin:0;background:var(--bg);color:var(--fg);font:1rem/1.6 system-ui,-apple-system,"Segoe UI",Roboto,
"Noto Sans",sans-serif;overflow-wrap:anywhere}
h1{font-size:1.5rem;line-height:1.25;margin:0 0 .25rem}
h2{font-size:1.1rem;margin:1.5rem 0 .5rem}
h3{font-size:1rem;margin:1.25rem 0 .25rem}
a{color:rgb(var(--accent))}
.page{display:grid;grid-template-columns:minmax(0,1fr);max-width:76rem;margin:0 auto}
.reading,.book{padding:1rem}
.meta,.legend,.caveat,.hint,.pending{color:var(--muted);font-size:.875rem;margin:.25rem 0}
.warning{border-left:3px solid var(--weak);padding-left:.5rem}
.text{white-space:pre-line}
.s{color:inherit;text-decoration:none;border-radius:3px;cursor:pointer;
box-shadow:inset 0 -1px 0 rgb(var(--accent) / .45)}
a.s:hover,a.s:focus-visible{background:rgb(var(--accent) / .12)}
a.s.current{background:rgb(var(--accent) / .2);box-shadow:inset 0 -2px 0 rgb(var(--accent))}
a.s.weak{box-shadow:inset 0 -1px 0 var(--weak);text-decoration:underline wavy var(--weak);
text-decoration-thickness:1px;text-underline-offset:3px}
.flag{font-size:.75rem;color:var(--weak);border:1px solid var(--weak);border-radius:3px;padding:0 .25rem;
white-space:nowrap}
.strip{position:relative;display:flex;height:2.25rem;border:1px solid var(--line);border-radius:4px;
overflow:hidden;-webkit-print-color-adjust:exact;print-color-adjust:exact}
.seg{display:flex;min-width:1px;border-right:1px solid var(--bg)}
.seg:last-child{border-right:0}
.seg:hover,.seg:focus-visible{outline:2px solid rgb(var(--accent));outline-offset:-2px}
.cell{display:block;min-width:0;background:rgb(var(--accent) / calc(.06 + .94 * var(--heat)))}
.tick{position:absolute;top:0;bottom:0;width:3px;margin-left:-1px;background:var(--fg);pointer-events:none}
.notes{list-style:none;padding:0;margin:0}
.notes .note{display:none}
.notes .note.current{display:block}
.said{font-weight:600;margin:.25rem 0}
.said a{color:inherit;text-decoration:none}
.support{font-size:.875rem;margin:.25rem 0}
.support.weak{color:var(--weak);font-weight:600}
.passages{padding-left:1.25rem;margin:.25rem 0}
.passages li{margin:.5rem 0}
.passage{font-weight:600;text-decoration:none}
.share{display:inline-block;min-width:2.75rem;font-variant-numeric:tabular-nums}
blockquote{margin:.25rem 0 0;padding-left:.75rem;border-left:3px solid var(--line);color:var(--muted)}
.chapter .text{white-space:pre-wrap}
mark{background:var(--mark);color:inherit;border-radius:2px}
mark.first{background:var(--mark-current);outline:2px solid var(--mark-current)}
.badge{display:inline-block;margin:0 .25rem;padding:0 .35rem;border-radius:3px;background:var(--fg);color:var(--bg);
font-size:.75rem;line-height:1.5;max-width:100%;user-select:none}
.to-chapter{font-size:.8rem;font-weight:400}
.back{position:fixed;right:1rem;bottom:1rem;padding:.5rem .75rem;border-radius:999px;background:var(--fg);
color:var(--bg);text-decoration:none;font-size:.875rem;box-shadow:0 2px 8px rgb(0 0 0 / .25)}
.back[hidden]{display:none}
@media (min-width:60rem){
.page{grid-template-columns:minmax(0,1fr) minmax(0,1.15fr);gap:0}
.reading{position:sticky;top:0;align-self:start;max-height:100vh;overflow-y:auto;border-right:1px solid var(--line)}
.back{display:none}}
@media print{
:root{--bg:#fff;--fg:#000;--muted:#333}
body{font-size:11pt}
.page{display:block;max-width:none}
.reading{position:static;max-height:none;overflow:visible;border:0}
.book,.back,.hint,.tick{display:none}
.notes .note{display:block;break-inside:avoid}
a{color:inherit;text-decoration:none}
.s{box-shadow:none}
.part,.note{break-inside:avoid-page}}
"""

_SCRIPT = """
(() => {
"use strict";
const sources = JSON.parse(document.getElementById("unlimisum-evidence").textContent);
const texts = new Map();
const shown = new Map();
const narrow = window.matchMedia("(max-width: 59.99rem)");
let current = -1;

function chapterText(chapter) {
  if (!texts.has(chapter)) {
    texts.set(chapter, JSON.parse(document.getElementById("text-" + chapter).textContent));
  }
  return texts.get(chapter);
}

function box(chapter) {
  return document.querySelector("#ch-" + chapter + " .text");
}

function render(chapter, marks) {
  const target = box(chapter);
  if (!target) return;
  const text = chapterText(chapter);
  const fragment = document.createDocumentFragment();
  let at = 0;
  for (const [start, end, rank, label] of [...marks].sort((a, b) => a[0] - b[0])) {
    const from = Math.max(start, at);
    if (end <= from) continue;
    if (from > at) fragment.append(text.slice(at, from));
    const badge = document.createElement("span");
    badge.className = "badge";
    badge.textContent = label;
    fragment.append(badge);
    const mark = document.createElement("mark");
    mark.dataset.rank = String(rank);
    if (rank === 0) mark.className = "first";
    mark.textContent = text.slice(from, end);
    fragment.append(mark);
    at = end;
  }
  fragment.append(text.slice(at));
  target.replaceChildren(fragment);
  target.removeAttribute("aria-busy");
  target.style.minHeight = "";
  shown.set(chapter, marks.length);
}

function ensure(chapter) {
  if (!shown.has(chapter)) render(chapter, []);
}

function clear() {
  for (const [chapter, count] of shown) {
    if (count) render(chapter, []);
  }
  document.querySelectorAll(".tick").forEach((tick) => tick.remove());
  document.querySelectorAll(".s.current, .note.current").forEach((element) => element.classList.remove("current"));
}

function passageMark(rank) {
  return document.querySelector('#book mark[data-rank="' + rank + '"]');
}

function reveal(element, block = "center") {
  if (element) element.scrollIntoView({block: block, inline: "nearest"});
}

function label(sentence, rank) {
  const share = sentence.passages[rank][3];
  let text = "passage " + (rank + 1) + " of " + sentence.passages.length + " \u00b7 "
    + (share >= 0.01 ? Math.round(100 * share) + "%" : "<1%");
  if (rank === 0 && sentence.weak) text += " \u00b7 check first";
  if (rank === 0 && sentence.support !== null) text += " \u00b7 support " + sentence.support.toFixed(2) + " nats/token";
  return text;
}

function select(number, scroll) {
  const sentence = sources[number];
  if (!sentence) return;
  const passages = sentence.passages;
  clear();
  current = number;
  const byChapter = new Map();
  passages.forEach(([chapter, start, end], rank) => {
    if (!byChapter.has(chapter)) byChapter.set(chapter, []);
    byChapter.get(chapter).push([start, end, rank, label(sentence, rank)]);
  });
  for (const [chapter, marks] of byChapter) render(chapter, marks);
  const strip = document.getElementById("strip");
  if (strip) {
    for (const passage of passages) {
      const tick = document.createElement("span");
      tick.className = "tick";
      tick.style.left = (100 * passage[4]).toFixed(3) + "%";
      strip.append(tick);
    }
  }
  const link = document.getElementById("s-" + number);
  if (link) link.classList.add("current");
  const note = document.getElementById("e-" + number);
  if (note) note.classList.add("current");
  document.getElementById("back").hidden = !narrow.matches;
  document.getElementById("back").href = "#s-" + number;
  history.replaceState(null, "", "#s-" + number);
  if (scroll) reveal(passageMark(0));
}

function openChapter(chapter) {
  ensure(chapter);
  reveal(document.getElementById("ch-" + chapter), "start");
}

document.addEventListener("click", (event) => {
  const link = event.target.closest("a");
  if (!link) return;
  if (link.classList.contains("s")) {
    event.preventDefault();
    select(Number(link.dataset.s), true);
  } else if (link.classList.contains("passage")) {
    event.preventDefault();
    const number = Number(link.dataset.s);
    if (number !== current) select(number, false);
    reveal(passageMark(Number(link.dataset.p)));
  } else if (link.dataset.chapter !== undefined) {
    event.preventDefault();
    openChapter(Number(link.dataset.chapter));
  } else if (link.id === "back") {
    event.preventDefault();
    reveal(document.getElementById("s-" + current));
  }
});

const sections = document.querySelectorAll(".chapter");
const lineHeight = parseFloat(getComputedStyle(document.body).lineHeight) || 24;
const charWidth = (parseFloat(getComputedStyle(document.body).fontSize) || 16) * 0.5;
const width = Math.max(200, sections.length ? sections[0].querySelector(".text").clientWidth : 0);
for (const section of sections) {  // until a chapter's text is put in, it takes about the room it will need
  const lines = Math.ceil(Number(section.dataset.chars) * charWidth / width);
  section.querySelector(".text").style.minHeight = Math.round(lines * lineHeight) + "px";
}
if ("IntersectionObserver" in window) {
  const observer = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      if (entry.isIntersecting) {
        ensure(Number(entry.target.dataset.chapter));
        observer.unobserve(entry.target);
      }
    }
  }, {rootMargin: "50% 0px"});
  sections.forEach((section) => observer.observe(section));
} else {
  sections.forEach((section) => ensure(Number(section.dataset.chapter)));
}
const start = /^#s-(\\d+)$/.exec(location.hash);
if (start) select(Number(start[1]), true);
})();
"""
