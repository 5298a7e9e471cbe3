"""`summarize --tensor-cache [FILE] --tc-window W`: bounded decoder memory from the command line."""

import json

import pytest
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.cli.app import expand_optional_values

FAST = ["--device", "cpu", "--max-new-tokens", "12", "--min-new-tokens", "12", "--json"]


@pytest.mark.parametrize(
    "given, expected",
    [
        (["a.txt", "--tensor-cache"], ["a.txt", "--tensor-cache="]),
        (["--tensor-cache", "a.txt"], ["--tensor-cache=", "a.txt"]),
        (["--tensor-cache", "tc.safetensors", "a.txt"], ["--tensor-cache=tc.safetensors", "a.txt"]),
        (["--tensor-cache", "--tc-window", "4"], ["--tensor-cache=", "--tc-window", "4"]),
        (["--tensor-cache=x.safetensors"], ["--tensor-cache=x.safetensors"]),
        (["--", "--tensor-cache"], ["--", "--tensor-cache"]),
    ],
)
def test_tensor_cache_takes_an_optional_file(given, expected):
    assert expand_optional_values(given) == expected


@pytest.fixture
def run(tiny_model_dir, tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT * 2)

    def invoke(*args):
        arguments = ["summarize", "-m", str(tiny_model_dir("t5")), *FAST, str(book), *args]
        return CliRunner().invoke(app, expand_optional_values(arguments))

    return invoke


def test_without_a_file_the_gate_is_closed_and_the_cli_says_so(run):
    result = run("--tensor-cache", "--tc-window", "4")
    assert result.exit_code == 0, result.output
    assert "gate closed" in result.stderr and "last 4 tokens" in result.stderr
    stats = json.loads(result.stdout)["stats"]
    assert stats["tensor_cache_bytes"] > 0


def test_a_window_covering_the_summary_gives_the_plain_summary(run):
    plain = json.loads(run().stdout)
    bounded = json.loads(run("--tensor-cache", "--tc-window", "64").stdout)
    assert bounded["summary"] == plain["summary"]
    assert plain["stats"]["tensor_cache_bytes"] is None


def test_a_fitted_file_is_used(run, tiny_model_dir, tmp_path):
    text = tmp_path / "fit.txt"
    text.write_text(SAMPLE_TEXT * 4)
    params = tmp_path / "tc.safetensors"
    fitted = CliRunner().invoke(app, [
        "tc", "fit", "--model", str(tiny_model_dir("t5")), "--text", str(text), "--window", "4", "--context", "24",
        "--steps", "2", "--batch-size", "2", "--encoder-tokens", "12", "--device", "cpu", "--out", str(params),
    ])
    assert fitted.exit_code == 0, fitted.output
    result = run("--tensor-cache", str(params))
    assert result.exit_code == 0, result.output
    assert str(params) in result.stderr and "gate closed" not in result.stderr
    assert json.loads(result.stdout)["stats"]["tensor_cache_bytes"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tc-window", "4"], "--tc-window needs --tensor-cache"),
        (["--tensor-cache", "missing.safetensors"], "parameter file not found"),
    ],
)
def test_bad_tensor_cache_options_are_usage_errors(run, args, message):
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.stderr
