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

from tests.cli_helpers import write_small_books
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.visible import markdown_line

FAST = ["--device", "cpu", "--max-new-tokens", "6", "--min-new-tokens", "3"]
STATS_KEYS = {
    "model", "input_tokens", "windows", "window", "index_kind", "index_device", "retrieval_k", "datastore_bytes",
    "generated_tokens", "timings", "peak_rss_bytes", "peak_gpu_bytes", "tensor_cache_bytes", "cached", "model_dtype",
    "positions", "packed_bytes", "key_store", "key_store_bytes", "key_store_values",
}


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
        assert record["schema_version"] == 3
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
    # stdout is not a terminal here: Markdown, its text escaped for a renderer (the paths' underscores)
    expected = [f"The Keeper's Book — {books['text']}", f"other.txt — {other}"]
    assert headings == [f"# {markdown_line(heading)}" for heading in expected]


def test_json_title_is_the_title_of_the_markdown_heading(summarize, books, tmp_path):
    other = tmp_path / "other.txt"  # no title of its own: both show the file name
    other.write_text(SAMPLE_TEXT, encoding="utf-8")
    records = json_lines(summarize("--json", books["text"], other).stdout)
    headings = [line for line in summarize(books["text"], other).stdout.splitlines() if line.startswith("# ")]
    assert [record["title"] for record in records] == ["The Keeper's Book", "other.txt"]
    assert [heading.removeprefix("# ").split(" — ")[0] for heading in headings] == ["The Keeper's Book", "other.txt"]


def test_done_line_counts_summary_tokens_as_the_json_stats_do(summarize, books):
    result = summarize("--json", books["text"])
    assert result.exit_code == 0, result.output
    generated = json_lines(result.stdout)[0]["stats"]["generated_tokens"]
    (done,) = [line for line in result.stderr.splitlines() if line.startswith("done ")]
    assert f" {generated:,} summary tokens" in done and "tokens generated" not in done


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
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "a.txt.summary.md", "sub/b.md.summary.md", "unlimisum-run.json"  # subfolders mirrored; the run manifest
    ]
    assert result.stdout == ""  # with -o nothing goes to stdout
    assert "2 of 4 inputs failed" in result.stderr
    assert f"{folder / 'broken.pdf'}:" in result.stderr and f"{folder / 'sub' / 'empty.txt'}:" in result.stderr


