"""`unlimisum ingest`: report per input, JSON Lines, text output, errors on stderr, exit codes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unlimisum.cli import app

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
STORY_TITLES = [
    "Chapter 1: The Map That Moved",
    "Chapter 2: The Grandmother's Notebook",
    "Chapter 3: The Lowest Tide",
    "Chapter 4: What the Sea Keeps",
]


@pytest.fixture
def runner():
    return CliRunner()


def test_report_for_each_sample(runner):
    result = runner.invoke(app, ["ingest", str(SAMPLES)])
    assert result.exit_code == 0, result.output
    for name in ("story.epub", "story.pdf", "story.txt"):
        assert str(SAMPLES / name) in result.stdout
    assert result.stdout.count("title:      The Cartographer of Low Tide") == 3
    assert "format:     epub" in result.stdout and "format:     pdf" in result.stdout
    for title in STORY_TITLES:
        assert result.stdout.count(title) == 3
    assert result.stdout.count("chapters:   4\n") == 3  # the title lines are no chapter of their own
    assert "(untitled)" not in result.stdout
    assert "encoding:   utf-8" in result.stdout  # text files say how they were decoded
    assert "left out:   title page (title.xhtml)" in result.stdout
    assert result.stderr == ""


def test_keep_all_keeps_what_is_left_out(runner):
    result = runner.invoke(app, ["ingest", "--keep-all", str(SAMPLES / "story.epub")])
    assert result.exit_code == 0, result.output
    assert "chapters:   5" in result.stdout and "The Cartographer of Low Tide    " in result.stdout
    assert "left out:" not in result.stdout
    record = json.loads(runner.invoke(app, ["ingest", "--json", "--keep-all", str(SAMPLES / "story.epub")]).stdout)
    assert record["left_out"] == [] and len(record["chapters"]) == 5


def test_legacy_encoding_is_reported(runner, tmp_path):
    text = (
        "Все счастливые семьи похожи друг на друга, каждая несчастливая семья несчастлива по-своему. "
        "Всё смешалось в доме Облонских. Жена узнала, что муж был в связи с бывшею в их доме "
        "француженкою-гувернанткой, и объявила мужу, что не может жить с ним в одном доме.\n"
    )
    path = tmp_path / "anna.txt"
    path.write_bytes(text.encode("cp1251"))
    plain = runner.invoke(app, ["ingest", str(path)])
    assert plain.exit_code == 0 and "encoding:   cp1251" in plain.stdout
    record = json.loads(runner.invoke(app, ["ingest", "--json", "--text", str(path)]).stdout)
    assert record["metadata"]["encoding"] == "cp1251" and record["chapters"][0]["text"] == text.strip()


def test_json_lines(runner):
    result = runner.invoke(app, ["ingest", "--json", str(SAMPLES / "story.txt"), str(SAMPLES / "story.epub")])
    assert result.exit_code == 0
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [record["format"] for record in records] == ["text", "epub"]
    assert [record["path"] for record in records] == [str(SAMPLES / "story.txt"), str(SAMPLES / "story.epub")]
    assert "source" not in records[0]  # named "path", as in `summarize --json`
    assert [c["title"] for c in records[0]["chapters"]] == STORY_TITLES
    assert records[0]["left_out"] == [] and records[1]["left_out"] == ["title page (title.xhtml)"]
    assert [c["title"] for c in records[1]["chapters"]] == STORY_TITLES
    assert records[0]["author"] == "the unlimisum authors"
    assert records[1]["chars"] == sum(c["chars"] for c in records[1]["chapters"])
    assert "text" not in records[1]["chapters"][0]


def test_text_output(runner):
    result = runner.invoke(app, ["ingest", "--text", str(SAMPLES / "story.epub")])
    assert result.exit_code == 0
    assert result.stdout.startswith("Chapter 1: The Map That Moved\n\nThe village of Saltmarrow")
    with_text = runner.invoke(app, ["ingest", "--json", "--text", str(SAMPLES / "story.epub")])
    assert json.loads(with_text.stdout)["chapters"][0]["text"].startswith("The village of Saltmarrow")
    assert "==>" not in result.stdout  # one document: no header


def test_text_output_separates_several_documents(runner, tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("The first document.\n")
    second.write_text("The second document.\n")
    result = runner.invoke(app, ["ingest", "--text", str(first), str(second)])
    assert result.exit_code == 0
    assert result.stdout == f"==> {first} <==\nThe first document.\n\n==> {second} <==\nThe second document.\n"


def test_batch_goes_on_past_bad_inputs_and_fails_at_the_end(runner, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    missing = tmp_path / "missing.pdf"
    result = runner.invoke(app, ["ingest", str(empty), str(SAMPLES / "story.txt"), str(missing)])
    assert result.exit_code == 1
    assert "The Cartographer of Low Tide" in result.stdout
    assert result.stderr.splitlines() == [
        f"unlimisum: error: {empty}: empty file",
        f"unlimisum: error: {missing}: no such file or directory",
        "unlimisum: error: 2 of 3 inputs could not be read",
    ]


def test_json_reports_failures_too(runner, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    result = runner.invoke(app, ["ingest", "--json", str(bad)])
    assert result.exit_code == 1
    record = json.loads(result.stdout)
    assert record == {"path": str(bad), "error": "a PNG image, not text, EPUB or PDF", "error_type": "UnsupportedFormatError"}
    assert result.stderr.strip() == f"unlimisum: error: {bad}: a PNG image, not text, EPUB or PDF"


def test_stdin(runner):
    result = runner.invoke(app, ["ingest", "--json", "-"], input=(SAMPLES / "story.txt").read_bytes())
    assert result.exit_code == 0
    record = json.loads(result.stdout)
    assert record["path"] == "-" and record["title"] == "The Cartographer of Low Tide"
    pdf = runner.invoke(app, ["ingest", "--json", "-"], input=(SAMPLES / "story.pdf").read_bytes())
    assert json.loads(pdf.stdout)["format"] == "pdf"


def test_password_option(runner, tmp_path):
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter(clone_from=SAMPLES / "story.pdf")
    writer.encrypt(user_password="letmein", owner_password="owner", algorithm="AES-256")
    locked = tmp_path / "locked.pdf"
    with open(locked, "wb") as file:
        writer.write(file)
    refused = runner.invoke(app, ["ingest", str(locked)])
    assert refused.exit_code == 1 and "password-protected" in refused.stderr
    opened = runner.invoke(app, ["ingest", "--password", "letmein", str(locked)])
    assert opened.exit_code == 0 and "Chapter 4: What the Sea Keeps" in opened.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_named_pipe_as_path(runner, tmp_path):
    fifo = tmp_path / "story"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as pipe:
            pipe.write((SAMPLES / "story.pdf").read_bytes())

    threading.Thread(target=write, daemon=True).start()
    result = runner.invoke(app, ["ingest", "--json", str(fifo)])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["path"] == str(fifo) and record["format"] == "pdf"
    assert [c["title"] for c in record["chapters"]] == STORY_TITLES


def test_a_folders_summaries_that_unlimisum_wrote_are_not_read_as_summarize_would_not(runner, tmp_path):
    from unlimisum.runs.output import MARKDOWN_MARKER

    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (shelf / "story.txt").write_bytes((SAMPLES / "story.txt").read_bytes())
    (shelf / "story.txt.summary.md").write_text(f"{MARKDOWN_MARKER}\n# The Cartographer\n\nA summary.\n")
    (shelf / "notes.md").write_text("# My notes\n\nWritten by a person.\n")
    result = runner.invoke(app, ["ingest", "--json", str(shelf)])
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(line)["path"] for line in result.stdout.splitlines()) == [
        str(shelf / "notes.md"), str(shelf / "story.txt")]
    assert result.stderr.strip() == (f"unlimisum: not reading 1 summary that unlimisum wrote: "
                                     f"{shelf / 'story.txt.summary.md'}")
    named = runner.invoke(app, ["ingest", str(shelf / "story.txt.summary.md")])  # named, it is read as asked
    assert named.exit_code == 0 and named.stderr == ""


def test_a_document_without_a_title_is_titled_by_its_file_name_as_summarize_titles_it(runner, tmp_path):
    from unlimisum.ingest import read_document
    from unlimisum.runs.output import document_title

    untitled = tmp_path / "notes.txt"
    untitled.write_text("just a few words, and no title line to take one from.\n")
    record = json.loads(runner.invoke(app, ["ingest", "--json", str(untitled)]).stdout)
    assert record["title"] == "notes.txt" == document_title(read_document(str(untitled)))
    assert "  title:      notes.txt\n" in runner.invoke(app, ["ingest", str(untitled)]).stdout
