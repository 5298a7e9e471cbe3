"""Checks between options name each option where it was given: a flag typed, a line of --config, the environment.

A contradiction between two options given at the same level (both typed, both in the file) is a usage
error naming them as given; between levels, the command line wins over the file, as it does for one
option (there is no --no-quiet to undo ``quiet = true`` from the command line).
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app

FAST = ["--device", "cpu", "--min-new-tokens", "2", "--max-new-tokens", "4", "--num-beams", "1"]


@pytest.fixture
def book(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(f"A story. {SAMPLE_TEXT}", encoding="utf-8")
    return path


def run_with_config(tmp_path, content: str, *args, model: str | None = None, env: dict | None = None):
    """`unlimisum summarize --config run.toml *args` with ``content`` as the file; returns (result, file)."""
    config = tmp_path / "run.toml"
    config.write_text(content, encoding="utf-8")
    command = ["summarize", "--config", str(config), "-m", model or str(tmp_path / "no-model"), *map(str, args)]
    environment = {"UNLIMISUM_CACHE_DIR": None, "UNLIMISUM_MODEL": None, **(env or {})}
    return CliRunner().invoke(app, command, env=environment), config


@pytest.mark.parametrize("content, args, message", [
    ("quiet = true\nverbose = 1\n", [], "quiet = true and verbose = 1 in {config} contradict each other"),
    ("skip_existing = true\n", [], "skip_existing = true in {config} needs --output-dir"),
    ('cache-max-bytes = "1G"\n', [], 'cache_max_bytes = "1G" in {config} needs --cache-dir (or UNLIMISUM_CACHE_DIR)'),
    ("tc_window = 8\n", [], "tc_window = 8 in {config} needs --tensor-cache or --tc-params"),
    ("workers = 2\n", [], "workers = 2 in {config} needs --engine ray"),
    ('engine = "local"\n', ["--workers", "2"], '--workers needs --engine ray (engine = "local" in {config})'),
    ("min_new_tokens = 300\n", [], "min_new_tokens = 300 in {config} exceeds --max-new-tokens 256 (the default)"),
    ("min_new_tokens = 30\n", ["--max-new-tokens", "20"],
     "min_new_tokens = 30 in {config} exceeds --max-new-tokens 20 on the command line"),
    ("temperature = 0\n", [], "temperature = 0 in {config} must be greater than 0"),
    ('prompt = "Summarize."\n', [], 'prompt = "Summarize." in {config} must contain {{text}} exactly once, '
                                    "where the document goes"),
    ("sample = false\ntemperature = 0.5\n", [], "sample = false contradicts temperature = 0.5 in {config}, "
                                                "which samples"),
    ("retrieval_k = 5\ntopk = 6\n", [], "retrieval_k = 5 and topk = 6 in {config} disagree "
                                        "(--topk is the old name of --retrieval-k)"),
])
def test_a_check_names_each_option_where_it_was_given(tmp_path, book, content, args, message):
    result, config = run_with_config(tmp_path, content, *args, book)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"unlimisum: error: {message.format(config=config)}"]


@pytest.mark.parametrize("args, message", [
    (["-q", "-v"], "--quiet and --verbose contradict each other"),
    (["--skip-existing"], "--skip-existing needs --output-dir"),
    (["--no-sample", "--temperature", "0.5", "--top-k", "3"], "--no-sample contradicts --temperature, --top-k, "
                                                              "which sample"),
    (["--temperature", "0"], "--temperature must be greater than 0, got 0.0"),
])
def test_typed_flags_are_named_as_flags(tmp_path, book, args, message):
    result = CliRunner().invoke(app, ["summarize", "-m", str(tmp_path / "no-model"), *args, str(book)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"unlimisum: error: {message}"]


def test_verbose_on_the_command_line_wins_over_quiet_in_the_file(tmp_path, book, loader, tiny_model_dir):
    result, _ = run_with_config(tmp_path, "quiet = true\n", "-v", *FAST, book, model=str(tiny_model_dir("bart")))
    assert result.exit_code == 0, result.output
    assert "loading model" in result.stderr and result.stdout.strip()


def test_quiet_on_the_command_line_wins_over_verbose_in_the_file(tmp_path, book, loader, tiny_model_dir):
    result, _ = run_with_config(tmp_path, "verbose = 2\n", "-q", *FAST, book, model=str(tiny_model_dir("bart")))
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and result.stdout.strip()


@pytest.mark.parametrize("content, args", [
    ("sample = false\n", ["--temperature", "0.7", "--seed", "1"]),  # the typed sampling option turns sampling on
    ("temperature = 0.7\ntop_k = 5\n", ["--no-sample"]),  # the typed --no-sample: the file's sampling is ignored
    ("topk = 6\n", ["--retrieval-k", "5"]),
])
def test_a_typed_option_wins_over_the_file_it_contradicts(tmp_path, book, loader, tiny_model_dir, content, args):
    out = tmp_path / "out"
    result, _ = run_with_config(tmp_path, content, *args, *FAST, "--json", "-o", out, book,
                                model=str(tiny_model_dir("bart")))
    assert result.exit_code == 0, result.output
    assert (out / "a.txt.summary.json").exists()
