"""bench/grouped_parts.py at a small size: a row per shape, dtype and N, both ways timed, the JSON written."""

from __future__ import annotations

import json

import pytest

from bench import common, grouped_parts
from unlimisum.search import grouped_loops


def test_small_run_times_whole_heads_against_parts(tmp_path, monkeypatch, capsys, two_threads):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(grouped_loops, "PART_MIN_KEYS", 1_024)  # parts of a small store
    monkeypatch.setattr(grouped_parts, "SHAPES", {"one-head": (1, 4, 16), "two-heads": (2, 3, 16)})
    result = grouped_parts.main(["--tokens", "3000", "--shapes", "one-head,two-heads", "--turns", "2",
                                 "--bandwidth-mib", "16", "--name", "grouped_parts_small"])
    written = json.loads((tmp_path / "grouped_parts_small.json").read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    assert [(row["shape"], row["dtype"]) for row in written["rows"]] == [
        (shape, dtype) for shape in ("one-head", "two-heads") for dtype in ("bfloat16", "float32")]
    threads = result["threads"]
    assert threads == 2 and [row["parts"] for row in written["rows"]] == [2, 2, 1, 1]  # a part a thread: 1 head
    for row in written["rows"]:
        assert row["parts"] == grouped_loops.parts_of(row["kv_heads"], 3000, threads)
        assert row["speedup"] == pytest.approx(row["whole_seconds"] / row["parts_seconds"])
        read = row["kv_heads"] * 3000 * 16 * (2 if row["dtype"] == "bfloat16" else 4)
        assert row["key_bytes"] == read
        assert row["read_seconds"] == pytest.approx(read / row["bandwidth_bytes_per_second"])
        assert row["bandwidth_bytes_per_second"] == max(row["bandwidths"]) > 0
    assert "a part a thread" in capsys.readouterr().out
