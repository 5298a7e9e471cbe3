"""A machine's first run: only the compiled kernels a store runs are compiled (none for a short one, the top-k
alone for a middling one), in a thread while the book is encoded, into unlimisum's cache home; what is left is
waited for with a time estimate; long stages show the time left; a kept speed choice the live steps find slower is
measured again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from tests.test_cli_output import FakeClock, FakeMemory, terminal
from unlimisum import measurements
from unlimisum.cli import progress
from unlimisum.cli.progress import ProgressDisplay
from unlimisum.events import ProgressEvent
from unlimisum.search import compiled, kernels


def widening(monkeypatch, widens: bool) -> None:
    """The shared store's measured kernel: float32 (widens, so its sums run compiled) or native."""
    choice = kernels.KernelChoice("float32" if widens else "native", 512, False, 1e-9, 1e-9)
    monkeypatch.setattr(kernels, "kernel_for", lambda *args, **options: choice)


def test_a_short_store_compiles_nothing_and_a_middling_one_its_top_k_alone(monkeypatch):
    widening(monkeypatch, True)
    short = kernels.COMPILED_MIN_STATES - 1
    assert kernels.compiled_kernels_for(short, torch.bfloat16, "cpu", 768, per_layer=True, values=True) == ("top_k",)
    top_k_only = kernels.COMPILED_TOP_K_MIN_STATES
    assert kernels.compiled_kernels_for(top_k_only, torch.float32, "cpu", 768) == ("top_k",)
    shorter = kernels.COMPILED_TOP_K_MIN_STATES - 1
    assert kernels.compiled_kernels_for(shorter, torch.bfloat16, "cpu", 768, per_layer=True, values=True) == ()
    assert kernels.compiled_kernels_for(short, torch.float16, "cpu", 768) == ()  # none reads it
    assert kernels.compiled_kernels_for(short, torch.bfloat16, "cuda", 768) == ()
    assert not kernels.uses_compiled(short, "cpu") and kernels.uses_compiled(kernels.COMPILED_MIN_STATES, "cpu")


@pytest.mark.parametrize("widens, per_layer, values, expected", [
    # a CPU with 16-bit units: the native kernel's dense sums in bfloat16; a reading's many queries sum compiled
    (False, True, False, ("top_k", "select", "scores", "weighted_sum")),
    (True, True, False, ("top_k", "select", "scores", "weighted_sum", "dense_sum")),  # without: the sums widen
    (True, True, True, ("top_k", "select", "scores", "attend_dense", "head_dense_sum", "weighted_sum", "dense_sum")),
    (True, False, False, ("top_k", "weighted_sum", "dense_sum")),
    (False, False, False, ("top_k", "weighted_sum")),
])
def test_a_long_store_compiles_the_kernels_it_runs(monkeypatch, widens, per_layer, values, expected):
    widening(monkeypatch, widens)
    n = kernels.COMPILED_MIN_STATES
    assert kernels.compiled_kernels_for(n, torch.bfloat16, "cpu", 768, per_layer=per_layer, values=values) == expected
    assert kernels.compiled_kernels_for(n, torch.float16, "cpu", 768, per_layer=True) == ()  # no compiled kernel reads


def test_warm_compiles_in_a_thread_and_ready_waits_for_it(monkeypatch):
    monkeypatch.setattr(compiled, "_READY", {})
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow_check(dtype):
        calls.append(dtype)
        started.set()
        release.wait(30)
        return True

    monkeypatch.setitem(compiled._CHECKS, "weighted_sum", slow_check)
    thread = compiled.warm(["weighted_sum"], torch.float32)
    assert thread is not None and thread.daemon and started.wait(30)
    assert compiled.pending(["weighted_sum"], torch.float32) == ["weighted_sum"]
    threading.Timer(0.2, release.set).start()
    assert compiled.ready("weighted_sum", torch.float32)  # waits for the thread rather than compiling again
    thread.join(30)
    assert calls == [torch.float32] and compiled.pending(["weighted_sum"], torch.float32) == []
    assert compiled.warm(["weighted_sum"], torch.float32) is None  # nothing left to do


