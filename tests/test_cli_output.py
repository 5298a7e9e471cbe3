"""The CLI's pieces on their own: job planning, atomic writes, rendering, the Rich progress display."""

from __future__ import annotations

import dataclasses

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from unlimisum.runs.jobs import JSON_EXTENSION, plan_jobs
from unlimisum import files
from unlimisum.runs.output import MARKDOWN_MARKER, atomic_write_text, render_markdown, summary_record
from unlimisum.cli.progress import ProgressDisplay, format_bytes, format_seconds
from unlimisum.document import Chapter, Document
from unlimisum.errors import ConfigError
from unlimisum.summarizer import ProgressEvent, Summary, SummaryStats


def make_summary(text="A short summary.", chapters=()):
    stats = SummaryStats(
        model="tiny", input_tokens=1234, windows=5, window=64, index_kind="exact", index_device="cpu", retrieval_k=64,
        datastore_bytes=3 * 2**20, generated_tokens=40, timings={"generate": 2.0}, peak_rss_bytes=2**30,
        peak_gpu_bytes=None,
    )
    return Summary(text=text, title="Book", source="book.txt", stats=stats, chapters=tuple(chapters))


# -- jobs ------------------------------------------------------------------------------------


def touch(path: Path, text: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_outputs_keep_the_input_name_and_mirror_subfolders_of_each_directory_argument(tmp_path):
    touch(tmp_path / "shelf" / "a.txt")
    touch(tmp_path / "shelf" / "deep" / "er" / "b.epub")
    touch(tmp_path / "shelf" / "a.txt.summary.md", MARKDOWN_MARKER + "\n\nold")  # an earlier output: not an input
    loose = touch(tmp_path / "loose.pdf")
    out = tmp_path / "out"
    plan = plan_jobs([str(tmp_path / "shelf"), str(loose), "-"], out)
    assert [(job.source, job.output) for job in plan.jobs] == [
        (str(tmp_path / "shelf" / "a.txt"), out / "a.txt.summary.md"),
        (str(tmp_path / "shelf" / "deep" / "er" / "b.epub"), out / "deep" / "er" / "b.epub.summary.md"),
        (str(loose), out / "loose.pdf.summary.md"),
        ("-", out / "stdin.summary.md"),
    ]
    assert plan.own_outputs == [tmp_path / "shelf" / "a.txt.summary.md"]
    assert all(job.problem is None for job in plan.jobs)


def test_an_output_name_does_not_depend_on_the_other_inputs(tmp_path):
    text, pdf = touch(tmp_path / "book.txt"), touch(tmp_path / "book.pdf", "%PDF-1.4")
    alone = plan_jobs([str(text)], tmp_path / "out", JSON_EXTENSION).jobs
    together = plan_jobs([str(text), str(pdf), str(tmp_path / "." / "book.txt")], tmp_path / "out", JSON_EXTENSION).jobs
    assert [job.output.name for job in alone] == ["book.txt.summary.json"]
    assert [job.output.name for job in together] == ["book.txt.summary.json", "book.pdf.summary.json"]


def test_two_directories_with_the_same_layout_are_a_usage_error_naming_both(tmp_path):
    first, second = touch(tmp_path / "a" / "x.txt"), touch(tmp_path / "b" / "x.txt")
    with pytest.raises(ConfigError) as raised:
        plan_jobs([str(first.parent), str(second.parent)], tmp_path / "out")
    assert str(first) in str(raised.value) and str(second) in str(raised.value)


def test_an_output_that_is_an_input_is_refused(tmp_path):
    book = touch(tmp_path / "book.txt")
    os.link(book, tmp_path / "book.txt.summary.md")  # a hard link: same file, other name
    (job,) = plan_jobs([str(book)], tmp_path).jobs
    assert "that is an input file" in str(job.problem)


def test_unusable_inputs_are_found_by_planning(tmp_path):
    png = tmp_path / "photo.txt"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    touch(tmp_path / "blank.txt", "  \n")
    sources = [str(tmp_path / "missing.txt"), str(png), str(tmp_path / "blank.txt"), str(touch(tmp_path / "ok.md"))]
    problems = [job.problem for job in plan_jobs(sources, None).jobs]
    assert "no such file" in str(problems[0]) and "PNG image" in str(problems[1])
    assert "only whitespace" in str(problems[2]) and problems[3] is None


def test_stdin_twice_is_a_usage_error():
    with pytest.raises(ConfigError):
        plan_jobs(["-", "-"], None)


def test_without_output_dir_jobs_print(tmp_path):
    (job,) = plan_jobs([str(touch(tmp_path / "a.txt"))], None).jobs
    assert job.output is None and job.problem is None


# -- atomic writes and rendering ---------------------------------------------------------------


def test_atomic_write_creates_folders_and_replaces(tmp_path):
    target = tmp_path / "new" / "dir" / "x.summary.md"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert os.listdir(target.parent) == ["x.summary.md"]
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)  # a normal file's mode, not mkstemp's


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, failure):
    target = tmp_path / "x.summary.md"
    target.write_text("old")

    def broken_replace(source, destination):
        raise failure()

    monkeypatch.setattr(files.os, "replace", broken_replace)  # atomic_write_text writes through unlimisum.files
    with pytest.raises(failure):
        atomic_write_text(target, "new")
    assert os.listdir(tmp_path) == ["x.summary.md"] and target.read_text() == "old"