def test_with_output_dir_no_failure_goes_to_stdout_either(summarize, books, tmp_path):
    """--json -o DIR: every record is a file's, a failure's too, whether found before reading or while reading."""
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\n this is not a PDF body")
    result = summarize("--json", "-o", tmp_path / "out", books["text"], tmp_path / "missing.txt", broken)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert f"{tmp_path / 'missing.txt'}: no such file" in result.stderr and f"{broken}:" in result.stderr


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_an_output_dir_that_cannot_be_written_is_a_usage_error_before_the_model_loads(summarize, books, tmp_path,
                                                                                      loader, where):
    if where == "under a file":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "sub"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        out = tmp_path / "locked"
        out.mkdir(mode=0o555)
    calls = loader.calls
    result = summarize("-o", out, books["text"], books["epub"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith(f"unlimisum: error: cannot write summaries to --output-dir {out}: ")
    assert loader.calls == calls  # nothing loaded, nothing summarized in vain


def test_encode_int8_loads_float32_weights_where_auto_would_choose_16_bits(summarize, books, monkeypatch):
    """--dtype auto picks bfloat16 on a CPU with 16-bit units, whose weights int8 cannot quantize: with
    --encode-int8 it loads float32 and the book is summarized (each input failed after loading before)."""
    monkeypatch.setenv("UNLIMISUM_CPU_BFLOAT16", "1")  # as on a CPU where bfloat16 measured faster
    result = summarize("--encode-int8", "--json", books["text"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["input_tokens"] > 0


def test_output_dir_then_skip_existing_resumes_without_loading_the_model(summarize, books, tmp_path, loader):
    out = tmp_path / "out"
    first = summarize("--json", "-o", out, books["text"], books["epub"])
    assert first.exit_code == 0, first.output
    names = sorted(p.name for p in out.iterdir())
    assert names == ["small.epub.summary.json", "small.txt.summary.json", "unlimisum-run.json"]
    kept = out / "small.txt.summary.json"
    record = json.loads(kept.read_text())
    assert record["format"] == "text" and set(record["stats"]) == STATS_KEYS and record["written_by"] == "unlimisum"
    kept_text, kept_mtime = kept.read_text(), kept.stat().st_mtime_ns
    (out / "small.epub.summary.json").unlink()
    calls = loader.calls
    again = summarize("--json", "-o", out, "--skip-existing", books["text"], books["epub"])
    assert again.exit_code == 0, again.output
    assert kept.read_text() == kept_text and kept.stat().st_mtime_ns == kept_mtime
    assert json.loads((out / "small.epub.summary.json").read_text())["format"] == "epub"
    assert "skipped" in again.stderr
    assert loader.calls == calls + 1
    done = summarize("--json", "-o", out, "--skip-existing", books["text"], books["epub"])
    assert done.exit_code == 0 and loader.calls == calls + 1  # nothing to do: no model load at all


# -- inputs are checked before the model loads -------------------------------------------------


def test_a_missing_input_is_reported_without_loading_the_model(summarize, tmp_path, loader, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = loader.calls
    result = summarize("missing.txt", model_args=("-m", "no-such-org/no-such-model"))
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["unlimisum: error: missing.txt: no such file or directory"]
    assert loader.calls == calls


def test_bad_inputs_are_reported_before_the_model_loads_and_the_rest_is_summarized(summarize, tmp_path, loader):
    good = tmp_path / "good.txt"
    good.write_text(SAMPLE_TEXT, encoding="utf-8")
    photo = tmp_path / "photo.txt"
    photo.write_bytes(b"\xff\xd8\xff\xe0" + bytes(200))  # a JPEG with a text suffix
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n", encoding="utf-8")
    missing = tmp_path / "missing.txt"
    calls = loader.calls
    result = summarize("-v", "--json", missing, photo, good, blank)
    assert result.exit_code == 1
    assert loader.calls == calls + 1
    lines = result.stderr.splitlines()
    loading = next(number for number, line in enumerate(lines) if "loading model" in line)
    for bad, problem in ((missing, "no such file"), (photo, "JPEG image"), (blank, "only whitespace")):
        (number,) = [n for n, line in enumerate(lines) if line.startswith(f"unlimisum: error: {bad}:")]
        assert problem in lines[number] and number < loading
    records = json_lines(result.stdout)
    assert [record["path"] for record in records if "summary" in record] == [str(good)]
    assert sorted(record["path"] for record in records if "error" in record) == sorted(map(str, (missing, photo, blank)))
    assert "3 of 4 inputs failed" in result.stderr


def test_contents_that_cannot_be_read_are_found_before_the_model_is_touched(summarize, tmp_path, loader):
    """Random bytes named .txt pass every check a file name allows; they are found by reading, and reading
    comes first: with nothing else usable, the model (here a missing folder) is never touched."""
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(range(256)) * 40)
    calls = loader.calls
    result = summarize(noise, model_args=("-m", str(tmp_path / "no-such-model")))
    assert result.exit_code == 1 and loader.calls == calls
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"unlimisum: error: {noise}:") and "model" not in line


def test_every_input_is_read_before_the_model_loads_and_read_once(summarize, tmp_path, loader, monkeypatch):
    from unlimisum import ingest

    good, later = tmp_path / "good.txt", tmp_path / "later.txt"
    good.write_text(SAMPLE_TEXT, encoding="utf-8")
    later.write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 8)  # damaged, found only by reading it
    reads = []
    real = ingest.read_document
    monkeypatch.setattr(ingest, "read_document", lambda path, **options: reads.append(str(path)) or real(path, **options))
    result = summarize("-v", good, later)
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    loading = next(number for number, line in enumerate(lines) if "loading model" in line)
    (failed,) = [number for number, line in enumerate(lines) if line.startswith(f"unlimisum: error: {later}:")]
    assert failed < loading and "done " in result.stderr
    assert reads == [str(good), str(later)]  # the good one is not read a second time


def test_a_tensor_cache_file_given_as_a_book_is_refused_before_the_model_loads(summarize, tmp_path, loader):
    from safetensors.torch import save_file

    params = tmp_path / "tc.params"
    save_file({"x": torch.zeros(2)}, str(params))
    calls = loader.calls
    result = summarize("--tensor-cache", params)
    assert result.exit_code == 1 and loader.calls == calls
    assert "safetensors" in result.stderr and "--tc-params" in result.stderr


# -- output names: a function of the input path alone ------------------------------------------


def test_output_names_do_not_depend_on_the_rest_of_the_batch(summarize, books, tmp_path):
    collection, out = tmp_path / "coll", tmp_path / "X"
    collection.mkdir()
    (collection / "story.txt").write_text(books["text"].read_text(encoding="utf-8"), encoding="utf-8")
    first = summarize(collection, "-o", out)
    assert first.exit_code == 0, first.output
    written = out / "story.txt.summary.md"
    text, mtime = written.read_text(encoding="utf-8"), written.stat().st_mtime_ns
    (collection / "story.pdf").write_bytes(books["pdf"].read_bytes())
    second = summarize(collection, "-o", out, "--skip-existing")
    assert second.exit_code == 0, second.output
    assert sorted(path.name for path in out.iterdir()) == ["story.pdf.summary.md", "story.txt.summary.md", "unlimisum-run.json"]
    assert written.read_text(encoding="utf-8") == text and written.stat().st_mtime_ns == mtime  # skipped, not redone
    assert "skipped" in second.stderr and second.stderr.count("done ") == 1


def test_two_inputs_with_the_same_output_are_a_usage_error_before_any_work(summarize, tmp_path, loader):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    calls = loader.calls
    result = summarize(tmp_path / "a", tmp_path / "b", "-o", tmp_path / "out")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("unlimisum: error: ")
    assert str(tmp_path / "a" / "x.txt") in line and str(tmp_path / "b" / "x.txt") in line
    assert loader.calls == calls and not (tmp_path / "out").exists()


# -- only unlimisum's own files are skipped or overwritten ---------------------------------------


def test_folder_scans_skip_only_summaries_unlimisum_wrote(summarize, tmp_path, loader):
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (shelf / "k.md").write_text(SAMPLE_TEXT, encoding="utf-8")
    mine = shelf / "k.summary.md"  # the user's own notes, named like an old unlimisum output
    mine.write_text("# My notes\n\n" + SAMPLE_TEXT, encoding="utf-8")
    first = summarize(shelf, "-o", shelf)
    assert first.exit_code == 0, first.output
    assert mine.read_text(encoding="utf-8").startswith("# My notes")  # never overwritten
    assert sorted(path.name for path in shelf.iterdir()) == [
        "k.md", "k.md.summary.md", "k.summary.md", "k.summary.md.summary.md", "unlimisum-run.json"  # the user's file was an input too
    ]
    assert (shelf / "k.md.summary.md").read_text(encoding="utf-8").startswith("<!-- written by unlimisum -->\n")
    calls = loader.calls
    again = summarize(shelf, "-o", shelf, "--skip-existing")
    assert again.exit_code == 0, again.output
    assert "not reading 2 summaries that unlimisum wrote" in again.stderr
    assert again.stderr.count("skipped") == 2 and loader.calls == calls


@pytest.mark.parametrize("as_json", [False, True])
def test_a_file_unlimisum_did_not_write_is_never_overwritten(summarize, tmp_path, loader, as_json):
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    theirs = out / ("book.txt.summary.json" if as_json else "book.txt.summary.md")
    theirs.write_text('{"mine": true}\n' if as_json else "mine\n", encoding="utf-8")
    calls = loader.calls
    for extra in ([], ["--skip-existing"]):
        result = summarize(*(["--json"] if as_json else []), *extra, "-o", out, book)
        assert result.exit_code == 1
        assert result.stderr.strip().splitlines() == [
            f"unlimisum: error: {book}: refusing to overwrite {theirs}: unlimisum did not write it "
            "(move it, or choose another --output-dir)"
        ]
    assert theirs.read_text(encoding="utf-8") == ('{"mine": true}\n' if as_json else "mine\n")
    assert loader.calls == calls


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
    os.symlink(book, out / "book.txt.summary.md")  # the output path resolves to the input
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
        ["--top-k", "0", "x.txt"],
        ["--topk", "3", "--retrieval-k", "4", "x.txt"],
        ["--tc-params", "missing.safetensors", "x.txt"],
        ["--encode-int8", "--dtype", "bfloat16", "x.txt"],  # int8 copies are made of float32 weights
    ],
)
def test_usage_errors_exit_2_before_loading_the_model(summarize, args, loader):
    calls = loader.calls
    result = summarize(*args)
    assert result.exit_code == 2, result.output
    assert loader.calls == calls
    (line,) = result.stderr.strip().splitlines()  # one plain line, whoever found the error
    assert line.startswith("unlimisum: error: ") and "╭" not in line


