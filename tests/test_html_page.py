"""The HTML page of a summary (unlimisum/runs/html.py) and the options that write it.

A page is read in a browser: the tests in tests/test_html_browser.py click through it in a headless
chromium. Here: what the markup holds. A book's text is data, so a chapter holding ``<script>`` or
``<img onerror=...>`` must come out as text: the page is parsed and every element and attribute in it
checked against what the renderer itself writes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unlimisum.cli import app
from unlimisum.coverage import CoverageSpan
from unlimisum.document import Chapter, Document
from unlimisum.evidence import SentenceEvidence, Source, quote
from unlimisum.results import Summary, SummaryStats
from unlimisum.runs.html import HTML_MARKER, render_html, script_json, utf16_offsets
from unlimisum.runs.output import is_unlimisum_output, shown_sources

HOSTILE = ('<script>window.pwned = "script"</script> and <img src=x onerror="window.pwned = \'img\'"> '
           '<!-- a comment --> </script><script>window.pwned = "escaped"</script> & &amp; "quotes" \'too\'')
FAST = ["--device", "cpu", "--max-new-tokens", "8", "--min-new-tokens", "6"]


def hostile_book() -> Document:
    """Two chapters whose titles and texts hold markup, the first with a character outside the BMP before
    its passage (JavaScript counts it twice)."""
    first = "Call me Ishmael. 😀 " * 30 + HOSTILE + " Some years ago. " * 50
    second = "I stuffed a shirt or two into my old carpet-bag. " * 40 + HOSTILE
    return Document(title='Moby <i onmouseover="x()">Dick</i>', source="books/<b>moby</b>.txt",
                    chapters=(Chapter("Loomings <script>alert(1)</script>", first),
                              Chapter("", ""),  # an empty chapter: no section, no segment
                              Chapter('The "Carpet-Bag" <img src=x onerror=alert(2)>', second)))


def hostile_summary(document: Document, support: tuple = (None, 0.02)) -> Summary:
    """A summary of ``hostile_book()`` whose first sentence's first passage is the hostile markup."""
    first, second = document.chapters[0].text, document.chapters[2].text
    start = first.index("<script>")
    end = start + len(HOSTILE)
    one = "Ishmael <script>window.pwned = 'sentence'</script> goes to sea."
    two = "He packs <b>a bag</b>."
    text = f"{one} {two}"
    sources_one = (Source(0, document.chapters[0].title, start, end, 0.7, quote(first[start:end])),
                   Source(2, document.chapters[2].title, 0, 48, 0.295, quote(second[:48])),
                   Source(2, document.chapters[2].title, 100, 140, 0.005, quote(second[100:140])))
    evidence = (SentenceEvidence(one, 0, len(one), sources_one, support=support[0]),
                SentenceEvidence(two, len(one) + 1, len(text),
                                 (Source(2, document.chapters[2].title, 60, 90, 1.0, quote(second[60:90])),),
                                 support=support[1]))
    stats = SummaryStats("tiny <model>", 1000, 4, 256, "exact", "cpu", 256, 1000, 12, {}, 0, None)
    coverage = (CoverageSpan(document.chapters[0].title, 0, 600, 0.7),
                CoverageSpan(document.chapters[2].title, 600, 1000, 0.3))
    windows = tuple(CoverageSpan(f"window {i + 1}", i * 250, (i + 1) * 250, share)
                    for i, share in enumerate((0.5, 0.2, 0.1, 0.2)))
    return Summary(text, document.title, document.source, stats, coverage=coverage, window_coverage=windows,
                   evidence=evidence, warnings=("a warning <with markup>",))