def test_markdown_has_heading_and_chapter_sections():
    document = Document(title="Book", chapters=(Chapter("One", "a"), Chapter("", "b")), source="shelf/book.epub")
    stats = make_summary().stats
    summary = make_summary(chapters=[Summary("first", "One", "", stats), Summary("second", "", "", stats)])
    text = render_markdown(summary, document, heading=True)
    # an untitled part is never given a chapter name the book does not have
    assert text == "# Book — shelf/book.epub\n\nA short summary.\n\n## One\n\nfirst\n\n## Part 2\n\nsecond\n"
    assert render_markdown(make_summary(), document, heading=False) == "A short summary.\n"


def test_markdown_coverage_table_and_json_coverage():
    from unlimisum.coverage import CoverageSpan

    spans = (CoverageSpan("Loomings", 0, 100, 0.25), CoverageSpan("The | Carpet-Bag", 100, 400, 0.75))
    summary = dataclasses.replace(make_summary(), coverage=spans, window_coverage=spans)
    document = Document(title="Book", chapters=(Chapter("Loomings", "a"),), source="book.txt")
    text = render_markdown(summary, document, heading=False, coverage=True)
    assert "| Loomings | 0–100 | 25.0% |" in text and "| The \\| Carpet-Bag | 100–400 | 75.0% |" in text
    assert "share of attention" not in render_markdown(summary, document, heading=False)
    record = summary_record(summary, document)
    assert record["coverage"][1] == {"title": "The | Carpet-Bag", "start_token": 100, "end_token": 400, "share": 0.75}
    assert len(record["window_coverage"]) == 2


def test_formatting():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_seconds(5.25) == "5.2 s" and format_seconds(125) == "2m05s" and format_seconds(3725) == "1h02m05s"


# -- progress display -----------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeMemory:
    cuda_device = None

    def rss(self):
        return 512 * 2**20

    def gpu(self):
        return 3 * 2**30


def terminal(width=160):
    return Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)


