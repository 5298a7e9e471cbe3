"""The HTML page of a summary (``--format html``) for a whole book: its size, and how fast it opens and answers.

    python -m bench.html_page [--tokens 300000] [--chapters 60] [--trials 3] [--screenshot docs/html-page.png]

The book is made of the sample story's paragraphs, repeated to ``--tokens`` tokens (4 characters a token:
300,000 tokens are 1.2 million characters) in ``--chapters`` chapters; its summary has 20 sentences, and
with the per-chapter summaries 4 sentences per chapter, each with 3 passages (``--evidence-passages``'s
default), coverage per chapter and per 512-token window, as a run of bart-large-cnn (1,024-token windows,
half of each kept) would give. What the page costs does not depend on a model, so none runs here.

Measured in the system's chromium (headless, as tests/test_html_browser.py drives it), per trial a fresh
page from ``file://``: the time to first paint and to the load event (navigation timing), and the time a
click on a sentence takes to parse its chapter, mark its passages and scroll the first into view (the
click handler and the layout it forces), at a desktop's width and a phone's.

``--screenshot PATH`` instead writes the picture the README shows: the page of samples/story.epub with a
summary written by hand for it, each sentence's passages found in the chapter's text (their shares made
up), after a click on its second sentence.

Writes bench/results/html_page.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.common import print_table, write_result
from unlimisum.coverage import CoverageSpan
from unlimisum.document import Chapter, Document
from unlimisum.evidence import SentenceEvidence, Source, quote
from unlimisum.results import Summary, SummaryStats
from unlimisum.runs.html import render_html

REPO = Path(__file__).resolve().parent.parent
CHARS_PER_TOKEN = 4
KEPT_PER_WINDOW = 512
SENTENCES, CHAPTER_SENTENCES, PASSAGES = 20, 4, 3
VIEWPORTS = {"desktop": (1280, 800), "phone": (390, 844)}


def synthetic_book(tokens: int, chapters: int) -> Document:
    """``chapters`` chapters of the sample story's paragraphs, ``tokens * CHARS_PER_TOKEN`` characters in all."""
    paragraphs = [part for part in (REPO / "samples" / "story.txt").read_text(encoding="utf-8").split("\n\n")
                  if len(part) > 200]
    per_chapter = tokens * CHARS_PER_TOKEN // chapters
    parts, cursor = [], 0
    for number in range(chapters):
        text = []
        while sum(map(len, text)) < per_chapter:
            text.append(paragraphs[cursor % len(paragraphs)])
            cursor += 1
        parts.append(Chapter(f"Chapter {number + 1}", "\n\n".join(text)[:per_chapter]))
    return Document(title="A long book", chapters=tuple(parts), source="long-book.txt")


