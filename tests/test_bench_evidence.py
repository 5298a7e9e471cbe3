"""bench/evidence.py --real at the tiny size: a row per store and beam count, with the weights in the dtype asked."""

from __future__ import annotations

import pytest

from bench import evidence


@pytest.mark.parametrize("dtype, setting, expected", [("bfloat16", None, "bfloat16"), ("auto", "0", "float32"),
                                                      ("auto", "1", "bfloat16")])
def test_the_real_cost_runs_with_the_weights_in_the_dtype_asked(monkeypatch, dtype, setting, expected):
    if setting is not None:  # what --dtype auto chooses, without measuring this CPU
        monkeypatch.setenv("UNLIMISUM_CPU_BFLOAT16", setting)
    rows = evidence.real_cost(["bart-tiny"], [3000], 8, [1], key_stores=("per-layer+values",), dtype=dtype)
    assert [(row["dtype"], row["key_store"], row["num_beams"]) for row in rows] == [(expected, "per-layer+values", 1)]
    row = rows[0]
    assert row["sentences"] >= 1 and row["generate_seconds"] > 0 and row["support_seconds"] > 0
    assert row["with_support_share"] == pytest.approx((row["evidence_seconds"] + row["support_seconds"])
                                                      / row["generate_seconds"])