def test_live_display_shows_stages_rates_memory_and_datastore():
    console, clock = terminal(), FakeClock()
    display = ProgressDisplay(console, clock=clock, memory=FakeMemory(), auto_refresh=False)
    with display:
        display.begin_document(2, 3, "shelf/book.epub")
        display(ProgressEvent("tokenize", 0, 1, "Book"))
        display(ProgressEvent("tokenize", 1, 1, "Book", {"tokens": 10_000}))
        info = {"tokens": 10_000, "index": "exact", "index_device": "cpu"}
        display(ProgressEvent("encode", 0, 4, "Book", info))
        clock.now += 2.0
        display(ProgressEvent("encode", 2, 4, "Book", info))  # 5,000 tokens in 2 s
        display.refresh()
        encoding = console.file.getvalue()
        display(ProgressEvent("index", 0, 1, "Book", info))
        display(ProgressEvent("index", 1, 1, "Book", dict(info, bytes=3 * 2**20)))
        display(ProgressEvent("prepare", 0, 1, "Book"))
        display.refresh()
        preparing = console.file.getvalue()[len(encoding):]
        display(ProgressEvent("prepare", 1, 1, "Book", {"bytes": 3 * 2**20, "packed_bytes": 7 * 2**20}))
        display(ProgressEvent("generate", 0, 256, "Book"))
        clock.now += 4.0
        display(ProgressEvent("generate", 100, 256, "Book"))  # 100 tokens in 4 s
        display.refresh()
        generating = console.file.getvalue()[len(encoding):]
    assert "encoding windows" in encoding and "2/4" in encoding and "2,500 tokens/s" in encoding
    assert "shelf/book.epub (2/3)" in encoding and "RSS 512.0 MiB" in encoding and "GPU 3.0 GiB" in encoding
    assert "generating tokens" in generating and "100/256" in generating and "25 tokens/s" in generating
    assert "preparing retrieval" in preparing and "datastore 3.0 MiB" in preparing
    assert "datastore 3.0 MiB + 7.0 MiB packed copies" in generating


def test_done_line_and_failures_without_a_terminal():
    console = Console(file=io.StringIO(), force_terminal=False, width=60)
    display = ProgressDisplay(console, clock=FakeClock())
    assert not display.live
    with display:
        display.begin_document(1, 2, "book.txt")
        display(ProgressEvent("encode", 0, 4, "Book", {"tokens": 10}))
        display.document_done(make_summary(), "book.txt", 12.5, output=Path("out/book.summary.md"))
        display.document_failed("a/very/long/path/that/does/not/fit/in/sixty/columns/bad.pdf", "corrupt file")
        display.failure_report([("a/very/long/path/that/does/not/fit/in/sixty/columns/bad.pdf", "corrupt file")], 2)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == (
        "done book.txt: 1,234 tokens in 5 windows · exact index on cpu (3.0 MiB), k=64 · 40 summary tokens "
        "(20.0 tokens/s) · peak RSS 1.0 GiB · 12.5 s -> out/book.summary.md"
    )
    assert lines[1] == "unlimisum: error: a/very/long/path/that/does/not/fit/in/sixty/columns/bad.pdf: corrupt file"
    assert lines[2:] == ["1 of 2 inputs failed:", "  a/very/long/path/that/does/not/fit/in/sixty/columns/bad.pdf: corrupt file"]