def synthetic_summary(document: Document, tokens: int) -> Summary:
    """A summary of ``document`` with the evidence and coverage a real run of that size records."""
    lengths = [len(chapter.text) for chapter in document.chapters]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + round(length / sum(lengths) * tokens))
    bounds[-1] = tokens

    def sentences(count: int, chapters: list[int], seed: int) -> tuple[str, tuple[SentenceEvidence, ...]]:
        text, records = "", []
        for number in range(count):
            sentence = f"Sentence {number + 1} says what happened in the chapters it read, in a dozen words."
            start = len(text) + (1 if text else 0)
            text = f"{text} {sentence}" if text else sentence
            sources = []
            for rank in range(PASSAGES):
                index = chapters[(seed + number * PASSAGES + rank) % len(chapters)]
                chapter = document.chapters[index].text
                at = (seed * 7919 + number * 104729 + rank * 1299709) % max(1, len(chapter) - 200)
                sources.append(Source(index, document.chapters[index].title, at, at + 190,
                                      (0.6, 0.3, 0.1)[rank], quote(chapter[at:at + 190])))
            records.append(SentenceEvidence(sentence, start, len(text), tuple(sources)))
        return text, tuple(records)

    def windows(start: int, end: int) -> tuple[CoverageSpan, ...]:
        cuts = list(range(start, end, KEPT_PER_WINDOW)) + [end]
        return tuple(CoverageSpan(f"window {i + 1}", a, b, (b - a) / (end - start))
                     for i, (a, b) in enumerate(zip(cuts, cuts[1:])))

    stats = SummaryStats("facebook/bart-large-cnn", tokens, tokens // KEPT_PER_WINDOW, 1024, "exact", "cpu", 1024,
                         tokens * 2048, 300, {}, 0, None)
    parts = []
    for index, chapter in enumerate(document.chapters):
        text, evidence = sentences(CHAPTER_SENTENCES, [index], index)
        parts.append(Summary(text, chapter.title, document.source, stats, evidence=evidence,
                             window_coverage=windows(bounds[index], bounds[index + 1]),
                             coverage=windows(bounds[index], bounds[index + 1])))
    text, evidence = sentences(SENTENCES, list(range(len(document.chapters))), 0)
    coverage = tuple(CoverageSpan(chapter.title, a, b, (b - a) / tokens)
                     for chapter, a, b in zip(document.chapters, bounds, bounds[1:]))
    return Summary(text, document.title, document.source, stats, chapters=tuple(parts), coverage=coverage,
                   window_coverage=windows(0, tokens), evidence=evidence)


def launch(playwright, profile: str):
    from tests.test_html_browser import LAUNCH_FLAGS, system_browser

    executable = system_browser()
    if executable is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    return playwright.chromium.launch_persistent_context(profile, executable_path=executable, headless=True,
                                                        args=LAUNCH_FLAGS)


def measure(path: Path, trials: int) -> dict:
    """Per viewport, the median over ``trials`` fresh pages of: first paint, load event, a click (ms)."""
    from playwright.sync_api import sync_playwright

    found = {}
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as playwright:
        context = launch(playwright, profile)
        for name, (width, height) in VIEWPORTS.items():
            samples = {"first_paint_ms": [], "load_ms": [], "click_ms": []}
            for trial in range(trials):
                page = context.new_page()
                page.set_viewport_size({"width": width, "height": height})
                page.goto(path.resolve().as_uri(), wait_until="load")
                timing = page.evaluate("""() => new Promise((resolve) => {
                    // two frames after load: the first paint has happened and been recorded
                    requestAnimationFrame(() => requestAnimationFrame(() => {
                        const navigation = performance.getEntriesByType("navigation")[0];
                        const paint = performance.getEntriesByName("first-contentful-paint")[0];
                        resolve({load: navigation.loadEventEnd, paint: paint ? paint.startTime : null});
                    }));
                })""")
                sentence = 5 + trial  # a sentence whose chapters no earlier click rendered
                click = page.evaluate(f"""() => {{
                    const started = performance.now();
                    document.getElementById("s-{sentence}").click();
                    document.querySelector("#book mark.first").getBoundingClientRect();
                    return performance.now() - started;
                }}""")
                samples["first_paint_ms"].append(timing["paint"])
                samples["load_ms"].append(timing["load"])
                samples["click_ms"].append(click)
                page.close()
            found[name] = {key: round(statistics.median(values), 1) for key, values in samples.items()
                           if all(value is not None for value in values)}
        context.close()
    return found


