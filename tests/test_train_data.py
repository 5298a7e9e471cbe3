"""Training data: every format is read, and every bad file or row is one line naming file and row."""

from __future__ import annotations

import json

import pytest

import unlimisum
from unlimisum.training import TrainConfig, TrainingDataError
from unlimisum.training.data import read_data
from unlimisum.training.run import work_folder

ROWS = [{"text": "a long text about ships", "summary": "ships"}, {"text": "another text", "summary": "text"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _read(tmp_path, path, **options):
    return read_data([path], TrainConfig(**options), tmp_path / "cache")


def test_jsonl_csv_parquet_and_renamed_columns_read_the_same(tmp_path):
    import pandas

    frame = pandas.DataFrame(ROWS)
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    _jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    for name in ("d.csv", "d.parquet", "d.jsonl", "d.json"):
        rows, validation = _read(tmp_path, tmp_path / name)
        assert rows["text"] == [row["text"] for row in ROWS] and rows["summary"] == ["ships", "text"]
        assert rows["row"] == [1, 2] and validation is None
    _jsonl(tmp_path / "other.jsonl", [{"article": row["text"], "abstract": row["summary"]} for row in ROWS])
    rows, _ = _read(tmp_path, tmp_path / "other.jsonl", text_field="article", summary_field="abstract")
    assert rows["summary"] == ["ships", "text"]


def test_validation_fraction_holds_rows_out(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": f"text {i}", "summary": f"s {i}"} for i in range(10)])
    train, validation = _read(tmp_path, path, validation_fraction=0.2)
    assert len(train) == 8 and len(validation) == 2
    assert not set(train["text"]) & set(validation["text"])


@pytest.mark.parametrize("content, message", [
    ([{"text": "t", "abstract": "s"}], r"d\.jsonl: no column 'summary' \(columns: text, abstract\); name the right one with --summary-field"),
    ([ROWS[0], {"text": "  ", "summary": "s"}], r"d\.jsonl: row 2: 'text' is empty"),
    ([ROWS[0], ROWS[1], {"text": "t", "summary": None}], r"d\.jsonl: row 3: 'summary' is missing"),
    ([ROWS[0], {"text": 7, "summary": "s"}], r"d\.jsonl: row 2: 'text' is"),
])
def test_bad_rows_name_file_and_row(tmp_path, content, message):
    path = _jsonl(tmp_path / "d.jsonl", content)
    with pytest.raises(TrainingDataError, match=message) as caught:
        _read(tmp_path, path)
    assert "\n" not in str(caught.value)


def test_unreadable_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{not json\n")
    with pytest.raises(TrainingDataError, match=r"broken\.jsonl: cannot be read as JSON: line 3: not JSON"):
        _read(tmp_path, broken)
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TrainingDataError, match=r"bad\.parquet: cannot be read as PARQUET"):
        _read(tmp_path, bad_parquet)
    with pytest.raises(TrainingDataError, match=r"missing\.jsonl: no such file"):
        _read(tmp_path, tmp_path / "missing.jsonl")
    with pytest.raises(TrainingDataError, match=r"d\.txt: unknown data format '\.txt'"):
        _read(tmp_path, tmp_path / "d.txt")
    csv = tmp_path / "d.csv"
    csv.write_text("text,summary\nfine,ok\n,empty text\n")
    with pytest.raises(TrainingDataError, match=r"d\.csv: row 2: 'text' is missing"):
        _read(tmp_path, csv)


def test_a_summary_longer_than_the_decoder_names_the_row_and_nothing_is_written(tiny_model_dir, tmp_path):
    long_summary = " ".join(["ships"] * 200)  # the tiny decoder has 64 positions
    path = _jsonl(tmp_path / "d.jsonl", [ROWS[0], {"text": "a text", "summary": long_summary}])
    out = tmp_path / "out"
    with pytest.raises(TrainingDataError, match=r"d\.jsonl: row 2: the summary has \d+ tokens, more than the 64"):
        unlimisum.train(path, model=str(tiny_model_dir("bart")), output_dir=out, method="retrieval", max_steps=1)
    assert not out.exists() and not work_folder(out).exists()
    assert list(tmp_path.iterdir()) == [path]


def test_a_bad_validation_file_is_named(tmp_path):
    good = _jsonl(tmp_path / "train.jsonl", ROWS)
    bad = _jsonl(tmp_path / "dev.jsonl", [{"text": "", "summary": "s"}])
    with pytest.raises(TrainingDataError, match=r"dev\.jsonl: row 1: 'text' is empty"):
        read_data([good], TrainConfig(validation=(str(bad),)), tmp_path / "cache")


def test_a_folder_of_documents_with_summaries_beside_them(tmp_path):
    folder = tmp_path / "books"
    (folder / "sea").mkdir(parents=True)
    (folder / "ships.txt").write_text("A long text about ships and the sea.", encoding="utf-8")
    (folder / "ships.summary.txt").write_text("ships", encoding="utf-8")
    (folder / "sea" / "tide.md").write_text("# Tide\n\nThe tide came in twice a day.", encoding="utf-8")
    (folder / "sea" / "tide.summary.md").write_text("the tide", encoding="utf-8")
    rows, validation = _read(tmp_path, folder)
    assert validation is None and len(rows) == 2
    assert sorted(rows["summary"]) == ["ships", "the tide"]
    assert any("twice a day" in text for text in rows["text"])
    (folder / "orphan.txt").write_text("A text without a summary.", encoding="utf-8")
    with pytest.raises(TrainingDataError, match=r"orphan.txt: no summary beside it \(expected orphan.summary.txt"):
        _read(tmp_path, folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainingDataError, match="holds no documents"):
        _read(tmp_path, empty)