def test_max_new_tokens_beyond_the_decoders_positions_is_a_usage_error(summarize, books):
    result = summarize("--max-new-tokens", "500", books["text"])  # the tiny BART has 64 positions
    assert result.exit_code == 2
    assert "exceeds the 64 positions" in result.stderr


# -- sampling's --top-k and retrieval's --retrieval-k ---------------------------------------------


def test_top_k_samples_and_retrieval_k_keeps_its_old_alias(summarize, books):
    greedy = json_lines(summarize("--json", books["text"]).stdout)[0]["summary"]
    one = summarize("--json", "--top-k", "1", "--seed", "3", books["text"])
    assert one.exit_code == 0, one.output
    assert json_lines(one.stdout)[0]["summary"] == greedy  # sampling from the single most likely token
    implied, explicit = (
        json_lines(summarize("--json", *extra, "--top-k", "50", "--seed", "3", books["text"]).stdout)[0]["summary"]
        for extra in ([], ["--sample"])
    )
    assert implied == explicit != greedy  # --top-k turns sampling on, as --sample does
    old, new = (json_lines(summarize("--json", option, "8", books["text"]).stdout)[0] for option in ("--topk", "--retrieval-k"))
    assert old["stats"]["retrieval_k"] == new["stats"]["retrieval_k"] == 8 and old["summary"] == new["summary"]


