"""Speed choices measured once per machine and kept (unlimisum/measurements.py); races that stop early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from unlimisum import measurements
from unlimisum.measurements import Measurement, MeasurementStore, race, remembered
from unlimisum.search import kernels


def test_a_race_calls_a_clear_loser_once_and_the_others_in_turns():
    calls = []
    seconds = {"fast": 0.01, "close": 0.015, "slow": 1.0}
    timer = lambda run: calls.append(run()) or seconds[calls[-1]]  # noqa: E731
    best = race({name: (lambda n=name: n) for name in seconds}, turns=3, timer=timer)
    assert best == seconds
    assert calls.count("slow") == 1
    assert calls.count("fast") == 4 and calls.count("close") == 4


@pytest.mark.parametrize("first_call", [0.03, 0.053, 0.15])
def test_a_candidate_slow_only_on_its_first_call_is_timed_again(first_call):
    """3x, 5.3x (a bfloat16 matmul's first call in a calibration on an EPYC Zen 5) and 15x the leader on its first
    call (warming up): timed again, and it wins."""
    calls = []
    first = {"warming": True}

    def timer(run):
        name = run()
        calls.append(name)
        if name == "b" and first["warming"]:
            first["warming"] = False
            return first_call
        return {"a": 0.01, "b": 0.005}[name]

    best = race({"a": lambda: "a", "b": lambda: "b"}, timer=timer)
    assert min(best, key=best.get) == "b"


def test_a_measurement_is_made_once_and_kept_for_the_next_process(tmp_path):
    made = []
    measure = lambda: made.append(1) or (2.5, "measured")  # noqa: E731
    first = remembered("probe", measure, store=MeasurementStore(tmp_path / "m.json", key="machine-a"))
    again = remembered("probe", measure, store=MeasurementStore(tmp_path / "m.json", key="machine-a"))
    assert first.value == again.value == 2.5 and len(made) == 1
    assert again.measured_at == first.measured_at and again.reason == "measured"


def test_a_kept_choice_of_another_releases_shape_is_measured_again_for_this_process(tmp_path, monkeypatch):
    """remembered_choice: (the choice, kept or not); an entry whose fields are not the choice's (a release that
    measured other things) is measured again for this process, and said as kept None."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Choice:
        speed: float
        reason: str = ""

    store = MeasurementStore(tmp_path / "measurements.json")
    monkeypatch.setattr(measurements, "default_store", lambda: store)
    made = []

    def measure() -> Choice:
        made.append(1)
        return Choice(2.0, "measured")

    assert measurements.remembered_choice("a choice", measure, Choice) == (Choice(2.0, "measured"), False)
    assert measurements.remembered_choice("a choice", measure, Choice) == (Choice(2.0, "measured"), False)
    store = MeasurementStore(tmp_path / "measurements.json")  # the next process's
    assert measurements.remembered_choice("a choice", measure, Choice) == (Choice(2.0, "measured"), True)
    assert len(made) == 1
    remembered("an older choice", lambda: ({"speed": 1.0, "gone": True}, "an older release's"), store=store)
    assert measurements.remembered_choice("an older choice", measure, Choice) == (Choice(2.0, "measured"), None)
    assert len(made) == 2


def test_another_machine_measures_again(tmp_path):
    made = []
    measure = lambda: made.append(1) or (len(made), "measured")  # noqa: E731
    remembered("probe", measure, store=MeasurementStore(tmp_path / "m.json", key="machine-a"))
    other = remembered("probe", measure, store=MeasurementStore(tmp_path / "m.json", key="machine-b"))
    assert other.value == 2 and len(made) == 2
    data = json.loads((tmp_path / "m.json").read_text())
    assert set(data) == {"machine-a", "machine-b"}  # the first machine's entry is kept beside the second's


