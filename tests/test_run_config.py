"""`summarize --config FILE` and the run manifest OUT/unlimisum-run.json, on the local engine (tiny BART)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app

FAST = ["--device", "cpu", "--min-new-tokens", "3"]


@pytest.fixture
def summarize(loader, tiny_model_dir):
    """``summarize(*args)`` -> click Result of `unlimisum summarize -m <tiny BART> <FAST> *args`, one load per session."""
    model = str(tiny_model_dir("bart"))
    return lambda *args: CliRunner().invoke(app, ["summarize", "-m", model, *FAST, *map(str, args)])


@pytest.fixture
def books(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(f"{name}. {SAMPLE_TEXT}", encoding="utf-8")
    (folder / "empty.txt").write_text("", encoding="utf-8")
    return folder


def manifest(out) -> dict:
    return json.loads((out / "unlimisum-run.json").read_text(encoding="utf-8"))


def test_config_supplies_options_and_command_line_flags_win(summarize, books, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('max_new_tokens = 9\njson = true\nnum-beams = 2\npassword = "secret"\n', encoding="utf-8")
    out = tmp_path / "out"
    result = summarize("--config", config, "--max-new-tokens", "5", books / "a.txt", "-o", out)
    assert result.exit_code == 0, result.output
    assert (out / "a.txt.summary.json").exists()  # json = true came from the file
    record = manifest(out)
    options, sources = record["options"], record["option_sources"]
    assert (options["max_new_tokens"], sources["max_new_tokens"]) == (5, "commandline")
    assert (options["num_beams"], sources["num_beams"]) == (2, "config")
    assert (options["as_json"], sources["as_json"]) == (True, "config")
    assert sources["overlap"] == "default" and record["config_file"] == str(config)
    assert options["password"] == "***" and "secret" not in (out / "unlimisum-run.json").read_text()
    (document,) = record["documents"]
    assert document["status"] == "done" and 3 <= document["generated_tokens"] <= 5


def test_manifest_records_the_values_that_took_effect_where_the_command_line_set_the_files_aside(
        summarize, books, tmp_path):
    """--quiet over verbose = 1, --topk (the old name) over retrieval_k, --no-sample over temperature and
    top_k in the file, a typed --temperature over sample = false: the run used the command line's."""
    config = tmp_path / "run.toml"
    config.write_text("verbose = 1\nretrieval_k = 4\ntemperature = 0.7\ntop_k = 5\n", encoding="utf-8")
    out = tmp_path / "out"
    result = summarize("--config", config, "--quiet", "--topk", "8", "--no-sample", "--max-new-tokens", "5",
                       books / "a.txt", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # quiet, as it took effect
    record = manifest(out)
    used = {name: (record["options"][name], record["option_sources"][name])
            for name in ("quiet", "verbose", "retrieval_k", "sample", "temperature", "top_k", "top_p")}
    assert used == {"quiet": (True, "commandline"), "verbose": (0, "commandline"), "retrieval_k": (8, "commandline"),
                    "sample": (False, "commandline"), "temperature": (None, "commandline"),
                    "top_k": (None, "commandline"), "top_p": (None, "default")}

    config.write_text("sample = false\nquiet = true\n", encoding="utf-8")
    result = summarize("--config", config, "--temperature", "0.5", "-v", "--max-new-tokens", "5", books / "a.txt",
                       "-o", out)
    assert result.exit_code == 0, result.output
    record = manifest(out)
    used = {name: (record["options"][name], record["option_sources"][name])
            for name in ("quiet", "verbose", "sample", "temperature")}
    assert used == {"quiet": (False, "commandline"), "verbose": (1, "commandline"), "sample": (True, "commandline"),
                    "temperature": (0.5, "commandline")}


@pytest.mark.parametrize("content, problem", [
    ("max_new_tokenz = 5\n", "unknown key 'max_new_tokenz'"),
    ('max_new_tokens = "many"\n', "'max_new_tokens' must be an integer, not a string"),
    ("json = 1\n", "'json' must be true or false, not an integer"),
    ("overlap = 1.5\n", "'overlap': 1.5 is not in [0, 1)"),
    ('index = "fancy"\n', "'index':"),
    ("max_new_tokens = 5\nmax_new_tokens = 6\n", "not valid TOML"),
])
def test_a_bad_config_file_is_one_usage_line_naming_the_file_and_key(summarize, books, tmp_path, content, problem):
    config = tmp_path / "run.toml"
    config.write_text(content, encoding="utf-8")
    result = summarize("--config", config, books / "a.txt")
    assert result.exit_code == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"unlimisum: error: {config}: ") and problem in line, line


def test_missing_config_file_is_a_usage_error(summarize, books, tmp_path):
    result = summarize("--config", tmp_path / "nope.toml", books / "a.txt")
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"unlimisum: error: {tmp_path / 'nope.toml'}: no such config file"]


def test_manifest_records_versions_model_and_each_document_then_skips(summarize, books, tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    first = summarize("--max-new-tokens", "5", books, "-o", out)
    assert first.exit_code == 1  # empty.txt
    record = manifest(out)
    assert record["written_by"] == "unlimisum" and record["status"] == "failed" and record["engine"] == "local"
    assert set(record["versions"]) == {"unlimisum", "python", "torch", "transformers", "faiss"}
    assert all(record["versions"].values())
    model = record["model"]
    assert model["name"] == str(tiny_model_dir("bart"))
    assert model["fingerprint"] and model["device"] == "cpu" and model["dtype"] == "float32"
    assert record["started"] <= record["ended"] and record["seconds"] >= 0
    documents = {doc["path"]: doc for doc in record["documents"]}
    assert documents[str(books / "a.txt")]["status"] == "done"
    assert documents[str(books / "a.txt")]["output"] == str(out / "a.txt.summary.md")
    assert set(documents[str(books / "a.txt")]["timings"]) >= {"read", "encode", "generate"}
    assert documents[str(books / "empty.txt")]["status"] == "failed"
    assert documents[str(books / "empty.txt")]["problem"] == "empty file"
    assert record["counts"] == {"total": 3, "done": 2, "failed": 1, "skipped": 0, "not_run": 0}

    (books / "empty.txt").unlink()
    second = summarize("--max-new-tokens", "5", books, "-o", out, "--skip-existing")
    assert second.exit_code == 0, second.output
    again = manifest(out)
    assert again["status"] == "completed" and again["model"] is None  # nothing to summarize: no model loaded
    assert [doc["status"] for doc in again["documents"]] == ["skipped", "skipped"]


def test_interrupted_run_still_writes_its_manifest(summarize, books, tmp_path, monkeypatch):
    from unlimisum.summarizer import Summarizer

    real = Summarizer.summarize

    def interrupt_on_b(self, document, **options):
        if document.source.endswith("b.txt"):
            raise KeyboardInterrupt
        return real(self, document, **options)

    monkeypatch.setattr(Summarizer, "summarize", interrupt_on_b)
    (books / "empty.txt").unlink()
    out = tmp_path / "out"
    result = summarize("--max-new-tokens", "5", books, "-o", out)
    assert result.exit_code == 130
    record = manifest(out)
    assert record["status"] == "interrupted"
    assert [(doc["path"], doc["status"]) for doc in record["documents"]] == [
        (str(books / "a.txt"), "done"), (str(books / "b.txt"), "not run")]
    assert sorted(path.name for path in out.iterdir()) == ["a.txt.summary.md", "unlimisum-run.json"]