def test_warm_compiles_the_kernels_it_is_also_given_each_for_its_dtype(monkeypatch):
    """A run's retrieval kernels in the store's dtype and its linear layers' product in the model's, one thread."""
    monkeypatch.setattr(compiled, "_READY", {})
    calls = []
    for name in ("weighted_sum", "linear"):
        monkeypatch.setitem(compiled._CHECKS, name, lambda dtype, name=name: calls.append((name, dtype)) or True)
    thread = compiled.warm(["weighted_sum"], torch.float32,
                           also=[("linear", torch.bfloat16), ("weighted_sum", torch.float32)])
    thread.join(30)
    assert calls == [("weighted_sum", torch.float32), ("linear", torch.bfloat16)]  # each once
    assert compiled.warm(["weighted_sum"], torch.float32, also=[("linear", torch.bfloat16)]) is None


def test_torch_leaves_the_compile_a_core_until_it_ends(two_threads):
    release = threading.Event()
    compiling = threading.Thread(target=lambda: release.wait(30), daemon=True)
    compiling.start()
    with compiled.core_for(compiling) as when_compiled:
        assert torch.get_num_threads() == 1
        when_compiled()  # still compiling: torch keeps to its one thread
        assert torch.get_num_threads() == 1
        release.set()
        compiling.join(30)
        when_compiled()
        assert torch.get_num_threads() == 2  # given back between batches, before the encoding ends
    assert torch.get_num_threads() == 2


def test_a_thread_that_only_loads_the_kernels_is_waited_for_and_torch_keeps_its_threads(two_threads, monkeypatch):
    """Kernels compiled before load in well under LOADING_SECONDS: torch keeps both threads for the first batch."""
    monkeypatch.setattr(compiled, "LOADING_SECONDS", 5.0)
    loading = threading.Thread(target=lambda: threading.Event().wait(0.2), daemon=True)
    loading.start()
    with compiled.core_for(loading) as when_compiled:
        assert not loading.is_alive() and torch.get_num_threads() == 2
        when_compiled()
        assert torch.get_num_threads() == 2


def test_torch_gets_its_threads_back_when_the_encoding_ends_first(two_threads):
    release = threading.Event()
    compiling = threading.Thread(target=lambda: release.wait(30), daemon=True)
    compiling.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with compiled.core_for(compiling):
                assert torch.get_num_threads() == 1
                raise KeyboardInterrupt
        assert torch.get_num_threads() == 2
    finally:
        release.set()
    with compiled.core_for(None) as when_compiled:  # nothing compiling: nothing changes
        when_compiled()
        assert torch.get_num_threads() == 2


def test_one_thread_is_left_alone():
    release = threading.Event()
    compiling = threading.Thread(target=lambda: release.wait(30), daemon=True)
    compiling.start()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with compiled.core_for(compiling):
            assert torch.get_num_threads() == 1
    finally:
        release.set()
        torch.set_num_threads(before)


def test_a_kernel_that_fails_leaves_the_torch_kernels(monkeypatch):
    monkeypatch.setattr(compiled, "_READY", {})

    def broken(dtype):
        raise RuntimeError("LLVM said no")

    monkeypatch.setitem(compiled._CHECKS, "dense_sum", broken)
    assert not compiled.ready("dense_sum", torch.float32)
    assert not compiled.usable_states(torch.zeros(4, 8), "dense_sum")


def test_the_wait_reports_what_is_left_and_an_estimate(monkeypatch):
    monkeypatch.setattr(compiled, "_READY", {(kernel, torch.float32): True for kernel in compiled.KERNELS})
    for kernel in ("select", "scores"):
        del compiled._READY[(kernel, torch.float32)]
        monkeypatch.setitem(compiled._CHECKS, kernel, lambda dtype: True)
    reports = []
    compiled.wait_ready([("select", torch.float32), ("scores", torch.float32), ("dense_sum", torch.float32)],
                        lambda *report: reports.append(report))
    both = compiled.COMPILE_SECONDS["select"] + compiled.COMPILE_SECONDS["scores"]
    assert reports == [(0, 2, both), (1, 2, compiled.COMPILE_SECONDS["scores"]), (2, 2, 0.0)]
    reports.clear()
    compiled.wait_ready([("select", torch.float32)], lambda *report: reports.append(report))
    assert reports == []  # nothing to wait for: nothing said


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_display_says_it_compiles_and_how_long_is_left(width):
    """The whole row in a terminal of a reader's width: what it waits for, that it is once, how long."""
    console, clock = terminal(width), FakeClock()
    display = ProgressDisplay(console, clock=clock, memory=FakeMemory(), auto_refresh=False)
    with display:
        display.begin_document(1, 1, "book.txt")
        display(ProgressEvent("compile", 0, 5, "Book", {"seconds_left": 24.4}))
        display.refresh()
        shown = console.file.getvalue()
    row = next(line for line in shown.splitlines() if "compiling" in line)
    assert progress.COMPILE_STAGE in row and "about 24.4 s left" in row and "0/5" in row
    assert "kernels" in progress.COMPILE_STAGE and "once" in progress.COMPILE_STAGE


