"""`unlimisum evaluate`: the data read and checked line by line, the paper's metrics as rouge-score computes them,
bootstrap intervals, and a task with a known answer where reading everything must beat the first window: the
trained needle model (tests/fixtures/needle) copies the one span of digits a long input holds."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_needle import FIXTURE, filler, loaded, make_input  # noqa: F401
from unlimisum.cli import app
from unlimisum.evaluation.data import EvaluationDataError, read_items
from unlimisum.evaluation.metrics import rouge, rouge_scorer, sentence_lines
from unlimisum.evaluation.statistics import bootstrap_mean, paired_difference

WINDOWS = 6  # a needle input of 6 windows of 64 tokens: in the first window about one time in six
NEEDLE = ["-m", str(FIXTURE), "--device", "cpu", "--retrieval-k", "16", "--max-new-tokens", "10", "--no-support"]


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n",
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("line, problem", [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: not a JSON object but list"),
    ({"text": "a book", "path": "b.txt", "reference": "r"}, "line 2: needs exactly one of 'text'"),
    ({"text": "a book"}, "line 2: 'reference' must be a string or a nonempty list"),
    ({"text": "a book", "reference": "  "}, "line 2: a reference is empty"),
    ({"text": "a book", "reference": ["fine", ""]}, "line 2: a reference is empty"),
    ({"text": "", "reference": "r"}, "line 2: 'text' must be nonempty text"),
    ({"id": "one", "text": "again", "reference": "r"}, "line 2: id 'one' is already line 1's"),
])
def test_a_malformed_line_is_one_error_naming_its_number(tmp_path, line, problem):
    data = write_lines(tmp_path / "data.jsonl", [{"id": "one", "text": "a book", "reference": "a summary"}, line])
    with pytest.raises(EvaluationDataError, match=problem):
        read_items(data)
    result = CliRunner().invoke(app, ["evaluate", str(data), "-m", str(FIXTURE)])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"unlimisum: error: {data}: {problem}")  # the data file named, then the line


def test_ids_default_to_line_numbers_and_paths_are_relative_to_the_data_file(tmp_path):
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "b.txt").write_text("a book", encoding="utf-8")
    data = write_lines(tmp_path / "data.jsonl", [{"text": "t", "reference": "r"}, "",
                                                 {"id": 7, "path": "books/b.txt", "reference": ["r1", "r2"]}])
    first, second = read_items(data)
    assert (first.id, first.line, first.references) == ("1", 1, ("r",))
    assert (second.id, second.path, second.references) == ("7", tmp_path / "books" / "b.txt", ("r1", "r2"))


def test_a_missing_file_is_named_before_the_model_loads(tmp_path):
    data = write_lines(tmp_path / "data.jsonl", [{"path": "gone.epub", "reference": "r"}])
    result = CliRunner().invoke(app, ["evaluate", str(data), "-m", str(tmp_path / "no-model")])
    assert result.exit_code == 1 and f"line 1: no file {tmp_path / 'gone.epub'}" in result.stderr


def test_a_missing_metric_package_or_unknown_baseline_is_said_before_the_model_loads(tmp_path, monkeypatch):
    data = write_lines(tmp_path / "data.jsonl", [{"text": "a book", "reference": "a summary"}])
    no_model = ["-m", str(tmp_path / "no-model"), "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(app, ["evaluate", str(data), *no_model, "--baseline", "first-page"])
    assert result.exit_code == 2 and "unknown baseline 'first-page'" in result.stderr
    monkeypatch.setitem(sys.modules, "rouge_score", None)  # as without the evaluate extra
    result = CliRunner().invoke(app, ["evaluate", str(data), *no_model])
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        'unlimisum: error: ROUGE needs rouge-score: pip install "unlimisum[evaluate]" '
        '(in a clone of unlimisum: pip install -e ".[evaluate]")']


def test_rouge_is_rouge_scores_with_stemming_sentences_a_line_and_the_best_reference():
    from rouge_score import rouge_scorer as reference_scorer

    summary = "The cats were running home. Then they slept."
    references = ["A cat runs home and sleeps.", "The cats ran home. They slept."]
    scored = rouge(rouge_scorer(), summary, references)
    google = reference_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    for name in scored:
        assert scored[name] == max(google.score(sentence_lines(ref), sentence_lines(summary))[name].fmeasure
                                   for ref in references)
    assert sentence_lines(summary) == "The cats were running home.\nThen they slept."


def test_bootstrap_intervals():
    assert bootstrap_mean([0.5] * 9).record() == {"mean": 0.5, "low": 0.5, "high": 0.5}
    spread = bootstrap_mean([0.0, 1.0] * 20)
    assert spread.mean == 0.5 and 0.3 < spread.low < 0.5 < spread.high < 0.7
    assert bootstrap_mean([0.1, 0.9, 0.4]) == bootstrap_mean([0.1, 0.9, 0.4])  # the same seed: the same report
    shifted = paired_difference([x + 0.2 for x in [0.1, 0.5, 0.9, 0.3]], [0.1, 0.5, 0.9, 0.3])
    assert shifted.mean == pytest.approx(0.2) and shifted.low == pytest.approx(0.2)  # what the pairs share cancels


def needle_data(folder: Path, filler, documents: int, seed: int = 0) -> tuple[Path, float]:  # noqa: F811
    """A data file of needle inputs, one in a file (``path``), the others inline, the needle's digits as reference;
    and the share of needles in the first window."""
    rng = random.Random(seed)
    lines, first = [], 0
    for number in range(documents):
        position = 0.02 if number % 4 == 1 else 0.3 + 0.7 * rng.random()  # one in four in the first window
        text, content, offset = make_input(filler, WINDOWS * 64, position, seed * 100 + number)
        first += offset + 8 < 64
        if number == 0:
            (folder / "book.txt").write_text(text, encoding="utf-8")
            lines.append({"id": f"doc{number}", "path": "book.txt", "reference": content})
        else:
            lines.append({"id": f"doc{number}", "text": text, "reference": [content, "9 9 9"]})
    return write_lines(folder / "data.jsonl", lines), first / documents


def test_on_a_needle_task_reading_everything_beats_the_first_window(tmp_path, filler):  # noqa: F811
    data, in_first = needle_data(tmp_path, filler, 12)
    result = CliRunner().invoke(app, ["evaluate", str(data), *NEEDLE, "--baseline", "truncated", "--baseline",
                                      "chunked", "--json", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    systems = {system["name"]: system for system in report["systems"]}
    assert list(systems) == ["unlimisum", "truncated", "chunked"]
    unlimisum, truncated = systems["unlimisum"]["metrics"]["rouge1"], systems["truncated"]["metrics"]
    assert unlimisum["mean"] > 0.9 and unlimisum["low"] <= unlimisum["mean"] <= unlimisum["high"]
    # right where the needle was in its window (a wrong guess of digits shares unigrams, hardly bigrams)
    assert in_first == 0.25 and abs(truncated["rouge2"]["mean"] - in_first) < 0.1, truncated
    assert truncated["rouge1"]["mean"] < unlimisum["mean"] - 0.3
    paired = {(pair["baseline"], pair["metric"]): pair for pair in report["paired"]}
    assert paired[("truncated", "rouge1")]["low"] > 0  # the difference holds beyond these 12 documents
    assert set(systems["unlimisum"]["metrics"]) >= {"rouge1", "rouge2", "rougeL", "rougeLsum", "words", "seconds"}
    from rouge_score.rouge_scorer import RougeScorer

    google = RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    items = {item.id: item for item in read_items(data)}
    for system in report["systems"]:  # every score is rouge-score's on the summary printed, the best reference's
        for document in system["documents"]:
            for name in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
                assert document[name] == max(
                    google.score(sentence_lines(reference), sentence_lines(document["summary"]))[name].fmeasure
                    for reference in items[document["id"]].references)
    out = tmp_path / "out"
    assert json.loads((out / "evaluation.json").read_text()) == report
    assert "| unlimisum | 12 |" in (out / "report.md").read_text()
    assert (out / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_interrupted_evaluation_resumes_where_it_stopped(tmp_path, filler):  # noqa: F811
    """Killed (SIGKILL) after some results are kept: the same command scores only the rest, and its report holds
    the earlier results as they were written."""
    data, _ = needle_data(tmp_path, filler, 8, seed=1)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "unlimisum", "evaluate", str(data), *NEEDLE, "--baseline", "truncated", "--json",
               "-o", str(out)]
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if results.exists() and len(results.read_text().splitlines()) >= 4:  # the settings and three results
            break
        time.sleep(0.05)
    process.kill()
    process.wait(timeout=60)
    kept = [json.loads(line) for line in results.read_text().splitlines()[1:] if line.strip().endswith("}")]
    assert 3 <= len(kept) < 16, len(kept)
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {len(kept)} results" in again.stderr
    report = json.loads(again.stdout)
    documents = {(system["name"], document["id"]): document for system in report["systems"]
                 for document in system["documents"]}
    assert len(documents) == 16
    for record in kept:
        assert documents[(record["system"], record["id"])]["seconds"] == record["seconds"]  # kept, not made again


def test_another_evaluations_results_are_refused_not_mixed(tmp_path, filler):  # noqa: F811
    data, _ = needle_data(tmp_path, filler, 2, seed=2)
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["evaluate", str(data), *NEEDLE, "-o", str(out)]).exit_code == 0
    other = CliRunner().invoke(app, ["evaluate", str(data), *NEEDLE, "--num-beams", "2", "-o", str(out)])
    assert other.exit_code == 1 and "holds an evaluation with other settings" in other.stderr
    assert "--fresh" in other.stderr
    fresh = CliRunner().invoke(app, ["evaluate", str(data), *NEEDLE, "--num-beams", "2", "-o", str(out), "--fresh"])
    assert fresh.exit_code == 0, fresh.output


def test_baselines_are_for_encoder_decoder_models_and_metrics_say_what_they_need(tmp_path):
    data = write_lines(tmp_path / "data.jsonl", [{"text": "a book", "reference": "r"}])
    unknown = CliRunner().invoke(app, ["evaluate", str(data), *NEEDLE, "--baseline", "summary-of-summaries"])
    assert unknown.exit_code == 2 and "unknown baseline 'summary-of-summaries'" in unknown.stderr
    try:
        import spacy  # noqa: F401
    except ImportError:
        entities = CliRunner().invoke(app, ["evaluate", str(data), *NEEDLE, "--entities"])
        assert entities.exit_code == 2 and "pip install spacy" in entities.stderr
