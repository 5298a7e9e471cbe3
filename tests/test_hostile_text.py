"""A book's text reaches a terminal, a Markdown file or a page as text: its control characters are shown as
symbols, never obeyed (unlimisum/visible.py), and its brackets are never Rich markup; JSON keeps the exact text.

The books: a text file whose chapter headings hold an OSC that sets the window title, a C1 CSI and DEL, and Rich
markup (a link, a closing tag), and whose body starts with a clear-screen and an OSC 52 clipboard write; an EPUB
whose dc:title, dc:creator and nav titles hold C1 controls, DEL and markup (XML keeps no raw C0 controls: the
reader drops them); a PDF whose outline titles and metadata title hold BEL, C1 and markup.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from tests.test_cli_process import console_script, process_env
from tests.test_cli_terminal import run_terminal
from tests.test_ingest_epub import basic_members, make_epub
from tests.test_markdown_text import rendered_text
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.visible import json_text, visible

OSC_TITLE = "\x1b]0;PWNED-TITLE\x07"
CLIPBOARD = "\x1b]52;c;SGVsbG8=\x07"
CLEAR = "\x1b[2J"
CSI = "\x9b31m"
MARKUP = "[bold red]Loud[/] [link=https://evil.example]click me[/link]"
FAST = ["--device", "cpu", "--max-new-tokens", "8", "--min-new-tokens", "4"]
# what a terminal would act on: any C0 control but tab and newline, DEL, and the C1 controls
ACTED_ON = {chr(code) for code in [*range(0x20), *range(0x7F, 0xA0)]} - {"\t", "\n"}


def hostile_text() -> str:
    body = SAMPLE_TEXT * 2
    return (f"Chapter 1: {MARKUP}\n\n{body}\n\n"
            f"Chapter 2: Quiet {CSI}C1 red [/]\n\n{CLEAR}{CLIPBOARD}{body}\n\n"
            f"Chapter 3: {OSC_TITLE} The end\x7f\n\n{body}\n")


def hostile_epub(path):
    members = basic_members()
    members["OEBPS/content.opf"] = members["OEBPS/content.opf"].replace(
        "<dc:title>Test Book</dc:title>", "<dc:title>Evil &#155;0;PWNED&#156; Book [bold]x[/]</dc:title>").replace(
        "<dc:creator>Ann Author</dc:creator>", "<dc:creator>[link=https://evil.example]Ann[/link] &#127;</dc:creator>")
    members["OEBPS/nav.xhtml"] = members["OEBPS/nav.xhtml"].replace(
        "The First", "First &#155;2J [link=https://evil.example]x[/link]").replace("The Second", "Second [/] &#127;")
    members["OEBPS/c1.xhtml"] = members["OEBPS/c1.xhtml"].replace("<p>", "<p>&#155;2J &#157;0;T&#156; ", 1)
    return make_epub(path, members)


def hostile_pdf(path):
    fpdf = pytest.importorskip("fpdf")
    pdf = fpdf.FPDF()
    pdf.set_title(f"PDF {CSI} title\x07 [bold]x[/]")
    for number, title in enumerate((f"Outline one \x07{CSI} [link=https://evil.example]x[/link]",
                                    "Outline two [/] \x7f"), start=1):
        pdf.add_page()
        pdf.start_section(title)
        pdf.set_font("Helvetica", "", 10)
        for line in SAMPLE_TEXT.split(". ")[:4]:
            pdf.cell(0, 5, f"{line} ({number}).", new_x="LMARGIN", new_y="NEXT")
    path.write_bytes(bytes(pdf.output()))
    return path


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "book.txt").write_text(hostile_text(), encoding="utf-8")
    hostile_epub(folder / "evil.epub")
    hostile_pdf(folder / "evil.pdf")
    return folder


BOOKS = ["book.txt", "evil.epub", "evil.pdf"]


def acted_on(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on."""
    return sorted({hex(ord(character)) for character in text if character in ACTED_ON})


def test_visible_shows_each_control_as_one_symbol_and_keeps_tabs_newlines_and_the_rest():
    text = "a\x1b]0;t\x07b\tc\nd\re\x7ff\x9bg\x00é←"
    shown = visible(text)
    assert shown == "a\u241b]0;t\u2407b\tc\nd\u240de\u2421f\ufffdg\u2400é←"
    assert len(shown) == len(text) and acted_on(shown) == []  # one for one: offsets into the text still hold
    dumped = json_text(json.dumps({"t": text}, ensure_ascii=False))
    assert acted_on(dumped) == [] and json.loads(dumped)["t"] == text


