"""The HTML page in a real browser: Debian's chromium, headless, driven by playwright.

The page is loaded from ``file://`` as a reader opens it from disk: a click on a sentence marks its
passages in the chapter's text and brings the strongest into view; a book holding ``<script>`` and
``<img onerror=...>`` shows them as text and runs nothing; at a phone's width nothing runs off the
side; in print the book's text gives way to every sentence's evidence. The first page comes from a real
`unlimisum summarize --format html` run on a tiny random model.

The browser is the system's (``apt-get install chromium``, as .ci/run does): playwright never downloads
one here. Without a chromium on PATH these tests skip, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_html_page import hostile_book, hostile_summary
from unlimisum.cli import app
from unlimisum.runs.html import render_html

BROWSERS = ("chromium", "chromium-browser")
# The network is closed where tests run: without the background-networking flags chromium keeps trying it.
LAUNCH_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parent.parent


def system_browser() -> str | None:
    """The system's chromium, or None."""
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.fixture(scope="module")
def browser():
    """A headless chromium with an empty profile (module-wide: starting one takes a second or two)."""
    executable = system_browser()
    if executable is None:
        pytest.skip("no chromium on PATH to load the HTML page in (apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # a browser but not its driver: the test extra is not installed
        pytest.fail("playwright is missing: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory(prefix="unlimisum-chromium-") as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=LAUNCH_FLAGS,
            viewport={"width": 1280, "height": 800})
        yield context
        context.close()


@pytest.fixture
def open_page(browser):
    """``open_page(path, width=..., height=...)`` -> a playwright Page showing ``file://path``; the page's
    errors (uncaught exceptions, CSP refusals) are collected in ``page.problems``."""
    pages = []

    def load(path: Path, width: int = 1280, height: int = 800):
        page = browser.new_page()
        page.set_viewport_size({"width": width, "height": height})
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(f"error: {error}"))
        page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
        page.problems = problems
        page.goto(path.resolve().as_uri())
        pages.append(page)
        return page

    yield load
    for page in pages:
        page.close()


def evidence_data(page) -> list[dict]:
    return json.loads(page.locator("#unlimisum-evidence").text_content())


def check_first_passage_marked(page, number: int) -> None:
    """After a click on sentence ``number``: its strongest passage is marked, in view, and is the chapter's
    own text at the recorded offsets."""
    from playwright.sync_api import expect

    chapter, start, end, *_ = evidence_data(page)[number]["passages"][0]
    mark = page.locator("#book mark.first")
    expect(mark).to_have_count(1)
    expect(mark).to_be_in_viewport()
    text = page.evaluate(f"JSON.parse(document.getElementById('text-{chapter}').textContent)"
                         f".slice({start}, {end})")
    assert mark.text_content() == text
    assert page.locator(f"#ch-{chapter} mark.first").count() == 1
    quoted = page.locator(f"#e-{number} blockquote").first.text_content()
    assert " ".join(text.split()).startswith(quoted.removesuffix("…"))


def test_a_real_run_gives_a_page_whose_sentences_show_their_passages(loader, tiny_model_dir, tmp_path, open_page):
    """`unlimisum summarize samples/story.epub -o out --format html`, then a reader clicks through the page."""
    from playwright.sync_api import expect

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu",
                                      "--max-new-tokens", "24", "--min-new-tokens", "20", "--per-chapter",
                                      "--format", "html", "-o", str(out), str(REPO / "samples" / "story.epub")])
    assert result.exit_code == 0, result.output
    page = open_page(out / "story.epub.summary.html")
    assert page.evaluate("document.compatMode") == "CSS1Compat"  # the marker line before the doctype is harmless
    sentences = evidence_data(page)
    assert sentences, "the tiny model's summary has evidence"
    expect(page.locator("#book mark")).to_have_count(0)
    page.locator("#s-0").click()
    check_first_passage_marked(page, 0)
    expect(page.locator("#s-0")).to_have_class(re.compile(r"\bcurrent\b"))
    expect(page.locator("#e-0")).to_be_visible()
    expect(page.locator("#strip .tick")).to_have_count(len(sentences[0]["passages"]))
    last = len(sentences) - 1  # a sentence of the last chapter's own summary (--per-chapter)
    page.locator(f"#s-{last}").click()
    check_first_passage_marked(page, last)
    expect(page.locator("#e-0")).to_be_hidden()
    # a segment of the strip opens its chapter
    segment = page.locator("#strip .seg").last
    chapter = segment.get_attribute("data-chapter")
    segment.click()
    expect(page.locator(f"#ch-{chapter} h3")).to_be_in_viewport()
    assert page.locator(f"#ch-{chapter} .text").text_content().strip()
    assert page.problems == []


def test_hostile_markup_in_a_book_shows_as_text_and_runs_nothing(tmp_path, open_page):
    from playwright.sync_api import expect

    document = hostile_book()
    path = tmp_path / "hostile.summary.html"
    path.write_text(render_html(hostile_summary(document), document), encoding="utf-8")
    page = open_page(path)
    page.locator("#s-0").click()
    check_first_passage_marked(page, 0)
    page.locator("#s-1").click()
    for section in page.locator("#book .chapter").all():  # every chapter's text on the page
        section.scroll_into_view_if_needed()
    expect(page.locator("#book .chapter .text .pending")).to_have_count(0)
    assert page.evaluate("window.pwned") is None
    assert page.locator("img").count() == 0
    assert page.locator("script:not([type])").count() == 1  # the page's own
    assert page.locator("#book mark").first.text_content() in document.chapters[2].text
    assert "<script>window.pwned" in page.locator("#ch-0 .text").text_content()
    assert page.locator("h1").text_content() == document.title
    assert page.title() == f"{document.title} — summary"
    assert page.problems == []


def test_a_phone_reads_it_without_scrolling_sideways_and_print_keeps_the_evidence(tmp_path, open_page):
    from playwright.sync_api import expect

    document = hostile_book()
    path = tmp_path / "hostile.summary.html"
    path.write_text(render_html(hostile_summary(document), document), encoding="utf-8")
    page = open_page(path, width=360, height=740)
    page.locator("#s-0").click()
    check_first_passage_marked(page, 0)
    expect(page.locator("#back")).to_be_visible()  # on a phone the book is below: a way back up
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    page.locator("#back").click()
    expect(page.locator("#s-0")).to_be_in_viewport()
    page.emulate_media(media="print")
    expect(page.locator("#book")).to_be_hidden()
    expect(page.locator(".notes .note")).to_have_count(2)
    for note in page.locator(".notes .note").all():
        expect(note).to_be_visible()
