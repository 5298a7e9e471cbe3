"""bench/approximate_keys.py at a tiny size: the exact row and the IVF rows, a probe of every list recalling all
of the mass, the JSON written."""

from __future__ import annotations

import json

import pytest

from bench import approximate_keys

pytest.importorskip("faiss")


def test_a_tiny_run_compares_ivf_with_the_exact_scan_and_probing_every_list_keeps_all_the_mass(tmp_path, capsys):
    path = tmp_path / "approximate_keys.json"
    result = approximate_keys.main(["--tokens", "6000", "--k", "64", "--nlist", "16", "--ivf-heads", "1",
                                    "--nprobe", "1,16", "--queries", "4", "--bandwidth-mib", "16",
                                    "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    exact, one_list, every_list = written["rows"]
    assert exact["index"] == "exact" and exact["recall"] == 1.0 and exact["layer_seconds"] > 0
    assert one_list["nprobe"] == 1 and 0 <= one_list["recall"] <= 1 and one_list["build_seconds_per_head"] > 0
    assert every_list["nprobe"] == 16 and every_list["recall_min"] == pytest.approx(1.0)  # exhaustive: exact
    assert written["floor_layer_seconds"] > 0 and 0 < written["top1_mass"] < 1
    out = capsys.readouterr().out
    assert "mass recall" in out and str(path) in out
