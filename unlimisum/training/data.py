"""Training data: JSON Lines / JSON / CSV / Parquet files with a text and a summary column, or folders
of documents (text, Markdown, EPUB, PDF) each with its summary beside it (``moby.epub`` and
``moby.summary.txt`` or ``moby.summary.md``).

Each file is read with the ``datasets`` library and checked before any model loads: the columns
exist, every text and summary is a non-empty string. Problems are one line naming the file and the
row (rows count records from 1, so in JSON Lines without blank lines row N is line N, and in CSV
it is line N + 1, after the header). Tokenizing (``tokenize_rows``) adds the check that a summary
fits the decoder, and shapes the rows for the training method.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from unlimisum.models.tokens import added_around, encode_text
from unlimisum.training.config import TrainConfig
from unlimisum.training.errors import TrainingDataError

# file suffix -> the datasets builder that reads it
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _builder(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise TrainingDataError(f"unknown data format '{suffix or path.name}'; use .jsonl, .json, .csv or .parquet",
                                source=path)
    return FORMATS[suffix]


def _bad_json_line(path: Path) -> str | None:
    """'line N: <problem>' for the first line of a JSON Lines file that is not a JSON object, else None."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number}: not JSON ({error.msg})"
            if not isinstance(value, dict):
                return f"line {number}: not a JSON object"
    return None


SUMMARY_SUFFIXES = (".summary.txt", ".summary.md")  # a document's summary beside it: moby.epub -> moby.summary.txt


def read_folder(folder: Path):
    """A folder of documents with their summaries beside them, as a ``datasets.Dataset`` (text, summary,
    source, row); every document is read with unlimisum's readers and must have its summary."""
    import datasets

    from unlimisum.errors import InputError
    from unlimisum.ingest import read_document
    from unlimisum.ingest.paths import expand_paths

    documents = [path for path in expand_paths([folder])
                 if isinstance(path, Path) and path.is_file() and not path.name.lower().endswith(SUMMARY_SUFFIXES)]
    if not documents:
        raise TrainingDataError("holds no documents (text, Markdown, EPUB or PDF files)", source=folder)
    columns = {"text": [], "summary": [], "source": [], "row": []}
    for number, document in enumerate(documents, 1):
        stem = document.name[: -len(document.suffix)] if document.suffix else document.name
        candidates = [document.with_name(stem + suffix) for suffix in SUMMARY_SUFFIXES]
        summary = next((candidate for candidate in candidates if candidate.is_file()), None)
        if summary is None:
            raise TrainingDataError(f"no summary beside it (expected {candidates[0].name} or {candidates[1].name})",
                                    source=document)
        try:
            text, target = read_document(document).text, read_document(summary).text
        except InputError as error:
            raise TrainingDataError(error.problem, source=error.source or document) from None
        columns["text"].append(text)
        columns["summary"].append(target)
        columns["source"].append(str(document))
        columns["row"].append(number)
    return datasets.Dataset.from_dict(columns)


def read_rows(path: str | Path, config: TrainConfig, cache_dir: str | Path):
    """One data file (or folder of documents) as a ``datasets.Dataset`` with columns text, summary, source,
    row; checked row by row."""
    import datasets

    path = Path(path)
    if path.is_dir():
        return read_folder(path)
    builder = _builder(path)
    if not path.is_file():
        raise TrainingDataError("no such file", source=path)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(cache_dir))
    except Exception as error:  # noqa: BLE001  (arrow, JSON, CSV and OS errors of every kind)
        where = _bad_json_line(path) if builder == "json" and path.suffix.lower() == ".jsonl" else None
        problem = where or " ".join(str(error).split())[:200]
        raise TrainingDataError(f"cannot be read as {builder.upper()}: {problem}", source=path) from None
    for field, option in ((config.text_field, "--text-field"), (config.summary_field, "--summary-field")):
        if field not in rows.column_names:
            raise TrainingDataError(f"no column '{field}' (columns: {', '.join(rows.column_names) or 'none'}); "
                                    f"name the right one with {option}", source=path)
    if len(rows) == 0:
        raise TrainingDataError("holds no rows", source=path)
    for field in (config.text_field, config.summary_field):
        for number, value in enumerate(rows[field], 1):
            if not isinstance(value, str):
                kind = "missing" if value is None else f"a {type(value).__name__}, not text"
                raise TrainingDataError(f"row {number}: '{field}' is {kind}", source=path)
            if not value.strip():
                raise TrainingDataError(f"row {number}: '{field}' is empty", source=path)
    rows = rows.select_columns([config.text_field, config.summary_field])
    rows = rows.rename_columns({config.text_field: "text", config.summary_field: "summary"}) \
        if (config.text_field, config.summary_field) != ("text", "summary") else rows
    rows = rows.add_column("source", [str(path)] * len(rows))
    return rows.add_column("row", list(range(1, len(rows) + 1)))


def read_data(paths: Sequence[str | Path], config: TrainConfig, cache_dir: str | Path):
    """(training rows, validation rows or None): every file read and checked, the split made."""
    import datasets

    if not paths:
        raise TrainingDataError("no training data files given")
    train = datasets.concatenate_datasets([read_rows(path, config, cache_dir) for path in paths])
    validation = None
    if config.validation:
        validation = datasets.concatenate_datasets([read_rows(path, config, cache_dir) for path in config.validation])
    elif config.validation_fraction > 0:
        held = max(1, round(config.validation_fraction * len(train)))
        if held >= len(train):
            raise TrainingDataError(f"{len(train)} rows cannot be split into training and validation rows")
        split = train.train_test_split(test_size=held, seed=config.seed, shuffle=True)
        train, validation = split["train"], split["test"]
    return train, validation


def tokenize_rows(rows, tokenizer, config: TrainConfig, window: int, max_target_tokens: int | None):
    """Rows -> model features (input_ids, attention_mask, labels) shaped for ``config.method``.

    truncated: the input cut to the window; chunked: one feature per non-overlapping window-sized
    chunk of the input, each with the whole summary as target; the long methods: the input cut to
    ``max_input_tokens``. A summary longer than ``max_target_tokens`` is a TrainingDataError.
    """
    method = config.method
    before, after = added_around(tokenizer)
    specials = len(before) + len(after)
    if method == "truncated":
        limit = window
    elif method == "chunked":
        limit = None
    else:
        limit = config.max_input_tokens

    def features(batch):
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        targets = [encode_text(tokenizer, summary, add_special_tokens=True, target=True).ids
                   for summary in batch["summary"]]
        for text, target, source, row in zip(batch["text"], targets, batch["source"], batch["row"]):
            if max_target_tokens is not None and len(target) > max_target_tokens:
                raise TrainingDataError(
                    f"row {row}: the summary has {len(target)} tokens, more than the {max_target_tokens} "
                    "the model's decoder can produce", source=source)
            content = encode_text(tokenizer, text).ids
            if not content:
                raise TrainingDataError(f"row {row}: the text has no tokens", source=source)
            if method == "chunked":
                size = max(1, window - specials)
                pieces = [content[i : i + size] for i in range(0, len(content), size)]
            else:
                pieces = [content[: max(1, limit - specials)]]
            for piece in pieces:
                ids = before + piece + after
                out["input_ids"].append(ids)
                out["attention_mask"].append([1] * len(ids))
                out["labels"].append(target)
        return out

    return rows.map(features, batched=True, remove_columns=rows.column_names)
