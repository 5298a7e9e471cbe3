"""bench/scan_rate.py at a small size: a row per store size and queries per head, its rates from its time, the
JSON written."""

from __future__ import annotations

import json

import pytest

from bench import common, scan_rate


def test_small_run_rates_each_count_of_queries_against_the_bandwidth(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path / "cache"))
    result = scan_rate.main(["--tokens", "2048,3000", "--queries", "1,4,9", "--turns", "2", "--bandwidth-mib", "16",
                             "--name", "scan_rate_small"])
    written = json.loads((tmp_path / "scan_rate_small.json").read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    assert [(row["n_tokens"], row["queries_per_head"]) for row in written["rows"]] == [
        (n, count) for n in (2048, 3000) for count in (1, 4, 9)]
    for row in written["rows"]:
        read = scan_rate.HEADS * row["n_tokens"] * scan_rate.HEAD_DIM * 2  # bfloat16 keys
        assert row["key_bytes"] == read and row["seconds"] > 0
        assert row["keys_bytes_per_second"] == read / row["seconds"]
        assert row["times_read"] == pytest.approx(row["seconds"] * row["bandwidth_bytes_per_second"] / read)
        assert row["bandwidth_bytes_per_second"] == max(row["bandwidths"]) > 0
    assert "x its read" in capsys.readouterr().out