@pytest.mark.parametrize("book", BOOKS)
def test_ingest_shows_the_controls_and_its_json_keeps_them(library, book):
    runner = CliRunner()
    plain = runner.invoke(app, ["ingest", str(library / book)])
    assert plain.exit_code == 0, plain.output
    assert acted_on(plain.stdout + plain.stderr) == []
    assert "\ufffd" in plain.stdout or "\u2421" in plain.stdout or "\u2407" in plain.stdout
    record = json.loads(runner.invoke(app, ["ingest", "--json", "--text", str(library / book)]).stdout)
    titles = [chapter["title"] for chapter in record["chapters"]]
    assert any(character in ACTED_ON for title in titles + [record["title"]] for character in title)  # exact


@pytest.mark.parametrize("book", BOOKS)
def test_summaries_footnotes_and_logs_show_the_controls(loader, tiny_model_dir, library, book):
    model = str(tiny_model_dir("bart"))
    run = CliRunner().invoke(app, ["summarize", "-m", model, *FAST, "--per-chapter", "--evidence", "--coverage",
                                   "-v", str(library / book)])
    assert run.exit_code == 0, run.output
    assert acted_on(run.stdout) == [] and acted_on(run.stderr) == []
    assert "## " in run.stdout  # the chapters' headings, as their titles are, controls shown


@pytest.mark.parametrize("form, suffix", [("markdown", ".summary.md"), ("md", ".summary.md"),
                                          ("html", ".summary.html"), ("json", ".summary.json")])
def test_files_written_with_o_hold_no_control_character(loader, tiny_model_dir, library, tmp_path, form, suffix):
    out = tmp_path / "out"
    run = CliRunner().invoke(app, ["summarize", "-m", str(tiny_model_dir("bart")), *FAST, "--per-chapter",
                                   "--evidence", "--format", form, "-o", str(out), *[str(library / b) for b in BOOKS]])
    assert run.exit_code == 0, run.output
    written = sorted(out.glob(f"*{suffix}"))
    assert len(written) == 3
    for path in written:
        text = path.read_text(encoding="utf-8")
        assert acted_on(text) == [], path.name
        if form == "json":  # the exact titles, escaped as JSON escapes them
            record = json.loads(text)
            assert any(character in ACTED_ON for chapter in record["chapters"] for character in chapter["title"])
        if form in ("markdown", "md") and path.name.startswith("book.txt"):  # escaped: a renderer shows them
            assert "## Chapter 3: \u241b\\]0;PWNED-TITLE\u2407 The end\u2421" in text
            headings = [rendered_text(line) for line in text.splitlines() if line.startswith("## ")]
            assert all(elements == {"h2"} for elements, _ in headings)
            assert f"Chapter 1: {MARKUP}" in [heading for _, heading in headings]  # the markup as its characters


def test_in_a_terminal_the_screen_shows_the_characters_and_the_window_title_stays(tiny_model_dir, library):
    """The live display (chapter titles in its rows, log lines, the done line and the evidence under it) and the
    summary on stdout share a pseudo-terminal: no sequence of the book's reaches it, no markup of its acts."""
    run = run_terminal([*console_script(), "summarize", "-m", str(tiny_model_dir("bart")), *FAST, "--per-chapter",
                        "--evidence", "-v", "book.txt", "evil.epub", "evil.pdf"], library)
    assert run.code == 0, run.transcript[-3000:]
    assert run.title == ""  # no OSC 0 of the book's set the window title
    for sequence in (b"\x1b]0;", b"\x1b]52;", b"\x1b]8;", CLEAR.encode(), "\x9b".encode(), b"\x07", b"\x7f"):
        assert sequence not in run.raw, sequence  # Rich's own sequences are CSI cursor and colour ones
    assert "\u241b]0;PWNED-TITLE\u2407" in run.transcript  # shown, as characters
    assert "[link=https://evil.example]" in run.transcript and "[bold red]Loud[/]" in run.transcript


def test_a_pipe_gets_the_same_text_and_exit_status(tiny_model_dir, library):
    run = subprocess.run([*console_script(), "summarize", "-m", str(tiny_model_dir("bart")), *FAST, "--evidence",
                          "--per-chapter", *BOOKS], cwd=library, env=process_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert acted_on(run.stdout) == [] and acted_on(run.stderr) == []
