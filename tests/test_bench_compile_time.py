"""bench/compile_time.py: each kernel timed in a fresh process from an empty kernel cache, after the kernels a run
compiles before it; the JSON written."""

from __future__ import annotations

import json

from bench import common, compile_time
from unlimisum.search import compiled


def test_every_kernel_is_timed_after_those_before_it_and_the_top_k_as_float32():
    assert set(compile_time.AFTER) == set(compiled.KERNELS)  # every kernel, and only kernels, has its order
    found = compile_time.cases(["top_k", "select_grouped", "dense_sum"], ["bfloat16", "float32"])
    assert found == [("top_k", "float32", ("select", "select_grouped")),
                     ("select_grouped", "bfloat16", ("select",)), ("select_grouped", "bfloat16", ()),
                     ("select_grouped", "float32", ("select",)), ("select_grouped", "float32", ()),
                     ("dense_sum", "bfloat16", ()), ("dense_sum", "float32", ())]


def test_a_small_run_compiles_in_a_fresh_cache_and_writes_its_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    result = compile_time.main(["--kernels", "dense_sum", "--dtypes", "float32", "--repeats", "1",
                                "--name", "compile_time_small"])
    written = json.loads((tmp_path / "compile_time_small.json").read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    [row] = written["rows"]
    assert (row["kernel"], row["dtype"], row["after"], row["ready"]) == ("dense_sum", "float32", [], True)
    [seconds] = row["seconds"]["this tree"]
    assert seconds > 0 and row["median"]["this tree"] == seconds
    [files] = row["cached_files"]["this tree"]
    assert files > 0  # compiled into the fresh cache (compile_once refuses a cache that was not empty)
    assert "seconds to compile from an empty kernel cache" in capsys.readouterr().out