@pytest.mark.parametrize("stage, total, label", [
    ("cache", None, progress.CACHE_STAGE), ("prepare", None, progress.PREPARE_STAGE),
    ("evidence", 3, progress.EVIDENCE_STAGE), ("support", 1_234, progress.support_stage(1_234))])
def test_each_stage_reads_whole_in_an_80_column_terminal(stage, total, label):
    """The label beside the bar, not cut: a longer one showed 'finding evidence (reading the summary aga…'."""
    console = terminal(80)
    display = ProgressDisplay(console, clock=FakeClock(), memory=FakeMemory(), auto_refresh=False)
    with display:
        display.begin_document(1, 1, "book.txt")
        display(ProgressEvent(stage, 0, total, "Book", {}))
        display.refresh()
        shown = console.file.getvalue()
    assert any(label in line for line in shown.splitlines()), shown
    assert "1,234" in progress.support_stage(1_234) and "sentences" in progress.support_stage(1_234)


@pytest.mark.parametrize("stage, info, units", [("encode", {"tokens": 40_000}, "tokens/s"), ("support", {}, ""),
                                                ("keys", {}, "")])
def test_long_stages_show_the_time_left(stage, info, units):
    console, clock = terminal(), FakeClock()
    display = ProgressDisplay(console, clock=clock, memory=FakeMemory(), auto_refresh=False)
    with display:
        display.begin_document(1, 1, "book.txt")
        display(ProgressEvent(stage, 0, 40, "Book", info))
        clock.now += 10.0
        display(ProgressEvent(stage, 10, 40, "Book", info))  # a quarter in 10 s: 30 s left
        display.refresh()
        shown = console.file.getvalue()
    assert "30.0 s left" in shown and "10/40" in shown


def test_generation_shows_at_most_the_time_left():
    console, clock = terminal(), FakeClock()
    display = ProgressDisplay(console, clock=clock, memory=FakeMemory(), auto_refresh=False)
    with display:
        display.begin_document(1, 1, "book.txt")
        display(ProgressEvent("generate", 0, 256, "Book"))
        clock.now += 4.0
        display(ProgressEvent("generate", 64, 256, "Book"))  # the summary may end before its limit
        display.refresh()
        shown = console.file.getvalue()
    assert "at most 12.0 s left" in shown