@pytest.mark.parametrize("columns", [50, 80, 100])
def test_at_a_terminal_the_done_and_looked_at_lines_fit_its_width_broken_at_spaces(columns):
    """A terminal wraps a line at its edge, mid-word (``tok|ens``): the lines left on the screen break at spaces
    instead, and the bar of where the summary looked is as wide as leaves room for what it says."""
    from unlimisum.coverage import CoverageSpan

    console = terminal(width=columns)
    display = ProgressDisplay(console, clock=FakeClock(), memory=FakeMemory(), auto_refresh=False)
    spans = (CoverageSpan("Chapter 1: The Map That Moved", 0, 600, 0.62),
             CoverageSpan("Chapter 2: The Grandmother's Notebook", 600, 1234, 0.38))
    summary = dataclasses.replace(make_summary(), coverage=spans)
    display.document_done(summary, "shelf/a book with a long name.txt", 12.5,  # what stays on the screen
                          output=Path("summaries/a book with a long name.txt.summary.md"))
    rows = [row.rstrip() for row in console.file.getvalue().splitlines() if row.strip()]
    assert all(len(row) <= columns for row in rows), rows
    looked = next(number for number, row in enumerate(rows) if "looked at" in row)
    done = " ".join(row.strip() for row in rows[:looked])
    assert done == ("done shelf/a book with a long name.txt: 1,234 tokens in 5 windows · exact index on cpu "
                    "(3.0 MiB), k=64 · 40 summary tokens (20.0 tokens/s) · peak RSS 1.0 GiB · 12.5 s -> "
                    "summaries/a book with a long name.txt.summary.md")  # every break at a space
    assert "\u2595" in rows[looked] and "\u258f" in rows[looked]  # the whole bar on one line
    said = " ".join(row.strip() for row in rows[looked:]).split("\u258f")[1]
    assert said == ' most at "Chapter 1: The Map That Moved" (62%)'
    if columns >= 100:
        assert len(rows) == looked + 1  # room for all of it on one line


def test_quiet_prints_errors_only():
    console = terminal()
    display = ProgressDisplay(console, show=False, verbose=1, clock=FakeClock(), memory=FakeMemory())
    with display:
        display.begin_document(1, 1, "book.txt")
        display(ProgressEvent("generate", 0, 10, "Book"))
        display.document_done(make_summary(), "book.txt", 1.0)
        display.document_skipped("other.txt", "out/other.summary.md")
        display.log("a log line")
        assert console.file.getvalue() == ""
        display.document_failed("bad.txt", "empty file")
    assert console.file.getvalue() == "unlimisum: error: bad.txt: empty file\n"


def test_verbose_logs_stages():
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    clock = FakeClock()
    display = ProgressDisplay(console, verbose=1, clock=clock)
    clock.now += 1.5
    display(ProgressEvent("tokenize", 1, 1, "Book", {"tokens": 42}))
    assert console.file.getvalue() == "    1.50s tokenized: 42 tokens\n"


def test_per_chapter_progress_names_the_chapter_over_a_bar_of_the_book():
    console, clock = terminal(), FakeClock()
    display = ProgressDisplay(console, clock=clock, auto_refresh=False)
    titles = [f"Part {number}" for number in range(1, 11)]
    with display:
        display.begin_document(1, 1, "book.epub")
        display(ProgressEvent("chapter", 0, 10, titles[0], {"titles": titles[:8]}))
        display(ProgressEvent("generate", 0, 12, "8 documents"))
        display.refresh()
        generating = console.file.getvalue()
        display(ProgressEvent("chapter", 8, 10, titles[8], {"titles": titles[8:9]}))
        display(ProgressEvent("generate", 0, 12, titles[8]))
        display.refresh()
        second = console.file.getvalue()[len(generating):]
        display.document_done(make_summary(), "book.epub", 1.0)
        display.refresh()
        after = console.file.getvalue()[len(generating) + len(second):]
    # chapters are generated in batches from views of the one encoded book: the bar names the batch
    assert "chapters 1-8/10" in generating and "0/10" in generating and "Part 1" not in generating
    assert "chapter 9/10: Part 9" in second and "8/10" in second
    assert "chapter" not in after.split("done book.epub")[-1]  # the book's bar goes with its document


# -- the display as a terminal shows it ------------------------------------------------------


def shared_terminal(width: int, lines: int = 24):
    """A console on a terminal of ``width`` columns and a writer of stdout to the same terminal; the
    third item renders what both wrote as a terminal emulator's final screen."""
    pyte = pytest.importorskip("pyte")
    terminal_file = io.StringIO()
    console = Console(file=terminal_file, force_terminal=True, width=width, height=lines, color_system=None)

    def write_stdout(text: str) -> None:
        terminal_file.write(text)

    def final_screen() -> list[str]:
        screen = pyte.Screen(width, lines)
        pyte.Stream(screen).feed(terminal_file.getvalue().replace("\n", "\r\n"))  # the tty's own onlcr
        return [line.rstrip() for line in screen.display]

    return console, write_stdout, final_screen


