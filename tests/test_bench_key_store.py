"""bench/key_store.py at the tiny size: both stores' rows, the floor beside them, the JSON written."""

from __future__ import annotations

import json

import pytest

from bench import key_store


def test_quick_tiny_run_prints_the_table_and_writes_both_stores_beside_the_floor(tmp_path, capsys):
    path = tmp_path / "key_store.json"
    result = key_store.main(["--quick", "--size", "bart-tiny", "--tokens", "3000", "--new-tokens", "4",
                             "--bandwidth-mib", "16", "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["runs"] == json.loads(json.dumps(result["runs"])) and written["quick"] is True
    # the top-k step with the keys alone and with each layer's values; the dense step's key store keeps the values
    assert [(row["k"], row["store"], row["values"]) for row in written["runs"]] == [
        (1024, "shared", False), (1024, "per-layer", False), (1024, "per-layer", True), (3000, "shared", False),
        (3000, "per-layer", True)]
    for row in written["runs"]:
        assert row["seconds_per_token"] > 0 and row["floor_seconds"] > row["model_step_seconds"] > 0
        assert row["first_step_seconds"] > 0  # the first step and a generate() call's setup, apart from the step
        assert row["baseline_seconds_per_token"] > 0  # the plain model's step, for the truncated rate
        assert row["vs_floor"] == row["seconds_per_token"] / row["floor_seconds"]
        assert row["layer_seconds"] > 0 and row["peak_rss_bytes"] > 0
        keys = 3000 * 2 * 4 * 16 * 2 if row["store"] == "per-layer" else 0
        assert row["key_store_bytes"] == keys * (2 if row["values"] else 1)
        # d = 4 heads x 16 = 64, 16-bit; a dense step reads the values too, a top-k step only k of them a head
        layer_bytes = 3000 * 64 * 2 * (2 if row["values"] and row["k"] == 3000 else 1)
        # each row's floor at the better of the bandwidths measured around it; vs_best_floor at the run's best
        assert row["bandwidth_bytes_per_second"] in written["bandwidths_measured"]
        assert row["floor_layer_seconds"] == layer_bytes / row["bandwidth_bytes_per_second"]
        best_floor = written["layers"] * layer_bytes / written["bandwidth_bytes_per_second"] + row["model_step_seconds"]
        assert row["vs_best_floor"] == pytest.approx(row["seconds_per_token"] / best_floor)
        assert row["vs_best_floor"] >= row["vs_floor"]
    # measured at the start and around each of the five rows
    assert len(written["bandwidths_measured"]) == 1 + 2 * 5
    assert written["bandwidth_bytes_per_second"] == max(written["bandwidths_measured"]) > 0 and written["head_kernel"]
    out = capsys.readouterr().out
    assert "vs floor" in out and "per-layer + values" in out and "vs truncated rate" in out and str(path) in out


def test_a_step_is_the_median_gap_between_decoder_starts_after_the_first_step():
    from bench.decode_speed import steady_step

    # the first gap is the first step (it also projects the window), the last start has no end: neither counts;
    # a busy moment on one step moves the median no further than the next step
    assert steady_step([0.0, 1.0, 1.5, 2.0, 10.0, 10.5]) == 0.5
    with pytest.raises(ValueError):
        steady_step([0.0, 1.0])