def test_the_key_names_the_instruction_settings(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    plain = measurements.machine_key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert measurements.machine_key() != plain
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    identity = measurements.machine_identity()
    assert identity["threads"] == "97" and identity["ATEN_CPU_CAPABILITY"] == "avx2" and identity["cpu"]


def test_the_key_names_the_compiled_kernels_target(monkeypatch):
    """numba compiled for another CPU (an AVX2 laptop emulated on an AVX-512 machine) measures again."""
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    plain = measurements.machine_key()
    monkeypatch.setenv("NUMBA_CPU_NAME", "znver2")
    assert measurements.machine_key() != plain


def test_a_damaged_or_unwritable_file_costs_only_the_measurement(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("{not json")
    made = []
    with pytest.warns(measurements.MeasurementsWarning, match="it is not JSON"):
        found = remembered("probe", lambda: made.append(1) or (1.0, "x"), store=MeasurementStore(path, key="k"))
    assert found.value == 1.0 and made == [1]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = MeasurementStore(blocked / "m.json", key="k")  # its folder is a file: nothing can be written
    with pytest.warns(measurements.MeasurementsWarning, match="cannot be read"):
        assert remembered("probe", lambda: (3.0, "x"), store=store).value == 3.0
    assert remembered("probe", lambda: (4.0, "x"), store=store).value == 3.0  # kept in memory for the process


def test_forget_drops_this_machines_measurements_only(tmp_path):
    path = tmp_path / "m.json"
    MeasurementStore(path, key="a").put(Measurement("x", 1, "2026-01-01T00:00:00+00:00", 0.1, ""))
    MeasurementStore(path, key="b").put(Measurement("x", 2, "2026-01-01T00:00:00+00:00", 0.1, ""))
    assert MeasurementStore(path, key="a").forget() == 1
    assert MeasurementStore(path, key="a").all() == []
    assert [m.value for m in MeasurementStore(path, key="b").all()] == [2]


def test_the_store_follows_the_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path / "here"))
    assert measurements.default_store().path == tmp_path / "here" / "measurements.json"
    monkeypatch.delenv("UNLIMISUM_CACHE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert measurements.cache_home() == tmp_path / "xdg" / "unlimisum"


def test_the_kernel_calibration_is_kept_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    calibrated = []
    real = kernels.calibrate
    monkeypatch.setattr(kernels, "calibrate", lambda *a, **k: calibrated.append(1) or real(*a, **k, rows=2048))
    monkeypatch.setattr(kernels, "_CALIBRATED", {})
    first = kernels.kernel_for(torch.device("cpu"), torch.bfloat16, 32)
    monkeypatch.setattr(kernels, "_CALIBRATED", {})  # a new process
    again = kernels.kernel_for(torch.device("cpu"), torch.bfloat16, 32)
    assert again == first and calibrated == [1]
    names = [m.name for m in measurements.default_store().all()]
    assert f"retrieval kernel v{kernels.MEASUREMENT_VERSION} cpu bfloat16 d=32" in names


def test_the_calibration_times_an_emulated_16_bit_kernel_once_per_race(monkeypatch):
    """A CPU without 16-bit units: the native kernel tens of times slower than float32 is called once in each race
    it enters, its other dense block sizes never, and the calibration chooses a widening kernel."""
    native_calls = []
    real_scores, real_dense = kernels.native_scores, kernels._dense_blocks
    state = {"native": False}

    def native_scores(states, queries):
        state["native"] = True
        native_calls.append("scores")
        return real_scores(states, queries)

    def dense_blocks(states, queries, choice, block):
        if not choice.widens:
            state["native"] = True
            native_calls.append(f"dense@{block}")
        return real_dense(states, queries, choice, block)

    def timer(run):  # the emulated kernel is 50x slower; everything else takes a millisecond
        state["native"] = False
        run()
        return 0.05 if state["native"] else 0.001

    monkeypatch.setattr(kernels, "native_scores", native_scores)
    monkeypatch.setattr(kernels, "_dense_blocks", dense_blocks)
    choice = kernels.calibrate(torch.device("cpu"), torch.bfloat16, 16, rows=2048, timer=timer)
    assert choice.scores in ("float32", "packed") and choice.fallback == "float32"
    assert native_calls.count("scores") == 1
    assert [call for call in native_calls if call.startswith("dense")] == ["dense@2048"]


@pytest.mark.parametrize("content", ['{"k": []}', '[1, 2]', '{"k": {"measurements": {"probe": 3}}}', '"text"',
                                     '{"k": {"machine": 5, "measurements": {}}}', '{not json', '\udcff'])
def test_a_file_of_another_shape_is_measured_again_and_said_once(tmp_path, content):
    path = tmp_path / "m.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    store = MeasurementStore(path, key="k")
    with pytest.warns(measurements.MeasurementsWarning, match="measured again") as said:
        assert remembered("probe", lambda: (1.5, "measured"), store=store).value == 1.5
        assert store.all()[0].value == 1.5
        remembered("other", lambda: (2.5, "measured"), store=store)
    assert len([w for w in said if issubclass(w.category, measurements.MeasurementsWarning)]) == 1
    assert json.loads(path.read_text())["k"]["measurements"]["probe"]["value"] == 1.5  # written whole again


def test_the_entries_of_a_well_formed_file_are_read_without_a_word(tmp_path, recwarn):
    path = tmp_path / "m.json"
    MeasurementStore(path, key="a").put(Measurement("x", 1, "2026-01-01T00:00:00+00:00", 0.1, ""))
    found = MeasurementStore(path, key="a").get("x")
    assert found.value == 1 and found.kept
    assert not [w for w in recwarn if issubclass(w.category, measurements.MeasurementsWarning)]


WRITER = """
import sys
from unlimisum.measurements import Measurement, MeasurementStore
path, key, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for number in range(count):
    MeasurementStore(__import__("pathlib").Path(path), key=key).put(
        Measurement(f"{key}-{number}", number, "2026-01-01T00:00:00+00:00", 0.0, ""))
"""


def test_processes_writing_at_once_lose_nothing(tmp_path):
    """Ray workers start together, or two terminals: each one's measurements are all kept."""
    path = tmp_path / "m.json"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), key, "25"])
               for key in ("a", "b", "c", "d")]
    assert [writer.wait(timeout=300) for writer in writers] == [0, 0, 0, 0]
    data = json.loads(path.read_text())
    assert {key: len(entry["measurements"]) for key, entry in data.items()} == {"a": 25, "b": 25, "c": 25, "d": 25}


