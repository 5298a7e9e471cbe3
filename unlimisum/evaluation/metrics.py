"""The paper's metrics of a summary against its references, each a fraction in [0, 1].

- ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F1 (Google's rouge-score, with its Porter stemmer), as SCROLLS computes
  them: ROUGE-Lsum over the summary's sentences, one a line (split by pysbd, the splitter of the evidence pass,
  where SCROLLS uses NLTK's); several references: the best score of each metric;
- EntMent (entity mention recall, Unlimiformer's BookSum metric): the share of the named entities spaCy finds in a
  reference (``en_core_web_sm``) whose text the summary contains, case aside; several references: the best;
- BERTScore F1 (bert-score, with the model the user names), for several references the best.

rouge-score is needed (the ``evaluate`` extra); spaCy and bert-score only for their metrics, each a clear error
where it or its model is missing.
"""

from __future__ import annotations

from typing import Sequence

from unlimisum.errors import UnlimisumError

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
SPACY_MODEL = "en_core_web_sm"


class MetricUnavailableError(UnlimisumError):
    """A metric asked for cannot be computed here: its package or model is missing."""


def rouge_scorer():
    """rouge-score's scorer of the four ROUGE types, with stemming; MetricUnavailableError without the package."""
    try:
        from rouge_score import rouge_scorer as module
    except ImportError:
        from unlimisum.errors import install_hint

        raise MetricUnavailableError(f"ROUGE needs rouge-score: {install_hint('evaluate')}") from None
    return module.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def sentence_lines(text: str) -> str:
    """``text`` with one sentence a line (what ROUGE-Lsum reads)."""
    from unlimisum.evidence import sentences

    return "\n".join(text[start:end].strip() for start, end in sentences(text) if text[start:end].strip())


def rouge(scorer, summary: str, references: Sequence[str]) -> dict[str, float]:
    """F1 of each ROUGE type of ``summary`` against the best of ``references``."""
    found = {name: 0.0 for name in ROUGE_TYPES}
    lines = sentence_lines(summary)
    for reference in references:
        scores = scorer.score(sentence_lines(reference), lines)  # (target, prediction)
        for name in ROUGE_TYPES:
            found[name] = max(found[name], scores[name].fmeasure)
    return found


class EntityMentions:
    """EntMent: the share of a reference's named entities the summary mentions (spaCy's ``en_core_web_sm``)."""

    def __init__(self, model: str = SPACY_MODEL):
        try:
            import spacy
        except ImportError:
            raise MetricUnavailableError(
                "EntMent needs spaCy and its English model: pip install spacy && python -m spacy download "
                f"{model}") from None
        try:
            self.nlp = spacy.load(model, disable=["parser", "lemmatizer"])
        except OSError:
            raise MetricUnavailableError(f"EntMent needs spaCy's model {model}: python -m spacy download {model} "
                                         "(once, with a network)") from None

    def entities(self, text: str) -> set[str]:
        return {" ".join(entity.text.lower().split()) for entity in self.nlp(text).ents if entity.text.strip()}

    def __call__(self, summary: str, references: Sequence[str]) -> float | None:
        """The best recall over ``references``; None where no reference names an entity."""
        said = " ".join(summary.lower().split())
        best = None
        for reference in references:
            names = self.entities(reference)
            if names:
                recall = sum(name in said for name in names) / len(names)
                best = recall if best is None else max(best, recall)
        return best


class BertScore:
    """BERTScore F1 with ``model`` (a hub name or a folder), the best over the references."""

    def __init__(self, model: str):
        try:
            from bert_score import BERTScorer
        except ImportError:
            raise MetricUnavailableError("BERTScore needs bert-score: pip install bert-score") from None
        try:
            self.scorer = BERTScorer(model_type=model, lang="en")
        except Exception as error:  # noqa: BLE001 (offline, no such model: one line)
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise MetricUnavailableError(f"BERTScore's model '{model}' cannot be loaded ({first}); it is fetched "
                                         "from the hub once, with a network") from None

    def __call__(self, summary: str, references: Sequence[str]) -> float:
        _, _, f1 = self.scorer.score([summary] * len(references), list(references))
        return float(f1.max())
