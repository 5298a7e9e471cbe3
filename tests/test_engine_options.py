"""`--engine` options that fail before any work: no Ray installed, Ray options on the local engine."""

from __future__ import annotations

import sys

from typer.testing import CliRunner

from unlimisum.cli import app


def test_engine_ray_without_ray_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is not installed
    book = tmp_path / "book.txt"
    book.write_text("Some text to summarize.", encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", "--engine", "ray", str(book), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        'unlimisum: error: --engine ray needs Ray, which is not installed: pip install "unlimisum[ray]" '
        '(in a clone of unlimisum: pip install -e ".[ray]")']
    assert not (tmp_path / "out").exists()


def test_ray_options_need_the_ray_engine(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("Some text to summarize.", encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", "--workers", "2", str(book)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["unlimisum: error: --workers needs --engine ray"]
    result = CliRunner().invoke(app, ["summarize", "--cpus-per-worker", "4", str(book)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["unlimisum: error: --cpus-per-worker needs --engine ray"]
