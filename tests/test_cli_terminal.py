"""The CLI as a person sees it in a terminal: run in a pseudo-terminal, rendered by a terminal emulator.

stdout and stderr share the terminal, as in an interactive shell. What must hold on the final
screen: every summary is there, and no progress bar is left behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
from dataclasses import dataclass

import pytest

from unlimisum.evidence import WEAK_SUPPORT_NATS

from tests.test_cli_process import console_script, process_env
from tests.test_needle import FIXTURE as NEEDLE, filler, loaded, make_input  # noqa: F401
from tests.tiny_models import SAMPLE_TEXT

pyte = pytest.importorskip("pyte")

COLUMNS, LINES = 100, 60  # wide enough for the JSON tests' records; the summary tests take real widths


ANSI_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")


@dataclass
class TerminalRun:
    code: int  # exit status
    screen: list[str]  # the final screen, one string per line
    transcript: str  # everything written to the terminal, escape sequences removed
    rows: list[str]  # the final screen's rows unstripped, each as wide as the terminal: joined, wrapped lines are whole
    raw: bytes = b""  # every byte written to the terminal, escape sequences and all
    title: str = ""  # the window title the run left set (an OSC 0 or 2 sequence sets it)


def run_in_terminal(command: list[str], cwd, *, stdin_data: bytes | None = None) -> tuple[int, list[str]]:
    """Run ``command`` with stdout and stderr on one pseudo-terminal; (exit code, final screen lines)."""
    run = run_terminal(command, cwd, stdin_data=stdin_data)
    return run.code, run.screen


def run_terminal(command: list[str], cwd, *, stdin_data: bytes | None = None, typed: tuple = (),
                 columns: int = COLUMNS, lines: int = LINES) -> TerminalRun:
    """Run ``command`` on a pseudo-terminal of ``columns`` x ``lines`` (stdin too, unless ``stdin_data``
    is piped in). The size is the terminal's own, as in a shell: COLUMNS and LINES are not exported.

    ``typed``: ``(text, keys)`` pairs: once ``text`` is on the screen, ``keys`` are typed.
    """
    leader, follower = pty.openpty()
    os.set_blocking(leader, False)
    env = dict(process_env(), TERM="xterm-256color")
    for name in ("NO_COLOR", "COLUMNS", "LINES"):
        env.pop(name, None)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    stdin = subprocess.PIPE if stdin_data is not None else follower
    process = subprocess.Popen(command, stdin=stdin, stdout=follower, stderr=follower, cwd=cwd, env=env,
                               start_new_session=True)
    os.close(follower)
    if stdin_data is not None:
        process.stdin.write(stdin_data)
        process.stdin.close()
    screen = pyte.Screen(columns, lines)
    stream = pyte.ByteStream(screen)
    received = bytearray()
    pending = list(typed)
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                if data:
                    stream.feed(data)
                    received.extend(data)
                    if pending and pending[0][0] in "\n".join(screen.display):
                        os.write(leader, pending.pop(0)[1])
                    continue
            if process.poll() is not None and not ready:
                break
            if ready and not data and process.poll() is not None:
                break
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        os.close(leader)
    transcript = ANSI_ESCAPE.sub("", received.decode("utf-8", "replace"))
    return TerminalRun(process.returncode, [line.rstrip() for line in screen.display], transcript,
                       list(screen.display), bytes(received), screen.title)


def summarize_command(model: str, *paths: str) -> list[str]:
    # --no-evidence: each record's evidence (quotes of the book) would wrap it over more rows than the screen
    # holds for three books; these tests are about the display, not the record
    return [*console_script(), "summarize", "-m", model, "--device", "cpu", "--max-new-tokens", "12",
            "--min-new-tokens", "12", "--json", "--no-evidence", *paths]


@pytest.mark.parametrize("books", [1, 3])
def test_summaries_stay_on_the_screen_and_no_bar_is_left(tiny_model_dir, tmp_path, books):
    names = []
    for number in range(books):
        name = f"book{number}.txt"
        (tmp_path / name).write_text(f"Book {number}. " + SAMPLE_TEXT, encoding="utf-8")
        names.append(name)
    code, screen = run_in_terminal(summarize_command(str(tiny_model_dir("bart")), *names), tmp_path)
    text = "\n".join(screen)
    assert code == 0, text
    summaries = [line for line in screen if line.startswith('{"schema_version"')]
    assert len(summaries) == books, text
    assert text.count("done") == books, text
    for leftover in ("generating tokens", "encoding windows", "loading model", "tokenizing", "reading"):
        assert leftover not in text, text


# ~0.5 s of generating with the 512-position tiny BART: the live display redraws several times while the
# summary is made, and again between the summary written on stdout and the done line, as with a real model.
SLOW_SUMMARY = ["--device", "cpu", "--max-new-tokens", "40", "--min-new-tokens", "40"]
TWO_CHAPTERS = "\n\n".join(f"Chapter {number}: {title}\n\n{SAMPLE_TEXT * 3}"
                            for number, title in enumerate(("The Storm", "The Letter"), 1))


def squeezed(text: str) -> str:
    """``text`` without whitespace: lines a terminal wrapped compare equal to the lines written."""
    return "".join(text.split())


@pytest.mark.parametrize("case, columns, lines", [
    ("one book", 80, 24), ("two books", 80, 40), ("per chapter", 100, 40), ("json", 100, 30),
])
def test_everything_stdout_wrote_is_on_the_final_screen(tiny_model_dir, tmp_path, case, columns, lines):
    """What a person sees at the end of a run at a real terminal size, stdout and stderr on one terminal:
    each line of the summaries (as the same command writes them into a pipe) and a done line per book;
    no bar, spinner or stage left behind."""
    books = {"one book": ["story.txt"], "two books": ["a.txt", "b.txt"], "per chapter": ["book.txt"],
             "json": ["story.txt"]}[case]
    for name in books:
        text = TWO_CHAPTERS if case == "per chapter" else f"{name}. " + SAMPLE_TEXT * 8
        (tmp_path / name).write_text(text, encoding="utf-8")
    options = {"per chapter": ["--per-chapter"], "json": ["--json"]}.get(case, [])
    command = [*console_script(), "summarize", "-m", str(tiny_model_dir("bart", window=512)), *SLOW_SUMMARY,
               *options, *books]
    piped = subprocess.run(command, cwd=tmp_path, env=process_env(), capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr
    written = [line for line in piped.stdout.splitlines() if line.strip()]
    assert written, piped.stderr
    run = run_terminal(command, tmp_path, columns=columns, lines=lines)
    text = "\n".join(run.screen)
    assert run.code == 0, text
    if case == "json":  # the record as the terminal shows it, its wrapped rows joined, is the record written
        rows = "".join(run.rows)
        assert '{"schema_version"' in rows, text
        shown, _ = json.JSONDecoder().raw_decode(rows[rows.index('{"schema_version"'):])
        (record,) = [json.loads(line) for line in written]
        assert shown["summary"] == record["summary"] and shown["stats"].keys() == record["stats"].keys(), text
    screen = squeezed(text)
    # the tiny model writes the same summary for every chapter: each line must be on the screen as often
    missing = [line for line in dict.fromkeys(written)
               if case != "json" and screen.count(squeezed(line)) < written.count(line)]
    assert not missing, f"erased from the screen: {missing}\n--- final screen:\n{text}"
    assert text.count("done ") == len(books), text
    for leftover in ("generating tokens", "encoding windows", "loading model", "tokenizing", "preparing", "━",
                     "chapters 1-2/2"):
        assert leftover not in text, text


def test_standard_input_at_a_terminal_says_how_to_end_it(tiny_model_dir, tmp_path):
    command = [*console_script(), "summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu",
               "--max-new-tokens", "12", "--min-new-tokens", "12", "-"]
    run = run_terminal(command, tmp_path, typed=[("end with Ctrl-D", SAMPLE_TEXT.encode() + b"\n\x04")])
    text = "\n".join(run.screen)
    assert run.code == 0, text
    assert "unlimisum: reading standard input; end with Ctrl-D" in text
    assert "done standard input" in text
    for leftover in ("generating tokens", "encoding windows", "loading model", "tokenizing"):
        assert leftover not in text, text


THREE_CHAPTERS = "\n\n".join(
    f"Chapter {number}: {title}\n\n{SAMPLE_TEXT}" for number, title in enumerate(("The Storm", "The Letter", "The Ship"), 1)
)


def test_per_chapter_progress_names_the_chapter_and_leaves_no_bar(tiny_model_dir, tmp_path):
    (tmp_path / "book.txt").write_text(THREE_CHAPTERS, encoding="utf-8")
    run = run_terminal(summarize_command(str(tiny_model_dir("bart")), "--per-chapter", "book.txt"), tmp_path)
    text = "\n".join(run.screen)
    assert run.code == 0, text
    (record,) = [json.loads(line) for line in run.transcript.splitlines() if line.startswith('{"schema_version"')]
    assert [chapter["title"] for chapter in record["chapters"]] == [
        "Chapter 1: The Storm", "Chapter 2: The Letter", "Chapter 3: The Ship"
    ]
    # the three chapters are generated together from views of the one encoded book: the bar says which
    assert "chapters 1-3/3" in run.transcript and "chapters 1-3/3: Chapter" not in run.transcript, run.transcript
    chapter_rows = [line for line in run.transcript.splitlines() if "chapters 1-3/3" in line]
    assert any("0/3" in line for line in chapter_rows), chapter_rows  # the book's bar: chapters done so far
    assert 'looked at' in text and 'most at "Chapter' in text, text  # where the summary looked, on the screen
    for leftover in ("chapters 1-3/3", "chapters summarized", "━", "generating tokens"):
        assert leftover not in text, text


def test_evidence_at_80_columns_wraps_at_spaces_and_lists_no_faint_passage(loaded, filler, tmp_path):  # noqa: F811
    """--evidence at a terminal of 80 columns: the rows under the done line (each sentence, its passages) and
    the Markdown footnotes on stdout are broken at spaces, their later lines indented, so that joining the
    rows with spaces gives the text back word for word; passages with under 1 % of a sentence's attention
    are not shown (the JSON keeps them). The trained needle model looks at its needle almost only, as a
    trained summarizer looks at few passages: the other passages get well under 1 %."""
    text, _, _ = make_input(filler, 10 * 64, 0.5, seed=3)
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    base = [*console_script(), "summarize", "-m", str(NEEDLE), "--device", "cpu", "--retrieval-k", "16",
            "--evidence-passages", "6", "book.txt"]
    piped = subprocess.run([*base, "--json"], cwd=tmp_path, env=process_env(), capture_output=True, text=True,
                           timeout=180)
    assert piped.returncode == 0, piped.stderr
    evidence = json.loads(piped.stdout)["evidence"]
    shown = [[source for source in sentence["sources"] if source["share"] >= 0.01] for sentence in evidence]
    assert any(len(kept) < len(sentence["sources"]) for kept, sentence in zip(shown, evidence)), \
        "the case needs a passage under 1 % (more --evidence-passages)"
    run = run_terminal([*base, "--evidence"], tmp_path, columns=80, lines=200)
    assert run.code == 0, "\n".join(run.screen)
    screen = [line for line in run.screen if line.strip()]
    text = "\n".join(screen)

    def words(value: str) -> str:
        return " ".join(value.split())

    # the rows under the done line: each sentence and its passages, as the JSON has them
    start = next(i for i, line in enumerate(screen) if line.strip() == "evidence")
    block = screen[start + 1:]
    assert all(line.startswith("  ") for line in block), text  # no row the terminal broke off at column 0
    expected = []
    for number, (sentence, kept) in enumerate(zip(evidence, shown), start=1):
        support = ""
        if sentence["support"] is not None:
            measured = f"support {sentence['support']:.2f} nats/token"
            support = f" check first: {measured}" if sentence["support"] < WEAK_SUPPORT_NATS else f" {measured}"
        expected.append(f"[{number}] {sentence['sentence']}{support}")
        for source in kept:
            quote = words(source["quote"])
            if len(quote) > 100:  # cut at a space, the terminal's shorter quote
                quote = quote[:quote.rindex(" ", 50, 99)] + "\u2026"
            chapter = source["chapter"] or f"Part {source['chapter_index'] + 1}"
            expected.append(f"{source['share']:.0%} {chapter} \u201c{quote}\u201d")
    assert words(" ".join(block)) == words(" ".join(expected)), text
    assert not [line for line in block if line.lstrip().startswith("0%")], text
    # the footnotes of the Markdown on stdout, above the done line
    notes = [line for line in screen[:start] if line.startswith("[^") or line.startswith("    ")]
    assert notes and notes[0].startswith("[^1]: "), text
    piped_notes = subprocess.run([*base, "--evidence"], cwd=tmp_path, env=process_env(), capture_output=True,
                                 text=True, timeout=180).stdout
    written = [line for line in piped_notes.splitlines() if line.startswith("[^") and "]: " in line]
    # in a pipe the book's text is escaped for a Markdown renderer; a renderer shows what the terminal does
    rendered = [re.sub(r"\\(.)", r"\1", line) for line in written]
    assert words(" ".join(notes)) == words(" ".join(rendered)), text
    assert len(notes) > len(written)  # some footnote was longer than a row: it went on, indented
    assert " (0%)" not in piped_notes