def test_remeasure_forgets_every_entry_of_this_machine_whatever_its_threads(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    identity = measurements.machine_identity()
    for threads in ("1", "2", "16"):  # the CLI's own, and Ray workers' thread counts
        monkeypatch.setattr(measurements, "machine_identity", lambda t=threads: dict(identity, threads=t))
        MeasurementStore(path).put(Measurement("x", threads, "2026-01-01T00:00:00+00:00", 0.1, ""))
    other = dict(identity, cpu="another CPU", cpu_flags="0" * 16)
    MeasurementStore(path, key="elsewhere").put(Measurement("x", "far", "2026-01-01T00:00:00+00:00", 0.1, ""))
    data = json.loads(path.read_text())
    data["elsewhere"]["machine"] = other
    path.write_text(json.dumps(data))
    assert len(data) == 4
    assert MeasurementStore(path).forget() == 3
    assert list(json.loads(path.read_text())) == ["elsewhere"]


def kept(path, name="choice"):
    MeasurementStore(path, key="k").put(Measurement(name, 1, "2026-01-01T00:00:00+00:00", 0.1, ""))
    return MeasurementStore(path, key="k")


@pytest.mark.parametrize("ratio, forgotten", [(2.0, True), (1.6, True), (1.2, False), (0.5, False)])
def test_a_kept_choice_the_live_run_finds_slower_is_measured_again(tmp_path, ratio, forgotten):
    store = kept(tmp_path / "m.json")
    check = measurements.LiveCheck("choice", kept=store.get("choice").kept, store=store)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(measurements.LIVE_SAMPLES + 3):
            check.observe(ratio * 0.010, 0.010)
    assert check.slower is forgotten and check.done
    assert (MeasurementStore(tmp_path / "m.json", key="k").get("choice") is None) is forgotten
    assert len([w for w in said if "measured again next time" in str(w.message)]) == int(forgotten)


def test_one_slow_call_among_the_first_does_not_void_a_choice(tmp_path):
    store = kept(tmp_path / "m.json")
    check = measurements.LiveCheck("choice", store=store)
    for seconds in [0.5] + [0.011] * (measurements.LIVE_SAMPLES - 1):  # a page fault, a busy moment
        check.observe(seconds, 0.010)
    assert check.done and not check.slower and store.get("choice") is not None


def test_a_choice_measured_by_this_process_is_not_checked(tmp_path):
    store = MeasurementStore(tmp_path / "m.json", key="k")
    fresh = remembered("choice", lambda: (1, "measured now"), store=store)
    check = measurements.LiveCheck("choice", kept=fresh.kept, store=store)
    for _ in range(measurements.LIVE_SAMPLES):
        check.observe(1.0, 0.010)
    assert not check.slower and store.get("choice") is not None


def test_the_command_line_says_so_in_one_line_and_runs_on(tmp_path):
    (tmp_path / "measurements.json").write_text('{"k": []}')
    env = dict(os.environ, UNLIMISUM_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-m", "unlimisum", "info", "--tokens", "1000"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("unlimisum: warning: ") and "measured again" in said[0], said
    kept = json.loads((tmp_path / "measurements.json").read_text())  # written whole, of the right shape again
    assert [name for entry in kept.values() for name in entry["measurements"]]
