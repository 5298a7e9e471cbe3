"""The `unlimisum` console script as a real process: pipes, quiet stderr, Ctrl-C in a batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app

SLOW_WINDOW = 512  # a tiny BART with 512 decoder positions can be made to write long, slow summaries
SLOW = ["--device", "cpu", "--max-new-tokens", "300", "--min-new-tokens", "300"]


def console_script() -> list[str]:
    """The venv's `unlimisum` script when installed, else `python -m unlimisum`."""
    script = Path(sys.executable).with_name("unlimisum")
    return [str(script)] if script.exists() else [sys.executable, "-m", "unlimisum"]


def process_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", NO_COLOR="1")
    env.pop("UNLIMISUM_MODEL", None)
    return env


def _default_sigint() -> None:  # a shell may start background jobs with SIGINT ignored; the test needs it live
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("documents", [1, 2])
@pytest.mark.parametrize("mode", ["markdown", "json"])
def test_a_reader_that_closes_the_pipe_ends_the_run_quietly_with_one_exit_code(tiny_model_dir, tmp_path, mode, documents):
    """`unlimisum summarize ... | head -c 10`: whatever the output, the same quiet exit."""
    names = []
    for number in range(documents):
        (tmp_path / f"book{number}.txt").write_text(f"Book {number}. " + SAMPLE_TEXT, encoding="utf-8")
        names.append(f"book{number}.txt")
    command = [*console_script(), "summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu",
               "--max-new-tokens", "6", "--min-new-tokens", "3", *(["--json"] if mode == "json" else []), *names]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=process_env())
    try:
        assert len(process.stdout.read(10)) == 10  # like `head -c 10`: read ten bytes, then leave
        process.stdout.close()
        stderr = process.stderr.read().decode()
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    for noise in ("Traceback", "Broken pipe", "BrokenPipeError", "Exception ignored", "error"):
        assert noise not in stderr, stderr


def test_pipe_in_quiet_run_prints_only_summaries(tiny_model_dir, tmp_path):
    (tmp_path / "-rf book.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    command = [
        *console_script(), "summarize", "-q", "-m", str(tiny_model_dir("bart")), "--device", "cpu",
        "--max-new-tokens", "6", "--min-new-tokens", "3", "-", "--", "-rf book.txt",
    ]
    done = subprocess.run(
        command, input=SAMPLE_TEXT.encode(), capture_output=True, cwd=tmp_path, env=process_env()
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""
    headings = [line for line in done.stdout.decode().splitlines() if line.startswith("# ")]
    assert headings == ["# standard input", "# -rf book.txt"]
    assert (tmp_path / "-rf book.txt").read_text(encoding="utf-8") == SAMPLE_TEXT


@pytest.mark.slow
def test_ctrl_c_mid_batch_leaves_no_partial_file_and_a_rerun_resumes(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("bart", window=SLOW_WINDOW))
    books = tmp_path / "books"
    books.mkdir()
    for number in range(4):
        (books / f"book{number}.txt").write_text(f"Book {number}. " + SAMPLE_TEXT, encoding="utf-8")
    out = tmp_path / "out"
    command = [*console_script(), "summarize", "-m", model, *SLOW, "-o", str(out), str(books)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=process_env(), preexec_fn=_default_sigint
    )
    try:
        while not list(out.glob("*.summary.md")):  # the event: the first summary is written
            assert process.poll() is None, process.communicate()[1].decode()
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr.decode()
    assert "interrupted" in stderr.decode() and "--skip-existing" in stderr.decode()
    written = sorted(path.name for path in out.iterdir() if path.name != "unlimisum-run.json")  # the run manifest
    assert not [name for name in written if not name.endswith(".summary.md")]  # no temporary files left
    assert 1 <= len(written) < 4
    first = out / written[0]
    first_text, first_mtime = first.read_text(encoding="utf-8"), first.stat().st_mtime_ns

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumed = CliRunner().invoke(app, ["summarize", "-m", model, *SLOW, "-o", str(out), "--skip-existing", str(books)])
    finally:
        torch.set_num_threads(threads)
    assert resumed.exit_code == 0, resumed.output
    assert sorted(path.name for path in out.iterdir()) == [
        *(f"book{number}.txt.summary.md" for number in range(4)), "unlimisum-run.json"]
    assert first.read_text(encoding="utf-8") == first_text and first.stat().st_mtime_ns == first_mtime
    assert resumed.stderr.count("skipped") == len(written)
