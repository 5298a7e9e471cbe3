"""`unlimisum train`: end to end on a tiny model, one-line errors and exit codes, the missing extra."""

from __future__ import annotations

import json
import shlex
import subprocess

from typer.testing import CliRunner

from tests.test_cli_process import console_script, process_env
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app


def _data(folder):
    path = folder / "train.jsonl"
    rows = [{"text": SAMPLE_TEXT * 2, "summary": "the keeper counted ships"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _invoke(*args):
    return CliRunner().invoke(app, ["train", *map(str, args)])


def test_train_then_summarize_with_the_result(tiny_model_dir, tmp_path):
    data, out = _data(tmp_path), tmp_path / "trained"
    result = _invoke(data, "-m", tiny_model_dir("bart"), "-o", out, "--method", "retrieval", "--max-steps", "2",
                     "--logging-steps", "1", "--save-steps", "2", "--validation", data, "--eval-max-new-tokens", "4",
                     "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # progress and the closing lines go to stderr
    assert "unlimisum: step 1/2  loss " in result.stderr
    assert "validation of the kept model: rouge1" in result.stderr
    assert f"unlimisum summarize -m {out} BOOK" in result.stderr
    assert json.loads((out / "unlimisum-train.json").read_text())["method"] == "retrieval"
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT * 3)
    # the command train printed runs as printed (BOOK aside), though the tiny decoder has fewer positions (64)
    # than --max-new-tokens' default: the default is capped to them
    (printed,) = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("unlimisum summarize")]
    command = [*console_script(), *shlex.split(printed)[1:-1], str(book), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=process_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert stats["windows"] > 1 and stats["generated_tokens"] <= 64


def test_bad_data_is_one_line_and_exit_1(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "t"}) + "\n")
    result = _invoke(data, "-m", tiny_model_dir("bart"), "-o", tmp_path / "out", "--method", "chunked")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [f"unlimisum: error: {data}: no column 'summary' (columns: text); name the right one with "
                      "--summary-field"]
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_2(tiny_model_dir, tmp_path):
    data = _data(tmp_path)
    base = [data, "-m", tiny_model_dir("bart"), "-o", tmp_path / "out"]
    for extra, message in (
        (["--method", "sideways"], "unknown training method 'sideways'"),
        (["--method", "retrieval", "--validation", data, "--validation-fraction", "0.5"], "not both"),
        (["--method", "retrieval", "--learning-rate", "0"], "learning rate must be positive"),
        (["--method", "retrieval", "--precision", "float16", "--device", "cpu"], "needs a GPU"),
    ):
        result = _invoke(*base, *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.stderr
    assert _invoke(data, "--method", "retrieval").exit_code == 2  # -m and -o are required


def test_without_the_extra_one_line_names_it(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    result = _invoke(_data(tmp_path), "-m", "m", "-o", tmp_path / "out", "--method", "retrieval")
    assert result.exit_code == 1
    assert result.stderr.strip() == ('unlimisum: error: training needs datasets: pip install "unlimisum[train]" '
                                     '(in a clone of unlimisum: pip install -e ".[train]")')


def test_help_lists_every_option_whole_at_80_and_40_columns():
    """The checks every command's help passes (tests/test_cli_help.py), for `train` and the root help listing it."""
    from tests.test_cli_help import test_dash_h_is_help_everywhere, test_help_shows_every_option_name_whole

    for columns in (80, 40):
        test_help_shows_every_option_name_whole(["train"], columns)
        test_help_shows_every_option_name_whole([], columns)
    test_dash_h_is_help_everywhere(["train"])
    root = CliRunner().invoke(app, ["--help"]).stdout
    assert "train" in root and "Fine-tune" in root


def test_an_unexpected_error_is_one_line_without_traceback(tiny_model_dir, tmp_path, monkeypatch):
    import unlimisum.training.run as run

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure\nwith two lines")

    monkeypatch.setattr(run, "train", broken)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b c", "summary": "a"}\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(data), "-m", str(tiny_model_dir("bart")), "-o",
                                      str(tmp_path / "out"), "--method", "truncated", "--max-steps", "1"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("unlimisum: error: training stopped: unexpected RuntimeError: simulated failure with two "
                         "lines (-vv shows the traceback)") and "Traceback" not in result.stderr
