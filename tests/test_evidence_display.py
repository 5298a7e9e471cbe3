"""Evidence as a reader sees it: the Markdown footnotes of --evidence and the rows under the done line.

A passage with under 1 % of a sentence's attention is not shown (the JSON keeps every one); a sentence's
support is shown when it was measured, ``check first`` when its passages barely carried it; at a terminal
the lines break at spaces only, their later lines indented. tests/test_cli_terminal.py checks the same
through the CLI at 80 columns.
"""

from __future__ import annotations

import io

from rich.console import Console

from tests.test_html_page import hostile_book, hostile_summary
from unlimisum.cli.progress import evidence_lines
from unlimisum.runs.output import render_markdown, summary_record, with_evidence, wrap_at_spaces


def test_footnotes_show_support_and_leave_out_faint_passages():
    document = hostile_book()
    summary = hostile_summary(document, support=(1.8, 0.02))
    text, last = with_evidence(summary, 0, escape=False)  # as a terminal shows it
    notes = text.split("\n\n", 1)[1].splitlines()
    assert last == 2 and len(notes) == 2
    assert notes[0].startswith("[^1]: Support 1.80 nats/token. Loomings <script>alert(1)</script> (70%): “")
    escaped, _ = with_evidence(summary, 0)  # as a Markdown file holds it
    assert escaped.split("\n\n", 1)[1].startswith(
        "[^1]: Support 1.80 nats/token. Loomings \\<script>alert(1)\\</script> (70%): “")
    assert "(30%)" in notes[0] and "“I stuffed" in notes[0]
    assert notes[0].count("%): “") == 2  # the passage with 0.5 % is left out
    assert notes[1].startswith("[^2]: Check first: support 0.02 nats/token. ")
    unmeasured, _ = with_evidence(hostile_summary(document, support=(None, None)), 0, escape=False)
    assert "[^2]: The \"Carpet-Bag\"" in unmeasured and "[^1]: Loomings" in unmeasured
    assert "upport" not in unmeasured.split("[^1]:", 1)[1]
    record = summary_record(summary, document)  # the JSON keeps every passage
    assert [len(sentence["sources"]) for sentence in record["evidence"]] == [3, 1]


def test_footnotes_for_a_terminal_break_at_spaces_under_an_indent():
    document = hostile_book()
    summary = hostile_summary(document, support=(1.8, 0.02))
    plain = render_markdown(summary, document, heading=False, evidence=True)
    wrapped = render_markdown(summary, document, heading=False, evidence=True, width=50)
    assert wrapped != plain and " ".join(wrapped.split()) == " ".join(plain.split())
    for line in wrapped.splitlines():
        if line.startswith("    ") or line.startswith("[^"):
            assert len(line) <= 50 or " " not in line.strip(), line
    notes = wrapped[wrapped.index("\n[^1]: ") + 1:].splitlines()
    assert all(line.startswith("[^") or line.startswith("    ") for line in notes)


def test_wrap_at_spaces_counts_cells_and_keeps_long_words_whole():
    assert wrap_at_spaces("aaa bbb ccc", 7, "  ") == "aaa bbb\n  ccc"
    assert wrap_at_spaces("一二三 四五", 8, "") == "一二三\n四五"  # wide characters take two cells
    assert wrap_at_spaces("x " + "y" * 20 + " z", 10, " ") == "x\n " + "y" * 20 + "\n z"


def render(lines, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)
    for line in lines:
        console.print(line, highlight=False)
    return console.file.getvalue().splitlines()


def test_terminal_rows_wrap_under_their_text_and_show_support():
    document = hostile_book()
    summary = hostile_summary(document, support=(1.8, 0.02))
    rows = render(evidence_lines(summary), 80)
    assert rows[0] == "  evidence"
    assert all(len(row) <= 80 for row in rows) and all(row.startswith("  ") for row in rows)
    first = next(i for i, row in enumerate(rows) if row.startswith("  [1] "))
    second = next(i for i, row in enumerate(rows) if row.startswith("  [2] "))
    assert "support 1.80 nats/token" in " ".join(" ".join(rows[first:second]).split())
    assert "check first: support 0.02 nats/token" in " ".join(" ".join(rows[second:]).split())
    passages = [row for row in rows if row[:12].strip().endswith("%")]
    assert [row[:12].strip() for row in passages] == ["70%", "30%", "100%"]  # the 0.5 % passage is not shown
    for row in rows:
        if row[:12].strip() == "" and not row.startswith("  ["):  # a later line of a passage: under its text
            assert row.startswith(" " * 12) and row[12] != " ", row
    joined = " ".join(" ".join(rows).split())
    assert "<script>window.pwned" in joined  # as text