def test_a_redraw_after_the_summary_keeps_it_on_the_screen():
    """The display steps aside for stdout and comes back; its next redraws (here forced, in a run the
    refresh thread's) happen below the summary instead of over it."""
    console, write_stdout, final_screen = shared_terminal(80)
    clock = FakeClock()
    display = ProgressDisplay(console, clock=clock, memory=FakeMemory(), auto_refresh=False)
    with display:
        display.begin_document(1, 2, "book.txt")
        display(ProgressEvent("generate", 0, 8, "Book"))
        display(ProgressEvent("generate", 5, 8, "Book"))
        display.refresh()
        with display.paused():
            write_stdout("The keeper counted the ships.\n")
        display.refresh()
        display.refresh()
        display.document_done(make_summary(), "book.txt", 1.0)
        display.refresh()
        display.begin_document(2, 2, "other.txt")
        display.refresh()
        with display.paused():
            write_stdout("\nA second summary.\n")
        display.refresh()
        display.document_done(make_summary(), "other.txt", 1.0)
    screen = [line for line in final_screen() if line]
    assert screen[0] == "The keeper counted the ships."
    assert screen[1].startswith("done book.txt:")
    assert "A second summary." in screen
    assert not any("generating" in line or "━" in line for line in screen), screen


@pytest.mark.parametrize("width", [80, 100])
def test_long_labels_are_cut_and_the_bar_and_counts_never_are(width):
    console, _, final_screen = shared_terminal(width)
    clock = FakeClock()
    display = ProgressDisplay(console, clock=clock, auto_refresh=False)
    titles = [f"Chapter {number}: What the Sea Said to the Lighthouse Keeper at Night" for number in range(1, 41)]
    with display:
        display.begin_document(1, 1, "shelf/a folder with a long name/and another one inside it/"
                                     "moby-dick-or-the-whale-complete-and-unabridged.epub")
        display(ProgressEvent("chapter", 8, 40, titles[8], {"titles": titles[8:16]}))
        display(ProgressEvent("tokenize", 0, 1, titles[11]))
        display(ProgressEvent("generate", 0, 100, "8 documents"))
        clock.now += 2.0
        display(ProgressEvent("generate", 94, 100, "8 documents"))
        display.refresh()
        screen = [line for line in final_screen() if line]
    chapter_row, stage_row, status_row = screen[-3:]
    assert chapter_row.split()[1:3] == ["chapters", "9-16/40"] and "8/40" in chapter_row
    assert "generating tokens" in stage_row and "94/100" in stage_row and "47 tokens/s" in stage_row
    assert stage_row.count("━") >= 9 and chapter_row.count("━") + chapter_row.count("╸") >= 1
    assert all(len(row) <= width for row in screen)
    assert status_row.endswith("…")  # the long path is cut to the line


def test_the_chapter_being_read_is_named_and_long_titles_are_cut():
    console, _, final_screen = shared_terminal(80)
    display = ProgressDisplay(console, clock=FakeClock(), auto_refresh=False)
    long_title = "What the Sea Said to the Lighthouse Keeper at Night, and What She Answered"
    with display:
        display.begin_document(1, 1, "book.epub")
        display(ProgressEvent("chapter", 8, 31, "Loomings", {"titles": ["Loomings", long_title]}))
        display(ProgressEvent("tokenize", 0, 1, "Loomings"))
        display.refresh()
        first = [line for line in final_screen() if line]
        display(ProgressEvent("tokenize", 0, 1, long_title))
        display.refresh()
        second = [line for line in final_screen() if line]
    assert "chapter 9/31: Loomings" in first[-3]
    assert "chapter 10/31: What the Sea" in second[-3] and "…" in second[-3] and "8/31" in second[-3]
