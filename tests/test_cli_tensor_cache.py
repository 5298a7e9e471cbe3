"""`summarize --tensor-cache [--tc-params FILE] [--tc-window W]` and `tc fit`: bounded decoder memory from the command line."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.test_cli_process import process_env
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app

FAST = ["--device", "cpu", "--max-new-tokens", "12", "--min-new-tokens", "12", "--json"]


@pytest.fixture
def book(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(SAMPLE_TEXT * 2)
    return path


@pytest.fixture
def run(tiny_model_dir, book):
    def invoke(*args):
        return CliRunner().invoke(app, ["summarize", "-m", str(tiny_model_dir("t5")), *FAST, *map(str, args), str(book)])

    return invoke


@pytest.fixture(scope="module")
def fitted(tiny_model_dir, tmp_path_factory):
    """A Tensor Cache parameter file fitted on the tiny T5, saved without the .safetensors suffix, and fit's output."""
    folder = tmp_path_factory.mktemp("fit")
    text = folder / "fit text.txt"
    text.write_text(SAMPLE_TEXT * 4)
    params = folder / "tc.params"
    result = CliRunner().invoke(app, [
        "tc", "fit", "--model", str(tiny_model_dir("t5")), "--text", str(text), "--window", "4", "--context", "24",
        "--steps", "2", "--batch-size", "2", "--encoder-tokens", "12", "--device", "cpu", "--out", str(params),
    ])
    assert result.exit_code == 0, result.output
    return params, result


def test_without_parameters_the_gate_is_closed_and_the_cli_says_so(run):
    result = run("--tensor-cache", "--tc-window", "4")
    assert result.exit_code == 0, result.output
    assert "gate closed" in result.stderr and "last 4 tokens" in result.stderr
    stats = json.loads(result.stdout)["stats"]
    assert stats["tensor_cache_bytes"] > 0


def test_tensor_cache_is_a_flag_and_the_next_argument_stays_an_input(tiny_model_dir, book):
    result = CliRunner().invoke(app, ["summarize", "-m", str(tiny_model_dir("t5")), *FAST, "--tc-window", "4",
                                      "--tensor-cache", str(book)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == str(book)


def test_a_window_covering_the_summary_changes_nothing_and_says_so_once(run):
    plain = json.loads(run().stdout)
    bounded = run("--tensor-cache", "--tc-window", "64")
    assert json.loads(bounded.stdout)["summary"] == plain["summary"]
    assert plain["stats"]["tensor_cache_bytes"] is None
    notes = [line for line in bounded.stderr.splitlines() if line.startswith("unlimisum: note:")]
    assert len(notes) == 1 and "changes nothing" in notes[0] and "gate closed" not in bounded.stderr


def test_a_fitted_file_with_any_suffix_is_used_through_tc_params(run, fitted):
    params, _ = fitted
    result = run("--tc-params", params)  # implies --tensor-cache; the window is the file's (4)
    assert result.exit_code == 0, result.output
    assert str(params) in result.stderr and "gate closed" not in result.stderr
    assert json.loads(result.stdout)["stats"]["tensor_cache_bytes"] > 0


def test_the_command_tc_fit_prints_works_exactly_as_printed(fitted, tmp_path):
    params, result = fitted
    (command,) = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("unlimisum summarize")]
    assert shlex.split(command)[0] == "unlimisum" and str(params) in shlex.split(command)
    env = dict(process_env(), PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    done = subprocess.run(command, shell=True, capture_output=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.strip() and "L2 memory" in done.stderr.decode()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"just some text, not parameters", "not a Tensor Cache parameter file"),
        ("safetensors without our metadata", "not a Tensor Cache parameter file"),
        (None, "parameter file not found"),
    ],
)
def test_a_parameter_file_that_is_not_one_is_a_usage_error(run, tmp_path, content, message):
    params = tmp_path / "tc.safetensors"  # the right suffix does not make it one
    if isinstance(content, bytes):
        params.write_bytes(content)
    elif content is not None:
        from safetensors.torch import save_file

        save_file({"decay_logit": torch.zeros(1, 1)}, str(params))
    result = run("--tc-params", params)
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("unlimisum: error: ") and message in line


def test_tc_window_needs_the_tensor_cache(run):
    result = run("--tc-window", "4")
    assert result.exit_code == 2
    assert "--tc-window needs --tensor-cache" in result.stderr
