"""The CLI as a person sees it in a terminal: run in a pseudo-terminal, rendered by a terminal emulator.

stdout and stderr share the terminal, as in an interactive shell. What must hold on the final
screen: every summary is there, and no progress bar is left behind.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import pytest

from tests.test_cli_process import console_script, process_env
from tests.tiny_models import SAMPLE_TEXT

pyte = pytest.importorskip("pyte")

COLUMNS, LINES = 100, 60


def run_in_terminal(command: list[str], cwd, *, stdin_data: bytes | None = None, timeout: float = 180) -> tuple[int, list[str]]:
    """Run ``command`` with stdout and stderr on one pseudo-terminal; (exit code, final screen lines)."""
    leader, follower = pty.openpty()
    os.set_blocking(leader, False)
    env = dict(process_env(), COLUMNS=str(COLUMNS), LINES=str(LINES), TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    import fcntl
    import struct
    import termios

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
                    continue
            if process.poll() is not None and not ready:
                break
            if ready and not data and process.poll() is not None:
                break
            assert time.monotonic() < deadline, "the CLI did not finish in time"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        os.close(leader)
    return process.returncode, [line.rstrip() for line in screen.display]


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