class Markup(HTMLParser):
    """Every element and attribute of a page, the text of its scripts, and its comments."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.scripts: list[tuple[dict, str]] = []
        self.comments: list[str] = []
        self.text: list[str] = []
        self._script: dict | None = None
        self._style = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.elements.append((tag, attributes))
        if tag == "script":
            self._script = attributes
            self.scripts.append((attributes, ""))
        self._style = self._style or tag == "style"

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None
        self._style = self._style and tag != "style"

    def handle_data(self, data):
        if self._style:
            return
        if self._script is not None:
            attributes, text = self.scripts[-1]
            self.scripts[-1] = (attributes, text + data)
        else:
            self.text.append(data)

    def handle_comment(self, data):
        self.comments.append(data)


def parse(page: str) -> Markup:
    markup = Markup()
    markup.feed(page)
    markup.close()
    return markup


# The elements and attributes the renderer writes; anything else in a page came from the book.
ELEMENTS = {"html", "head", "meta", "title", "style", "body", "div", "header", "h1", "h2", "h3", "p", "section",
            "a", "span", "ol", "li", "blockquote", "script", "noscript"}
ATTRIBUTES = {"charset", "http-equiv", "content", "name", "lang", "class", "id", "href", "hidden", "style", "title",
              "aria-label", "aria-labelledby", "aria-live", "aria-busy", "type", "data-s", "data-p", "data-chapter",
              "data-chars"}


def test_book_text_is_data_in_every_place_it_appears():
    document = hostile_book()
    page = render_html(hostile_summary(document), document)
    markup = parse(page)
    assert {tag for tag, _ in markup.elements} <= ELEMENTS
    assert {name for _, attributes in markup.elements for name in attributes} <= ATTRIBUTES
    assert markup.comments == [HTML_MARKER.removeprefix("<!--").removesuffix("-->")]
    # the scripts: one that runs (the page's own, allowed by its hash), the rest inert JSON
    running = [text for attributes, text in markup.scripts if "type" not in attributes]
    assert len(running) == 1
    digest = base64.b64encode(hashlib.sha256(running[0].encode()).digest()).decode()
    policy = next(a["content"] for tag, a in markup.elements if a.get("http-equiv") == "Content-Security-Policy")
    assert f"script-src 'sha256-{digest}'" in policy and "default-src 'none'" in policy
    data = {a["id"]: json.loads(text) for a, text in markup.scripts if a.get("type") == "application/json"}
    assert data["text-0"] == document.chapters[0].text and data["text-2"] == document.chapters[2].text
    assert "text-1" not in data  # the empty chapter
    # the titles, the sentences, the warning and the quotes are text, as written
    shown = "".join(markup.text)
    for text in (document.title, document.chapters[0].title, document.chapters[2].title, document.source,
                 "Ishmael <script>window.pwned = 'sentence'</script> goes to sea.", "a warning <with markup>",
                 " ".join(HOSTILE.split()), "tiny <model>"):
        assert text in shown, text


def test_the_evidence_data_points_at_the_passages_in_javascript_units():
    document = hostile_book()
    summary = hostile_summary(document)
    markup = parse(render_html(summary, document))
    data = {a["id"]: json.loads(text) for a, text in markup.scripts if a.get("type") == "application/json"}
    sentences = data["unlimisum-evidence"]
    assert len(sentences) == 2
    first = sentences[0]["passages"]
    assert len(first) == 2  # the passage with 0.5 % of the sentence's attention is not listed
    chapter, start, end, share, where = first[0]
    text = data[f"text-{chapter}"]
    as_javascript = text.encode("utf-16-le")  # what the page's script slices
    assert as_javascript[2 * start:2 * end].decode("utf-16-le") == HOSTILE
    assert share == 0.7 and 0 < where < 0.6  # in the first chapter's part of the strip
    where = 0.6 + 0.4 * 60 / len(document.chapters[2].text)  # 60 characters into the second segment
    assert sentences[1] == {"passages": [[2, 60, 90, 1.0, pytest.approx(where, abs=1e-4)]], "support": 0.02,
                            "weak": True}
    assert sentences[0]["support"] is None and sentences[0]["weak"] is False


def test_weak_sentences_are_marked_check_first_and_support_shown_only_when_measured():
    document = hostile_book()
    page = render_html(hostile_summary(document, support=(1.8, 0.02)), document)
    shown = "".join(parse(page).text)
    assert "support 1.80 nats/token" in shown
    assert "check first: support 0.02 nats/token" in shown
    assert shown.count("check first") == 2  # beside the sentence in the summary, and in its evidence
    unmeasured = "".join(parse(render_html(hostile_summary(document, support=(None, None)), document)).text)
    assert "support" not in unmeasured.lower() and "check first" not in unmeasured


def test_a_summary_without_evidence_still_makes_a_page():
    document = Document.from_text("Just one chapter of text.", source="one.txt")
    stats = SummaryStats("tiny", 7, 1, 64, "exact", "cpu", 64, 100, 3, {}, 0, None)
    summary = Summary("A summary.", "", "one.txt", stats)
    markup = parse(render_html(summary, document))
    shown = "".join(markup.text)
    assert "A summary." in shown and "No evidence was recorded" in shown
    assert not [a for tag, a in markup.elements if tag == "a" and "s" in a.get("class", "").split()]


def test_script_json_cannot_end_its_element():
    text = "</script><!-- <script> </SCRIPT >"
    encoded = script_json(text)
    assert "<" not in encoded and json.loads(encoded) == text


def test_utf16_offsets():
    text = "a😀b😀c"
    offsets = utf16_offsets(text, range(len(text) + 1))
    assert offsets == [len(text[:k].encode("utf-16-le")) // 2 for k in range(len(text) + 1)]
    assert utf16_offsets("plain", [0, 3, 5]) == [0, 3, 5]


def test_shown_sources_drop_passages_under_one_percent():
    sources = hostile_summary(hostile_book()).evidence[0].sources
    assert [source.share for source in shown_sources(SentenceEvidence("x", 0, 1, sources))] == [0.7, 0.295]


def test_a_page_is_recognised_as_unlimisums_own(tmp_path):
    document = hostile_book()
    page = tmp_path / "x.summary.html"
    page.write_text(render_html(hostile_summary(document), document), encoding="utf-8")
    assert page.read_text(encoding="utf-8").startswith(HTML_MARKER + "\n<!DOCTYPE html>")
    assert is_unlimisum_output(page)
    other = tmp_path / "mine.html"
    other.write_text("<!DOCTYPE html><p>mine</p>", encoding="utf-8")
    assert not is_unlimisum_output(other)


# -- the command line ---------------------------------------------------------------------------


@pytest.fixture
def summarize(loader, tiny_model_dir):
    model = str(tiny_model_dir("bart"))
    runner = CliRunner()

    def run(*args):
        return runner.invoke(app, ["summarize", "-m", model, *FAST, *map(str, args)])

    return run


@pytest.fixture
def book(tmp_path) -> Path:
    from tests.cli_helpers import write_small_books

    return write_small_books(tmp_path / "books")["text"]


def test_format_html_writes_one_page_per_input_and_overwrites_only_its_own(summarize, book, tmp_path):
    out = tmp_path / "out"
    result = summarize("--format", "html", "-o", out, book)
    assert result.exit_code == 0, result.output
    page = out / "small.txt.summary.html"
    assert is_unlimisum_output(page) and result.stdout == ""
    markup = parse(page.read_text(encoding="utf-8"))
    data = {a["id"]: json.loads(text) for a, text in markup.scripts if a.get("type") == "application/json"}
    assert data["unlimisum-evidence"] and all(sentence["passages"] for sentence in data["unlimisum-evidence"])
    again = summarize("--format", "html", "-o", out, book)  # its own page: overwritten
    assert again.exit_code == 0, again.output
    page.write_text("<p>a page of mine</p>", encoding="utf-8")
    refused = summarize("--format", "html", "-o", out, book)
    assert refused.exit_code == 1 and "refusing to overwrite" in refused.stderr
    assert page.read_text(encoding="utf-8") == "<p>a page of mine</p>"


def test_html_file_writes_the_page_beside_the_summary_on_stdout(summarize, book, tmp_path):
    page = tmp_path / "pages" / "small.html"
    result = summarize("--html", page, book)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() and not result.stdout.startswith("<")  # the Markdown summary, as without it
    assert is_unlimisum_output(page)
    summary = result.stdout.strip()
    assert summary[:20] in "".join(parse(page.read_text(encoding="utf-8")).text)


@pytest.mark.parametrize("args, message", [
    (["--format", "html"], "give -o DIR"),
    (["--json", "--format", "html", "-o", "out"], "--json and --format html contradict each other"),
    (["--html", "page.html", "second.txt"], "writes the page of one input, and 2 were given"),
])
def test_html_usage_errors(summarize, book, tmp_path, loader, monkeypatch, args, message):
    (tmp_path / "second.txt").write_text("Another book. " * 20, encoding="utf-8")
    calls = loader.calls
    monkeypatch.chdir(tmp_path)
    result = summarize(*args, book)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and loader.calls == calls


def test_html_file_that_unlimisum_did_not_write_is_refused_before_the_model_loads(summarize, book, tmp_path, loader):
    page = tmp_path / "mine.html"
    page.write_text("<p>mine</p>", encoding="utf-8")
    calls = loader.calls
    result = summarize("--html", page, book)
    assert result.exit_code == 1 and loader.calls == calls
    assert "refusing to overwrite" in result.stderr and "--html FILE" in result.stderr
    assert page.read_text(encoding="utf-8") == "<p>mine</p>"
    same = summarize("--html", book, book)
    assert same.exit_code == 1 and "that is the input file" in same.stderr


def test_a_page_that_cannot_be_written_keeps_the_summary(summarize, book, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder", encoding="utf-8")
    result = summarize("--html", blocker / "page.html", book)
    assert result.exit_code == 1
    assert "cannot write the page" in result.stderr
    assert result.stdout.strip()  # the summary was printed all the same
