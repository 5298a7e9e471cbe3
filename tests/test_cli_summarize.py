"""`unlimisum summarize` in process (typer's CliRunner) on a tiny random BART.

Tiny random models write gibberish: the tests check structure (what goes where, exit codes,
files, JSON fields), never the words.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from tests.cli_helpers import CachedLoader, write_small_books
from tests.tiny_models import SAMPLE_TEXT
from unlimisum import models
from unlimisum.cli import app

FAST = ["--device", "cpu", "--max-new-tokens", "6", "--min-new-tokens", "3"]
STATS_KEYS = {
    "model", "input_tokens", "windows", "window", "index_kind", "index_device", "retrieval_k", "datastore_bytes",
    "generated_tokens", "timings", "peak_rss_bytes", "peak_gpu_bytes", "tensor_cache_bytes",
}
_LOADER: CachedLoader | None = None


@pytest.fixture
def loader(monkeypatch, request):
    """The real load_model behind a per-session cache; ``loader.calls`` counts the CLI's loads."""
    global _LOADER
    if _LOADER is None:
        _LOADER = CachedLoader(models.load_model)
    monkeypatch.setattr(models, "load_model", _LOADER)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on a shared machine
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("UNLIMISUM_MODEL", raising=False)
    return _LOADER


@pytest.fixture
def summarize(loader, tiny_model_dir):
    """``summarize(*args, input=None)`` -> click Result of `unlimisum summarize -m <tiny> <FAST> *args`."""
    model = str(tiny_model_dir("bart"))
    runner = CliRunner()

    def run(*args, input=None, model_args=("-m", model)):
        return runner.invoke(app, ["summarize", *model_args, *FAST, *map(str, args)], input=input)

    return run


@pytest.fixture
def books(tmp_path):
    return write_small_books(tmp_path / "books")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_text_epub_and_pdf_give_one_json_record_each_with_one_model_load(summarize, books, loader):
    calls = loader.calls
    result = summarize("--json", books["text"], books["epub"], books["pdf"])
    assert result.exit_code == 0, result.output
    records = json_lines(result.stdout)  # stdout holds JSON lines and nothing else
    assert [record["format"] for record in records] == ["text", "epub", "pdf"]
    assert [record["path"] for record in records] == [str(books[kind]) for kind in ("text", "epub", "pdf")]
    for record in records:
        assert record["schema_version"] == 2
        assert isinstance(record["summary"], str) and isinstance(record["title"], str)
        assert record["chapters"] == []
        assert set(record["stats"]) == STATS_KEYS
        stats = record["stats"]
        assert stats["input_tokens"] > 0 and stats["windows"] >= 1 and stats["datastore_bytes"] > 0
        assert stats["index_kind"] == "exact" and stats["index_device"] == "cpu"
        assert set(stats["timings"]) >= {"read", "tokenize", "encode", "index", "generate"}
        assert stats["generated_tokens"] >= 3 and stats["peak_rss_bytes"] > 0 and stats["peak_gpu_bytes"] is None
    assert loader.calls == calls + 1  # one model load for the whole batch


def test_one_document_prints_only_its_summary(summarize, books):
    as_json = summarize("--json", books["text"])
    plain = summarize(books["text"])
    assert as_json.exit_code == 0 and plain.exit_code == 0
    assert plain.stdout == json_lines(as_json.stdout)[0]["summary"] + "\n"


def test_several_documents_in_plain_text_get_a_heading_each(summarize, books, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(SAMPLE_TEXT, encoding="utf-8")
    result = summarize(books["text"], other)
    assert result.exit_code == 0, result.output
    headings = [line for line in result.stdout.splitlines() if line.startswith("# ")]
    assert headings == [f"# The Keeper's Book — {books['text']}", f"# {other}"]


def test_per_chapter_adds_a_summary_per_chapter(summarize, books):
    result = summarize("--json", "--per-chapter", books["epub"])
    assert result.exit_code == 0, result.output
    (record,) = json_lines(result.stdout)
    assert [chapter["title"] for chapter in record["chapters"]] == ["Chapter 1: The Storm", "Chapter 2: The Letter"]
    for chapter in record["chapters"]:
        assert isinstance(chapter["summary"], str) and set(chapter["stats"]) == STATS_KEYS
    plain = summarize("--per-chapter", books["epub"])
    assert plain.stdout.count("\n## ") == 2


def test_standard_input(summarize):
    result = summarize("--json", "-", input=SAMPLE_TEXT)
    assert result.exit_code == 0, result.output
    (record,) = json_lines(result.stdout)
    assert record["path"] == "-" and record["stats"]["input_tokens"] > 0


def test_directory_with_a_bad_file_summarizes_the_rest_and_exits_1(summarize, tmp_path):
    folder = tmp_path / "shelf"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    (folder / "sub" / "b.md").write_text(SAMPLE_TEXT, encoding="utf-8")
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4\n this is not a PDF body")
    (folder / "sub" / "empty.txt").write_text("   \n", encoding="utf-8")
    out = tmp_path / "out"
    result = summarize(folder, "-o", out)
    assert result.exit_code == 1
    assert (out / "a.summary.md").is_file() and (out / "sub" / "b.summary.md").is_file()  # subfolders mirrored
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "a.summary.md", "sub/b.summary.md"
    ]
    assert result.stdout == ""  # with -o nothing goes to stdout
    assert "2 of 4 inputs failed" in result.stderr
    assert f"{folder / 'broken.pdf'}:" in result.stderr and f"{folder / 'sub' / 'empty.txt'}:" in result.stderr


