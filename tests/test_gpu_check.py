"""bench/gpu_check.py on the CPU: ``--dry-run`` runs every section's code with tiny sizes, so the GPU check
cannot rot while no GPU is lent; a spent budget skips cases and says so in the table."""

from __future__ import annotations

import re

import json

import pytest
import torch

from bench import gpu_check

ROW_KEYS = {"section", "case", "status", "metric", "value", "unit", "note"}


def _run(tmp_path, capsys, *extra):
    path = tmp_path / "gpu_check.json"
    result = gpu_check.main(["--dry-run", "--json", str(path), *extra])
    return result, json.loads(path.read_text()), capsys.readouterr().out


def test_dry_run_prints_one_table_and_writes_the_json(tmp_path, capsys):
    result, data, out = _run(tmp_path, capsys)
    keys = {"dry_run", "device", "gpu", "budget_seconds", "seconds", "sections", "passed", "rows", "machine"}
    assert keys <= set(data)
    assert data["dry_run"] is True and data["device"] == "cpu"
    assert {"device", "torch", "torch_cuda", "transformers", "faiss"} <= set(data["gpu"])
    assert set(data["sections"]) == set(gpu_check.SECTION_BUDGETS)
    assert all(section["seconds"] <= section["budget_seconds"] for section in data["sections"].values())
    assert data["passed"] is True and result["passed"] is True
    rows = data["rows"]
    assert all(set(row) == ROW_KEYS for row in rows)
    assert {row["status"] for row in rows} == {"pass", "ok"}, [r for r in rows if r["status"] not in ("pass", "ok")]

    exactness = [row for row in rows if row["section"] == "exactness"]
    assert [row["case"].split(",")[0] for row in exactness] == ["bart tiny float32", "bart tiny bfloat16",
                                                                 "llama tiny float32"]
    assert all(row["metric"] == "max abs diff" and row["value"] < 0.02 for row in exactness)
    seq2seq = [(row["case"], row["metric"]) for row in rows if row["section"] == "seq2seq"]
    for n in gpu_check.DRY.seq2seq_tokens:
        case = f"bart-tiny float32, {n:,} tokens"  # tests keep float32 on the CPU (conftest.py)
        assert (case, "encode") in seq2seq and (case, "decode k=1,024") in seq2seq
        assert (case, f"decode k={n:,}") in seq2seq
    assert ("bart-tiny float32, first 1,024 states", "truncated baseline") in seq2seq
    decoder = [row for row in rows if row["section"] == "decoder-only"]
    assert [row["metric"] for row in decoder] == ["step k=64", "plain KV cache step"] * 2
    faiss_rows = [row for row in rows if row["section"] == "faiss"]
    assert len(faiss_rows) == len(gpu_check.DRY.faiss_ks)
    # flat search is exact too; torch's ids may differ at the k-th place when its 16-bit kernel ran, by ties
    # at that precision (README: "The index")
    found = [float(re.search(r"([0-9.]+)% of torch's top-k ids", row["note"]).group(1)) for row in faiss_rows]
    assert all(share >= 99.0 for share in found), found

    table = out[out.index("GPU check on"):]
    assert table.splitlines()[1].split()[:5] == ["section", "case", "status", "measure", "value"]
    assert all(row["case"] in table for row in rows)


def test_a_spent_budget_skips_every_case_and_says_so(tmp_path, capsys):
    _, data, out = _run(tmp_path, capsys, "--budget", "0", "--only", "exactness,seq2seq,decoder-only")
    rows = data["rows"]
    assert {row["section"] for row in rows} == {"exactness", "seq2seq", "decoder-only"}
    assert {row["status"] for row in rows} == {"skipped"}
    seq2seq = [row["note"] for row in rows if row["section"] == "seq2seq"]
    assert len(seq2seq) == len(gpu_check.DRY.seq2seq_tokens) and all("left in the section" in n for n in seq2seq)
    assert data["passed"] is True and "skipped" in out


def test_a_case_is_estimated_from_the_last_one_scaled_by_its_length():
    assert gpu_check._estimate([], 16_384) == 0.0
    assert gpu_check._estimate([(16_384, 2.0), (300_000, 6.0)], 1_000_000) == pytest.approx(20.0)


def test_unknown_sections_and_a_missing_gpu_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as raised:
        gpu_check.main(["--dry-run", "--only", "exactness,speed"])
    assert raised.value.code == 2 and "unknown sections: speed" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as raised:
            gpu_check.main([])
        assert raised.value.code == 2 and "--dry-run" in capsys.readouterr().err
