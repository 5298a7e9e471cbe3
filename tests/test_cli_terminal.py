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
import time
from dataclasses import dataclass

import pytest

from tests.test_cli_process import console_script, process_env
from tests.tiny_models import SAMPLE_TEXT

pyte = pytest.importorskip("pyte")

COLUMNS, LINES = 100, 60


ANSI_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")


@dataclass
class TerminalRun:
    code: int  # exit status
    screen: list[str]  # the final screen, one string per line
    transcript: str  # everything written to the terminal, escape sequences removed


def run_in_terminal(command: list[str], cwd, *, stdin_data: bytes | None = None, timeout: float = 180) -> tuple[int, list[str]]:
    """Run ``command`` with stdout and stderr on one pseudo-terminal; (exit code, final screen lines)."""
    run = run_terminal(command, cwd, stdin_data=stdin_data, timeout=timeout)
    return run.code, run.screen


def run_terminal(command: list[str], cwd, *, stdin_data: bytes | None = None, typed: tuple = (),
                 timeout: float = 180) -> TerminalRun:
    """Run ``command`` on a pseudo-terminal (stdin too, unless ``stdin_data`` is piped in).

    ``typed``: ``(text, keys)`` pairs: once ``text`` is on the screen, ``keys`` are typed.
    """
    leader, follower = pty.openpty()
    os.set_blocking(leader, False)
    env = dict(process_env(), COLUMNS=str(COLUMNS), LINES=str(LINES), TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
    stdin = subprocess.PIPE if stdin_data is not None else follower
    process = subprocess.Popen(command, stdin=stdin, stdout=follower, stderr=follower, cwd=cwd, env=env,
                               start_new_session=True)
    os.close(follower)
    if stdin_data is not None:
        process.stdin.write(stdin_data)
        process.stdin.close()
    screen = pyte.Screen(COLUMNS, LINES)
    stream = pyte.ByteStream(screen)
    received = bytearray()
    pending = list(typed)
    deadline = time.monotonic() + timeout
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
            assert time.monotonic() < deadline, "the CLI did not finish in time:\n" + "\n".join(screen.display)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        os.close(leader)
    transcript = ANSI_ESCAPE.sub("", received.decode("utf-8", "replace"))
    return TerminalRun(process.returncode, [line.rstrip() for line in screen.display], transcript)


def summarize_command(model: str, *paths: str) -> list[str]:
    return [*console_script(), "summarize", "-m", model, "--device", "cpu", "--max-new-tokens", "12",
            "--min-new-tokens", "12", "--json", *paths]


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


def test_standard_input_at_a_terminal_says_how_to_end_it(tiny_model_dir, tmp_path):
    command = [*console_script(), "summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu",
               "--max-new-tokens", "12", "--min-new-tokens", "12", "-"]
    run = run_terminal(command, tmp_path, typed=[("end with Ctrl-D", SAMPLE_TEXT.encode() + b"\n\x04")], timeout=90)
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
    # the three chapters are generated together from views of the one encoded book: the bar names them
    assert "chapters 1-3/3: Chapter 1: The Storm … Chapter 3: The Ship" in run.transcript, run.transcript
    chapter_rows = [line for line in run.transcript.splitlines() if "chapters 1-3/3" in line]
    assert any("0/3" in line for line in chapter_rows), chapter_rows  # the book's bar: chapters done so far
    assert 'looked at' in text and 'most at "Chapter' in text, text  # where the summary looked, on the screen
    for leftover in ("chapters 1-3/3", "chapters summarized", "━", "generating tokens"):
        assert leftover not in text, text