def test_output_dir_then_skip_existing_resumes_without_loading_the_model(summarize, books, tmp_path, loader):
    out = tmp_path / "out"
    first = summarize("--json", "-o", out, books["text"], books["epub"])
    assert first.exit_code == 0, first.output
    # story.txt and story.epub share a stem: both keep their suffix in the output name
    names = sorted(p.name for p in out.iterdir())
    assert names == ["small.epub.summary.json", "small.txt.summary.json"]
    record = json.loads((out / "small.txt.summary.json").read_text())
    assert record["format"] == "text" and set(record["stats"]) == STATS_KEYS
    (out / "small.txt.summary.json").write_text("kept", encoding="utf-8")
    (out / "small.epub.summary.json").unlink()
    calls = loader.calls
    again = summarize("--json", "-o", out, "--skip-existing", books["text"], books["epub"])
    assert again.exit_code == 0, again.output
    assert (out / "small.txt.summary.json").read_text() == "kept"
    assert json.loads((out / "small.epub.summary.json").read_text())["format"] == "epub"
    assert "skipped" in again.stderr
    assert loader.calls == calls + 1
    done = summarize("--json", "-o", out, "--skip-existing", books["text"], books["epub"])
    assert done.exit_code == 0 and loader.calls == calls + 1  # nothing to do: no model load at all


def test_same_seed_same_sampled_summary(summarize, books):
    runs = [summarize("--json", "--sample", "--temperature", "1.5", "--seed", "7", books["text"]) for _ in range(2)]
    assert all(run.exit_code == 0 for run in runs)
    first, second = (json_lines(run.stdout)[0] for run in runs)
    assert first["summary"] == second["summary"]
    assert first["stats"]["generated_tokens"] == second["stats"]["generated_tokens"]


def test_quiet_leaves_stderr_empty(summarize, books):
    loud = summarize(books["text"])
    quiet = summarize("-q", books["text"])
    assert loud.exit_code == quiet.exit_code == 0
    assert "done" in loud.stderr  # not a terminal: no live display, but one line per document
    assert quiet.stderr == ""
    assert quiet.stdout == loud.stdout


def test_a_file_named_like_an_option_after_double_dash(summarize, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    odd = tmp_path / "-rf book.txt"
    odd.write_text(SAMPLE_TEXT, encoding="utf-8")
    result = summarize("--json", "--", "-rf book.txt")
    assert result.exit_code == 0, result.output
    assert json_lines(result.stdout)[0]["path"] == "-rf book.txt"
    assert odd.read_text(encoding="utf-8") == SAMPLE_TEXT


def test_refuses_to_write_over_an_input(summarize, tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(book, out / "book.summary.md")  # the output path resolves to the input
    result = summarize("-o", out, book)
    assert result.exit_code == 1
    assert "that is an input file" in result.stderr
    assert book.read_text(encoding="utf-8") == SAMPLE_TEXT


def test_an_unexpected_error_in_one_document_does_not_stop_the_batch(summarize, tmp_path, monkeypatch):
    from unlimisum.summarizer import Summarizer

    real = Summarizer.summarize

    def flaky(self, document, **options):
        if document.source.endswith("bad.txt"):
            raise RuntimeError("simulated failure\nwith two lines")
        return real(self, document, **options)

    monkeypatch.setattr(Summarizer, "summarize", flaky)
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    for path in (bad, good):
        path.write_text(SAMPLE_TEXT, encoding="utf-8")
    result = summarize("--json", bad, good)
    assert result.exit_code == 1
    records = json_lines(result.stdout)
    assert records[0]["error_type"] == "RuntimeError" and "summary" in records[1]
    assert "unexpected RuntimeError: simulated failure with two lines" in result.stderr


def test_missing_model_is_one_line_and_exit_1(summarize, books):
    result = summarize(books["text"], model_args=("-m", "no-such-org/no-such-model"))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("unlimisum: error: model 'no-such-org/no-such-model' is not available")
    assert "`hf download no-such-org/no-such-model`" in lines[-1] and "huggingface-cli" not in lines[-1]


def test_model_from_environment(summarize, books, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_MODEL", str(tiny_model_dir("bart")))
    result = summarize("--json", books["text"], model_args=())
    assert result.exit_code == 0, result.output
    assert json_lines(result.stdout)[0]["stats"]["model"] == str(tiny_model_dir("bart"))


@pytest.mark.parametrize(
    "args",
    [
        [],  # no PATH
        ["--index", "kd-tree", "x.txt"],
        ["--index-device", "tpu", "x.txt"],
        ["--overlap", "1.0", "x.txt"],
        ["--topk", "0", "x.txt"],
        ["--device", "gpu0", "x.txt"],
        ["--dtype", "int8", "x.txt"],
        ["--skip-existing", "x.txt"],
        ["--min-new-tokens", "10", "x.txt"],  # above --max-new-tokens 6
        ["-", "-"],
        ["-q", "-v", "x.txt"],
        ["--no-such-option", "x.txt"],
        ["--temperature", "0", "x.txt"],
        ["--repetition-penalty", "0", "x.txt"],
        ["--top-p", "0", "x.txt"],
        ["--storage-dtype", "int8", "x.txt"],
        ["--tc-window", "4", "x.txt"],
    ],
)
def test_usage_errors_exit_2_before_loading_the_model(summarize, args, loader):
    calls = loader.calls
    result = summarize(*args)
    assert result.exit_code == 2, result.output
    assert loader.calls == calls


def test_max_new_tokens_beyond_the_decoders_positions_is_a_usage_error(summarize, books):
    result = summarize("--max-new-tokens", "500", books["text"])  # the tiny BART has 64 positions
    assert result.exit_code == 2
    assert "exceeds the 64 positions" in result.stderr