def test_keep_all_reaches_the_epub_reader_and_v_lists_what_was_left_out(summarize, tmp_path):
    from tests.test_ingest_epub import matter_book

    book = matter_book(tmp_path)
    plain = summarize("--json", "-v", book)
    assert plain.exit_code == 0, plain.output
    assert "left out of" in plain.stderr and "copyright page (front.xhtml)" in plain.stderr
    kept = summarize("--json", "--keep-all", book)
    assert kept.exit_code == 0, kept.output
    assert json_lines(kept.stdout)[0]["stats"]["input_tokens"] > json_lines(plain.stdout)[0]["stats"]["input_tokens"]


def test_cache_dir_second_run_reads_the_encoded_book_and_cache_commands(summarize, books, tmp_path, monkeypatch):
    cache = tmp_path / "encoded"
    first = summarize("--json", "--cache-dir", cache, books["text"])
    assert first.exit_code == 0, first.output
    assert json_lines(first.stdout)[0]["stats"]["cached"] is False
    monkeypatch.setenv("UNLIMISUM_CACHE_DIR", str(cache))
    second = summarize("--json", "--max-new-tokens", "4", books["text"])
    assert second.exit_code == 0, second.output
    record = json_lines(second.stdout)[0]
    assert record["stats"]["cached"] is True and "cache_load" in record["stats"]["timings"]
    listed = CliRunner().invoke(app, ["cache", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    (entry,) = json_lines(listed.stdout)
    assert entry["n_tokens"] == record["stats"]["input_tokens"] and entry["source"] == str(books["text"])
    kept = CliRunner().invoke(app, ["cache", "clear", "--older-than", "30d"])
    assert kept.exit_code == 0 and "removed 0" in kept.stderr
    cleared = CliRunner().invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 encoded book" in cleared.stderr
    assert json_lines(CliRunner().invoke(app, ["cache", "list", "--json"]).stdout) == []


def test_cache_clear_kernels_needs_no_cache_folder_and_leaves_other_programs_files(monkeypatch, tmp_path):
    monkeypatch.delenv("UNLIMISUM_CACHE_DIR", raising=False)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "kernels" / "compiled_0f"
    folder.mkdir(parents=True)
    (folder / "compiled._dense_sums_f32-675.py311.nbi").write_bytes(b"index")
    (folder / "compiled._dense_sums_f32-675.py311.1.nbc").write_bytes(b"code")
    (folder / "compiled_loops._scores_bf16-180.py311.nbi").write_bytes(b"loop")
    (folder / "mine.solver-12.py311.nbi").write_bytes(b"another program's")
    cleared = CliRunner().invoke(app, ["cache", "clear", "--kernels"])
    assert cleared.exit_code == 0 and "removed 3 compiled kernel files, 13 B" in cleared.stderr
    assert [path.name for path in folder.iterdir()] == ["mine.solver-12.py311.nbi"]
    assert CliRunner().invoke(app, ["cache", "clear"]).exit_code == 2  # books need their folder, as before


def test_cache_list_counts_and_prune_removes_the_kernels_of_other_versions_only(monkeypatch, tmp_path):
    """Each version of the kernels' code compiles into a folder of its own: after an upgrade the old ones are
    listed with their size and pruned (also those kept before the folders per version), never this version's or
    another program's files."""
    from unlimisum.measurements import kernel_code_folder

    monkeypatch.delenv("UNLIMISUM_CACHE_DIR", raising=False)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))
    current = kernel_code_folder() / "search_1a"
    older = tmp_path / "kernels" / "code-0123456789abcdef" / "search_1a"
    before_folders = tmp_path / "kernels" / "search_2b"
    for folder in (current, older, before_folders):
        folder.mkdir(parents=True)
    (current / "compiled_loops._scan-180.py311.nbi").write_bytes(b"this version")
    (older / "top_k_loops._top_k_rows-228.py311.nbi").write_bytes(b"index")
    (older / "top_k_loops._top_k_rows-228.py311.1.nbc").write_bytes(b"code")
    (before_folders / "compiled._sums_f32-630.py311.nbi").write_bytes(b"older")
    (before_folders / "mine.solver-12.py311.nbi").write_bytes(b"another program's")
    books = tmp_path / "books"
    books.mkdir()
    listed = CliRunner().invoke(app, ["cache", "list", "--cache-dir", str(books)])
    assert listed.exit_code == 0, listed.output
    assert "compiled retrieval kernels: 4 files" in listed.stderr
    assert ("3 of them, 14 B, compiled from another version of unlimisum: `unlimisum cache prune` removes those"
            in listed.stderr)
    pruned = CliRunner().invoke(app, ["cache", "prune"])  # no cache folder: the kernels alone
    assert pruned.exit_code == 0, pruned.output
    assert "removed 3 compiled kernel files of other versions, 14 B" in pruned.stderr
    assert "encoded books left as they are" in pruned.stderr
    assert [path.name for path in current.iterdir()] == ["compiled_loops._scan-180.py311.nbi"]
    assert [path.name for path in before_folders.iterdir()] == ["mine.solver-12.py311.nbi"]
    assert not older.parent.exists()  # emptied: gone
    again = CliRunner().invoke(app, ["cache", "prune", "--cache-dir", str(books)])
    assert again.exit_code == 0 and "compiled kernel" not in again.stderr
    assert "another version" not in CliRunner().invoke(app, ["cache", "list", "--cache-dir", str(books)]).stderr


