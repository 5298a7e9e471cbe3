"""An evaluation: every document summarized by unlimisum and by each baseline, scored, kept as it finishes.

``Evaluation.run`` goes through the data one document at a time, each system in turn (unlimisum first), and
appends each (system, document) result to a ``ResultsFile`` the moment it is scored (written and synced: a
killed run loses at most the document in flight). Run again with the same file, it skips what is there, so an
interrupted evaluation resumes where it stopped; a file made with other settings is refused rather than mixed
in. ``report`` turns the results into means with bootstrap intervals and paired differences
(unlimisum/evaluation/statistics.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from unlimisum.errors import UnlimisumError
from unlimisum.evaluation import metrics as scoring
from unlimisum.evaluation.baselines import check_baselines, summarize_baseline
from unlimisum.evaluation.data import Item, read_document_of
from unlimisum.evaluation.statistics import bootstrap_mean, paired_difference
from unlimisum.files import atomic_write_bytes

SYSTEM = "unlimisum"
RESULTS_FORMAT = 1  # what a results file's lines hold: another format is another evaluation


class ResultsConflictError(UnlimisumError):
    """The results file holds an evaluation made with other settings."""


@dataclass(frozen=True)
class EvaluationConfig:
    """What is scored besides unlimisum, and with which metrics."""

    baselines: tuple[str, ...] = ()  # "truncated" and/or "chunked" (unlimisum/evaluation/baselines.py)
    entities: bool = False  # EntMent, with spaCy's en_core_web_sm
    bertscore_model: str | None = None  # BERTScore F1 with this model; None: not computed


@dataclass
class DocumentResult:
    """One system's summary of one document and its scores (fractions in [0, 1])."""

    system: str
    id: str
    summary: str
    scores: dict  # rouge1, rouge2, rougeL, rougeLsum (and entment, bertscore when computed)
    words: int  # the summary's length
    seconds: float  # what summarizing it took
    check_first: float | None = None  # unlimisum: the share of its sentences whose support is weak

    def record(self) -> dict:
        return {"system": self.system, "id": self.id, "summary": self.summary, **self.scores, "words": self.words,
                "seconds": self.seconds, "check_first": self.check_first}


