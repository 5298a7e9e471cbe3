"""bench/projections.py at the tiny size: the three ways timed in turns, each group's race, the JSON written."""

from __future__ import annotations

import json

from bench import common, projections as bench_projections
from unlimisum.search import projections


def test_tiny_run_times_the_three_ways_and_writes_each_groups_race(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(projections, "MIN_GROUP_ELEMENTS", 0)  # the tiny model's groups measured too
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path / "cache"))
    result = bench_projections.main(["--size", "bart-tiny", "--tokens", "3000", "--new-tokens", "2", "--beams", "1,2",
                                     "--turns", "2", "--name", "projections_tiny"])
    written = json.loads((tmp_path / "projections_tiny.json").read_text())
    assert written["runs"] == json.loads(json.dumps(result["runs"]))
    assert [row["beams"] for row in written["runs"]] == [1, 2]
    for row in written["runs"]:
        assert [len(row["turns"][variant]) for variant in bench_projections.VARIANTS] == [2, 2, 2]
        assert row["speedup"] == row["linear_seconds_per_token"] / row["measured_seconds_per_token"] > 0
        assert row["compiled_speedup"] == (row["without_compiled_seconds_per_token"]
                                           / row["measured_seconds_per_token"]) > 0
    assert {(race["group"], race["rows"]) for race in written["races"]} == {
        (group, rows) for group in ("decoder layers", "output projection") for rows in (1, 4, 32)}
    assert all(race["form"] in projections.FORMS for race in written["races"])
    assert all("compiled_seconds" in race for race in written["races"] if race["rows"] <= projections.COMPILED_MAX_ROWS)
    assert written["dtype"] == "float32" and "compiled's gain" in capsys.readouterr().out