def screenshot(path: Path) -> None:
    """The README's picture: samples/story.epub with a summary written by hand (see the module docstring)."""
    from playwright.sync_api import sync_playwright

    from unlimisum.ingest import read_document

    document = replace(read_document(str(REPO / "samples" / "story.epub")), source="samples/story.epub")
    written = [  # (sentence, [(chapter, a phrase of its passage, share)])
        ("Ines Harrow, the harbour master's daughter, maps the tidal flats that vanish twice a day.",
         [(0, "Ines Harrow was the only person in the village who drew maps", 0.7),
          (0, "For three years Ines drew what was there.", 0.3)]),
        ("Over three years of maps she sees that a line of nine boulders never moves.",
         [(0, "But one thing had not. A line of boulders, nine of them", 0.62),
          (0, "Nine stones in a straight line, which the sea did not move.", 0.26),
          (1, "Stones do not move. Measured again, same result.", 0.12)]),
        ("Her grandmother's notebook numbers the stones 3, 1, 4, 1, 5, 9, 2, 6, 5.",
         [(1, "Beneath each stone her grandmother had written a number.", 0.8),
          (1, "Halfway through the notebook the survey work stopped", 0.2)]),
        ("At the lowest tide of the year she finds a map of the flats cut under the ninth stone.",
         [(2, "There was a hollow beneath it, larger than the stone itself", 0.55),
          (2, "It took her a long moment to understand that she was looking at a map.", 0.45)]),
    ]
    text, evidence = "", []
    for sentence, phrases in written:
        start = len(text) + (1 if text else 0)
        text = f"{text} {sentence}" if text else sentence
        sources = []
        for index, phrase, share in phrases:
            chapter = document.chapters[index].text
            at = chapter.index(phrase)
            end = chapter.find(". ", at + len(phrase) - 1) + 1 or len(chapter)
            sources.append(Source(index, document.chapters[index].title, at, end, share, quote(chapter[at:end])))
        evidence.append(SentenceEvidence(sentence, start, len(text), tuple(sources)))
    tokens = [len(chapter.text) // CHARS_PER_TOKEN for chapter in document.chapters]
    shares = (0.38, 0.27, 0.25, 0.10)
    bounds = [sum(tokens[:i]) for i in range(len(tokens) + 1)]
    coverage = tuple(CoverageSpan(chapter.title, a, b, share)
                     for chapter, a, b, share in zip(document.chapters, bounds, bounds[1:], shares))
    stats = SummaryStats("", bounds[-1], 7, 1024, "exact", "cpu", 1024, 0, 64, {}, 0, None)  # no model wrote it
    summary = Summary(text, document.title, document.source, stats, coverage=coverage, evidence=tuple(evidence))
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        page_path = Path(folder) / "story.epub.summary.html"
        page_path.write_text(render_html(summary, document), encoding="utf-8")
        context = launch(playwright, str(Path(folder) / "profile"))
        page = context.new_page()
        page.set_viewport_size({"width": 1200, "height": 720})
        page.goto(page_path.as_uri())
        page.locator("#s-1").click()
        page.screenshot(path=str(path))
        context.close()
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--chapters", type=int, default=60)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--screenshot", type=Path, default=None, metavar="PATH")
    args = parser.parse_args()
    if args.screenshot is not None:
        screenshot(args.screenshot)
        return
    document = synthetic_book(args.tokens, args.chapters)
    summary = synthetic_summary(document, args.tokens)
    started = time.perf_counter()
    page = render_html(summary, document)
    render_seconds = time.perf_counter() - started
    size = len(page.encode("utf-8"))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "long-book.txt.summary.html"
        path.write_text(page, encoding="utf-8")
        browser = measure(path, args.trials)
    result = {
        "tokens": args.tokens, "characters": len(document.text), "chapters": args.chapters,
        "sentences": SENTENCES + CHAPTER_SENTENCES * args.chapters, "passages_per_sentence": PASSAGES,
        "page_bytes": size, "render_seconds": round(render_seconds, 3), "trials": args.trials, "browser": browser,
    }
    print(f"{args.tokens:,} tokens ({len(document.text):,} characters) in {args.chapters} chapters: a page of "
          f"{size / 2**20:.2f} MiB, rendered in {render_seconds:.2f} s")
    print_table(["viewport", "first paint ms", "load ms", "click ms"],
                [[name, figures.get("first_paint_ms", "n/a"), figures["load_ms"], figures["click_ms"]]
                 for name, figures in browser.items()])
    print(f"wrote {write_result('html_page', result)}")


if __name__ == "__main__":
    main()