class ResultsFile:
    """The results of an evaluation as they come: a first line naming its settings, then one line a result."""

    def __init__(self, path: Path, settings: dict):
        self.path = path
        self.settings = settings
        self.digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    def done(self) -> dict[tuple[str, str], dict]:
        """The results kept so far, by (system, id); a last line cut short by a killed run is left out.
        ResultsConflictError where the file holds an evaluation with other settings."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return {}
        except OSError as error:
            raise UnlimisumError(f"cannot read the results ({error.strerror or error})", source=str(self.path))
        found = {}
        for number, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines) - 1:
                    continue  # a result cut short: it is done again
                raise UnlimisumError(f"line {number + 1} is not a result: the file is damaged; move it away to "
                                     "start again", source=str(self.path)) from None
            if number == 0:
                if record.get("settings_digest") != self.digest or record.get("format") != RESULTS_FORMAT:
                    raise ResultsConflictError(
                        "holds an evaluation with other settings (model, options, data or metrics); use another "
                        "output folder, or --fresh to start this one again", source=str(self.path))
                continue
            found[(record["system"], str(record["id"]))] = record
        return found

    def start(self, fresh: bool = False) -> None:
        """A new file holding only the settings line, where there is none (or ``fresh``)."""
        if fresh or not self.path.exists():
            header = {"format": RESULTS_FORMAT, "settings_digest": self.digest, "settings": self.settings}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path, (json.dumps(header, ensure_ascii=False) + "\n").encode("utf-8"))

    def add(self, result: DocumentResult) -> None:
        """Append ``result`` and make sure it is on disk before the next document starts."""
        line = json.dumps(result.record(), ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(line)
            file.flush()
            os.fsync(file.fileno())


@dataclass
class EvaluationResult:
    """Every result, by system in the order they were scored (unlimisum first), documents in data order."""

    systems: list[str]
    items: list[Item]
    results: dict[tuple[str, str], dict] = field(default_factory=dict)  # (system, id) -> record


class Scorers:
    """The metrics of ``config``, ready: made before the model loads, so a missing package or model is said
    before minutes of downloading and loading (MetricUnavailableError)."""

    def __init__(self, config: EvaluationConfig):
        self.rouge = scoring.rouge_scorer()
        self.entities = scoring.EntityMentions() if config.entities else None
        self.bertscore = scoring.BertScore(config.bertscore_model) if config.bertscore_model else None

    def __call__(self, summary: str, references: Sequence[str]) -> dict[str, float]:
        """Every score of ``summary`` against ``references``."""
        scores = scoring.rouge(self.rouge, summary, references)
        if self.entities is not None:
            scores["entment"] = self.entities(summary, references)
        if self.bertscore is not None:
            scores["bertscore"] = self.bertscore(summary, references)
        return scores


class Evaluation:
    """unlimisum (a Summarizer) and the baselines over a data set, with the metrics of ``config``."""

    def __init__(self, summarizer, config: EvaluationConfig, read_document: Callable,
                 clock: Callable[[], float] = time.perf_counter, scorers: Scorers | None = None):
        check_baselines(config.baselines, summarizer.loaded)
        self.summarizer, self.config, self.read_document, self.clock = summarizer, config, read_document, clock
        self.systems = [SYSTEM, *config.baselines]
        self.scorers = scorers if scorers is not None else Scorers(config)

    def run(self, items: Sequence[Item], results: ResultsFile | None = None,
            on_result: Callable[[int, int, DocumentResult | None], None] | None = None,
            on_start: Callable[[str, Item], None] | None = None) -> EvaluationResult:
        """Summarize and score every item by every system, skipping what ``results`` holds already; each new
        result is added to it at once. ``on_start(system, item)`` before each summary made, ``on_result(done,
        total, result)`` after each (result None: it was kept)."""
        kept = results.done() if results is not None else {}
        outcome = EvaluationResult(self.systems, list(items), dict(kept))
        total, done = len(items) * len(self.systems), 0
        for item in items:
            document = None
            for system in self.systems:
                done += 1
                if (system, item.id) in kept:
                    if on_result is not None:
                        on_result(done, total, None)
                    continue
                if on_start is not None:
                    on_start(system, item)
                if document is None:
                    document = read_document_of(item, self.read_document)
                result = self.score_one(system, item, document)
                if results is not None:
                    results.add(result)
                outcome.results[(system, item.id)] = result.record()
                if on_result is not None:
                    on_result(done, total, result)
        return outcome

    def score_one(self, system: str, item: Item, document) -> DocumentResult:
        """``system``'s summary of ``document`` and its scores against ``item``'s references."""
        started = self.clock()
        check_first = None
        if system == SYSTEM:
            summary = self.summarizer.summarize(document)
            text = summary.text
            check_first = _check_first_share(summary)
        else:
            text = summarize_baseline(system, self.summarizer.loaded, self.summarizer.generation, document)
        seconds = self.clock() - started
        scores = self.scorers(text, item.references)
        return DocumentResult(system, item.id, text, scores, len(text.split()), seconds, check_first)


def _check_first_share(summary) -> float | None:
    """The share of the summary's sentences with measured support that are marked *check first*; None: none."""
    from unlimisum.evidence import weakly_supported

    measured = [sentence for sentence in summary.evidence if sentence.support is not None]
    return sum(weakly_supported(sentence) for sentence in measured) / len(measured) if measured else None


METRICS = (*scoring.ROUGE_TYPES, "entment", "bertscore", "words", "seconds", "check_first")


def report(outcome: EvaluationResult) -> dict:
    """The evaluation as one JSON-ready object: per system its metrics (mean, 95 % interval) and documents, and
    per baseline its paired difference from unlimisum on each score. A metric without a value for some document
    (EntMent where a reference names no entity) is estimated over the documents that have one (``n``)."""
    systems, paired = [], []
    order = [item.id for item in outcome.items]
    for system in outcome.systems:
        documents = [outcome.results[(system, identity)] for identity in order if (system, identity) in outcome.results]
        estimates = {}
        for metric in METRICS:
            values = [document.get(metric) for document in documents]
            values = [value for value in values if value is not None]
            if values:
                estimates[metric] = dict(bootstrap_mean(values).record(), n=len(values))
        systems.append({"name": system, "metrics": estimates, "documents": [
            {"id": document["id"], **{key: value for key, value in document.items() if key not in ("id", "system")}}
            for document in documents]})
    for baseline in outcome.systems[1:]:
        for metric in (*scoring.ROUGE_TYPES, "entment", "bertscore"):
            pairs = [(outcome.results[(SYSTEM, identity)].get(metric), outcome.results[(baseline, identity)].get(metric))
                     for identity in order if (SYSTEM, identity) in outcome.results
                     and (baseline, identity) in outcome.results]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            if pairs:
                estimate = paired_difference([a for a, _ in pairs], [b for _, b in pairs])
                paired.append({"baseline": baseline, "metric": metric, "difference": estimate.mean,
                               "low": estimate.low, "high": estimate.high, "n": len(pairs)})
    return {"systems": systems, "paired": paired}