def test_the_kernels_are_cached_under_the_cache_home_and_other_numba_code_keeps_its_own(tmp_path):
    """And the next process loads them: the driver and the kernel it calls by address (jit.callee), each from its
    own cache entry, the address the kernel has in that process (the kernel's check against torch passes)."""
    script = """
import numba, torch
from unlimisum.search import compiled, compiled_loops
assert compiled.ready("weighted_sum", torch.float32)
hits = (compiled_loops._sums_queries_f32.dispatcher.stats.cache_hits, compiled_loops._sums_f32.stats.cache_hits)
print(numba.config.CACHE_DIR or "-", *(sum(counts.values()) for counts in hits))
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_")}
    env["UNLIMISUM_CACHE_HOME"] = str(tmp_path / "home")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    # numba's own setting, for other code in the process, is as it was; the first process compiled, the next loaded
    assert [run.stdout.split() for run in runs] == [["-", "0", "0"], ["-", "1", "1"]]
    assert list((tmp_path / "home" / "kernels").rglob("compiled_loops._sums_f32*.nbi"))


class Steps:
    """A kept shared-store choice whose measurement said a step costs far less than it does."""

    def __init__(self, tmp_path, monkeypatch):
        self.store = measurements.MeasurementStore(tmp_path / "m.json", key="k")
        self.store.put(measurements.Measurement("retrieval kernel", {}, "2026-01-01T00:00:00+00:00", 0.1, ""))
        self.choice = kernels.KernelChoice("float32", 2048, False, 1e-9, 1e-9, select_row_cost=1e-15)
        self.check = measurements.LiveCheck("retrieval kernel", kept=True, store=self.store)
        monkeypatch.setitem(kernels._LIVE, self.choice, self.check)


def test_a_kept_choice_whose_live_steps_run_slower_is_measured_again(tmp_path, monkeypatch):
    steps = Steps(tmp_path, monkeypatch)
    states = torch.randn(kernels.CALIBRATION_ROWS, 8).to(torch.bfloat16)
    queries = torch.randn(kernels.CALIBRATION_QUERIES, 8)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(measurements.LIVE_SAMPLES):
            kernels.attend(states, queries, 64, steps.choice)
    assert steps.check.slower and steps.store.get("retrieval kernel") is None
    assert any("measured again next time" in str(warning.message) for warning in said)


def test_steps_unlike_the_measured_ones_are_not_judged(tmp_path, monkeypatch):
    steps = Steps(tmp_path, monkeypatch)
    states = torch.randn(kernels.CALIBRATION_ROWS // 2, 8).to(torch.bfloat16)  # shorter than the measured store
    for _ in range(measurements.LIVE_SAMPLES):
        kernels.attend(states, torch.randn(kernels.CALIBRATION_QUERIES, 8), 64, steps.choice)
        kernels.attend(states, torch.randn(4 * kernels.CALIBRATION_QUERIES, 8), 64, steps.choice)  # 4 beams
    assert steps.check.ratios == [] and steps.store.get("retrieval kernel") is not None


def test_the_encoding_leaves_the_compile_a_core(tiny_loaded, monkeypatch, two_threads):
    """A document encoded while its kernels compile runs torch on one thread fewer until the compile ends."""
    from unlimisum.config import EncodingConfig, IndexConfig
    from unlimisum.document import Document
    from unlimisum.summarizer import Summarizer

    release = threading.Event()
    compiling = threading.Thread(target=lambda: release.wait(30), daemon=True)
    monkeypatch.setattr(compiled, "warm", lambda kernels, dtype, also=(): (compiling.start(), compiling)[1])
    loaded = tiny_loaded("bart")
    threads_seen = []

    def forward_hook(module, args, output):
        threads_seen.append(torch.get_num_threads())
        if len(threads_seen) == 2:  # the compile ends after the second window
            release.set()
            compiling.join(30)

    handle = loaded.model.get_encoder().register_forward_hook(forward_hook)
    try:
        text = " ".join(f"word{i % 97}" for i in range(400))
        summarizer = Summarizer(loaded, encoding=EncodingConfig(batch_size=1), index=IndexConfig(kind="exact"))
        summarizer.family._encoder().encode(Document.from_text(text))
    finally:
        handle.remove()
        release.set()
    assert threads_seen[:2] == [1, 1] and threads_seen[2:] and set(threads_seen[2:]) == {2}
    assert torch.get_num_threads() == 2


def test_the_kernels_folder_is_named_by_every_file_their_code_comes_from():
    """numba keys a cached kernel on its own module's file alone: the kernels' folder is named by a digest of every
    module that decorates kernels and every search module they take code from (a change to one is another
    folder, never machine code of the old source)."""
    import hashlib
    import re

    from unlimisum.search import jit

    folder = Path(jit.__file__).parent
    decorating = {path.name for path in folder.glob("*.py") if "jit.begin_decorations()" in path.read_text()}
    assert decorating == {"compiled_loops.py", "score_loops.py", "top_k_loops.py", "linear_loops.py",
                          "grouped_loops.py"}
    for name in decorating:
        source = (folder / name).read_text()
        taken = set(re.findall(r"^from unlimisum\.search\.(\w+) import", source, re.MULTILINE))
        taken |= {module for modules in re.findall(r"^from unlimisum\.search import (.+)$", source, re.MULTILINE)
                  for module in re.findall(r"\w+", modules)}
        assert {f"{module}.py" for module in taken} <= set(measurements.KERNEL_SOURCES), name
    sources = b"".join((folder / name).read_bytes() for name in measurements.KERNEL_SOURCES)
    digest = hashlib.sha256(sources).hexdigest()
    assert jit.CODE_FOLDER.name == f"code-{digest[:16]}"