@pytest.mark.parametrize("args, message", [
    (["--cache-max-bytes", "1G"], "--cache-max-bytes needs --cache-dir"),
    (["--cache-dir", "c", "--cache-max-bytes", "lots"], "is not a size"),
])
def test_cache_option_errors_are_usage_errors(summarize, books, args, message, monkeypatch):
    monkeypatch.delenv("UNLIMISUM_CACHE_DIR", raising=False)
    result = summarize(*args, books["text"])
    assert result.exit_code == 2 and message in result.stderr


def test_coverage_in_json_and_as_a_table(summarize, books):
    result = summarize("--json", "--per-chapter", books["text"])
    assert result.exit_code == 0, result.output
    record = json_lines(result.stdout)[0]
    for part in (record, *record["chapters"]):
        assert part["coverage"] and abs(sum(span["share"] for span in part["coverage"]) - 1) < 1e-6
        assert set(part["coverage"][0]) == {"title", "start_token", "end_token", "share"}
        assert abs(sum(span["share"] for span in part["window_coverage"]) - 1) < 1e-6
    table = summarize("--coverage", books["text"])
    assert table.exit_code == 0 and "| part | tokens | share of attention |" in table.stdout
    assert "share of attention" not in summarize(books["text"]).stdout


# -- a summary the model ended at once -------------------------------------------------------------


@pytest.fixture(scope="module")
def silent_model_dir(tmp_path_factory):
    """A tiny BART that emits its end token first, whatever it reads (as an untrained head can)."""
    from transformers import AutoModelForSeq2SeqLM

    from tests.tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("silent"), "bart")
    model = AutoModelForSeq2SeqLM.from_pretrained(folder)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] = 1e4
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("as_json", [False, True])
def test_an_empty_summary_is_said_on_stderr_with_what_to_do(silent_model_dir, loader, tmp_path, as_json):
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT * 2, encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", "-m", str(silent_model_dir), "--device", "cpu",
                                      *(["--json"] if as_json else []), str(book)])
    assert result.exit_code == 0, result.output
    (warning,) = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warning.startswith(f"unlimisum: warning: {book}: the summary is empty") and "--min-new-tokens" in warning
    if as_json:
        record = json.loads(result.stdout)
        assert record["summary"] == "" and record["warnings"] and "empty" in record["warnings"][0]
    else:
        assert result.stdout.strip() == ""
    piped = CliRunner().invoke(app, ["summarize", "-m", str(silent_model_dir), "--device", "cpu", "-"],
                               input=SAMPLE_TEXT * 2)
    (warning,) = [line for line in piped.stderr.splitlines() if "warning" in line]
    assert warning.startswith("unlimisum: warning: standard input: the summary is empty")  # as its done line says
