"""Batch runs as a library: the runner on its own, with a stand-in summarizer and a reporter that records.

No model and no CLI: the runner reads real files, hands each document to the summarizer it is given,
writes outputs, and says what happened through the reporter, in order.
"""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.config import EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.errors import TokenizerError
from unlimisum.results import Summary, SummaryStats
from unlimisum.runs.jobs import JSON_EXTENSION, plan_jobs
from unlimisum.runs.manifest import DONE, FAILED
from unlimisum.runs.output import MARKDOWN_MARKER
from unlimisum.runs.report import SilentReporter
from unlimisum.runs.runner import BatchRunner, SummarizeSettings


class RecordingReporter(SilentReporter):
    """Every call, in order, as (method, first argument)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        if name in ("reading_input", "loading_model", "begin_document", "document_done", "document_failed",
                    "document_skipped"):
            def record(*args, **kwargs):
                self.calls.append((name, args[2] if name in ("reading_input", "begin_document") else args[0]))
                return attribute(*args, **kwargs)
            return record
        return attribute


class StandInSummarizer:
    """Summarizes a document as its first words; refuses documents that contain ``refuse``."""

    def __init__(self, refuse: str = "\0"):
        self.refuse = refuse
        self.seen: list[str] = []

    def summarize(self, document, *, per_chapter=False):
        self.seen.append(document.source)
        if self.refuse in document.text:
            raise TokenizerError("the tokenizer cannot encode this text", source=document.source)
        stats = SummaryStats(model="stand-in", input_tokens=len(document.text.split()), windows=1, window=64,
                             index_kind="exact", index_device="cpu", retrieval_k=64, datastore_bytes=0,
                             generated_tokens=3, timings={"generate": 0.1}, peak_rss_bytes=0, peak_gpu_bytes=None)
        return Summary(text=" ".join(document.text.split()[:3]), title=document.title, source=document.source,
                       stats=stats)


def settings(**options) -> SummarizeSettings:
    return SummarizeSettings(model=ModelConfig(name="stand-in"), encoding=EncodingConfig(), index=IndexConfig(),
                             retrieval=RetrievalConfig(), generation=GenerationOptions(), **options)


@pytest.fixture
def shelf(tmp_path):
    folder = tmp_path / "shelf"
    folder.mkdir()
    (folder / "a.txt").write_text("Alpha begins here. " + SAMPLE_TEXT, encoding="utf-8")
    (folder / "b.txt").write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 4)  # damaged: found only by reading
    (folder / "c.txt").write_text("Gamma refuse-me. " + SAMPLE_TEXT, encoding="utf-8")
    (folder / "d.txt").write_text("Delta ends it. " + SAMPLE_TEXT, encoding="utf-8")
    return folder


def test_a_batch_reads_everything_first_goes_on_past_failures_and_prints_in_order(shelf):
    reporter, printed, summarizer = RecordingReporter(), [], StandInSummarizer(refuse="refuse-me")
    jobs = plan_jobs([str(shelf)], None).jobs
    result = BatchRunner(settings(), reporter, write_stdout=printed.append, summarizer=summarizer).run(jobs)
    names = [str(shelf / name) for name in ("a.txt", "b.txt", "c.txt", "d.txt")]
    assert [call for call in reporter.calls if call[0] == "reading_input"] == [("reading_input", n) for n in names]
    first_begin = next(number for number, call in enumerate(reporter.calls) if call[0] == "begin_document")
    assert reporter.calls.index(("document_failed", names[1])) < first_begin  # unreadable: said before any work
    assert summarizer.seen == [names[0], names[2], names[3]]
    assert [(outcome.path, outcome.status) for outcome in result.outcomes] == [
        (names[1], FAILED), (names[0], DONE), (names[2], FAILED), (names[3], DONE)]
    assert result.done == 2 and [source for source, _ in result.failures] == [names[1], names[2]]
    assert printed[0].startswith("# ") and "Alpha begins here." in printed[0]
    assert printed[1].startswith("\n# ") and "Delta ends it." in printed[1]  # a blank line between documents


def test_outputs_are_written_with_their_markers_and_stdout_stays_empty(shelf, tmp_path):
    out = tmp_path / "out"
    jobs = plan_jobs([str(shelf / "a.txt"), str(shelf / "d.txt")], out, JSON_EXTENSION).jobs
    printed = []
    result = BatchRunner(settings(as_json=True, output_dir=out), SilentReporter(), write_stdout=printed.append,
                         summarizer=StandInSummarizer()).run(jobs)
    assert result.done == 2 and printed == []
    record = json.loads((out / "a.txt.summary.json").read_text(encoding="utf-8"))
    assert record["written_by"] == "unlimisum" and record["summary"] == "Alpha begins here."
    assert sorted(path.name for path in out.iterdir()) == ["a.txt.summary.json", "d.txt.summary.json"]
    markdown = plan_jobs([str(shelf / "a.txt")], out).jobs
    BatchRunner(settings(output_dir=out), SilentReporter(), summarizer=StandInSummarizer()).run(markdown)
    assert (out / "a.txt.summary.md").read_text(encoding="utf-8").startswith(MARKDOWN_MARKER)


def test_nothing_usable_means_no_summarizer_is_needed(shelf):
    jobs = plan_jobs([str(shelf / "b.txt"), str(shelf / "missing.txt")], None).jobs
    reporter = RecordingReporter()
    result = BatchRunner(settings(), reporter).run(jobs)  # no summarizer given: loading one would fail
    assert result.done == 0 and len(result.failures) == 2
    assert not any(call[0] == "loading_model" for call in reporter.calls)


def test_a_reader_that_closes_stdout_ends_the_run(shelf):
    def closed(text):
        raise BrokenPipeError

    jobs = plan_jobs([str(shelf / "a.txt"), str(shelf / "d.txt")], None).jobs
    summarizer = StandInSummarizer()
    result = BatchRunner(settings(), SilentReporter(), write_stdout=closed, summarizer=summarizer).run(jobs)
    assert result.pipe_closed and summarizer.seen == [str(shelf / "a.txt")]


def test_the_notes_a_run_gives_are_kept_by_the_silent_reporter(shelf):
    (shelf / "e.txt").write_text("Epsilon is fine. " + SAMPLE_TEXT, encoding="utf-8")

    class Empty(StandInSummarizer):
        def summarize(self, document, *, per_chapter=False):
            from dataclasses import replace

            from unlimisum.results import EMPTY_SUMMARY

            return replace(super().summarize(document), text="", warnings=(EMPTY_SUMMARY,))

    reporter = SilentReporter()
    BatchRunner(settings(), reporter, write_stdout=lambda text: None, summarizer=Empty()).run(
        plan_jobs([str(shelf / "e.txt")], None).jobs)
    (note,) = reporter.take()
    assert note.startswith(f"unlimisum: warning: {shelf / 'e.txt'}: the summary is empty")
    assert reporter.take() == []
