"""`summarize --engine ray` on one local Ray instance (2 CPUs) shared by the module, with a tiny BART.

Skipped when Ray is not installed (`pip install -e ".[ray]"`). Greedy decoding: the Ray run's
files and stdout must equal the local run's, byte for byte. The clusters as users have them: one
with less room than --workers asks, work of others holding its CPUs, workers that cannot start,
a folder named unlimisum in the working directory (the `unlimisum` command in a subprocess, which
starts its own instance: it must listen on loopback only).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

import pytest
import torch
from typer.testing import CliRunner

from tests.cli_helpers import write_small_books
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.cli.batch_progress import BatchProgress
from unlimisum.runs import ray as ray_engine
from unlimisum.runs.ray import CRASH_HOOK_ENV, start_local_ray
from unlimisum.runs.ray_plan import GIB, NodeFree
from unlimisum.runs.ray_windows import SLOW_PART_ENV

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # Ray instances and worker processes: about 3 minutes on 2 shared CPU cores

FAST = ["--device", "cpu", "--max-new-tokens", "6", "--min-new-tokens", "3"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for the module, started as the engine starts one (on 127.0.0.1, no dashboard);
    the engine uses the one this process already has."""
    folder = start_local_ray(ray, num_cpus=2, log_to_driver=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def idle_cluster(local_ray):
    """Each test starts on an idle instance: the workers a run before killed have given their CPUs back (Ray
    frees them a moment after; on a loaded machine, longer than a run's plan waits)."""
    wait_for_free_cpus(2)


WAIT_SECONDS = 120  # the longest any wait of these tests lasts: then it fails, saying what it waited for


def wait_for_free_cpus(count: int) -> None:
    """Until Ray's view of free resources shows exactly ``count`` of the instance's 2 CPUs free (it follows
    the actors that start and end within a moment, a longer one on a loaded machine); at most WAIT_SECONDS."""
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        free = [node.get("CPU", 0) for node in available_resources_per_node().values()]
        if all(cpus == count for cpus in free):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"waited {WAIT_SECONDS} s for {count} of Ray's 2 CPUs to be free; its nodes show {free} free")
        time.sleep(0.1)


def ray_get(refs, what: str):
    """``ray.get(refs)``, at most WAIT_SECONDS: then the test fails naming ``what`` it waited for."""
    try:
        return ray.get(refs, timeout=WAIT_SECONDS)
    except ray.exceptions.GetTimeoutError:
        pytest.fail(f"waited {WAIT_SECONDS} s for {what}")


@pytest.fixture
def summarize(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("UNLIMISUM_MODEL", raising=False)
    torch.set_num_threads(1)
    model = str(tiny_model_dir("bart"))
    return lambda *args: CliRunner().invoke(app, ["summarize", "-m", model, *FAST, *map(str, args)])


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A folder of four books (text, EPUB, PDF, and a text in a subfolder)."""
    folder = tmp_path_factory.mktemp("library")
    write_small_books(folder)
    (folder / "sub").mkdir()
    (folder / "sub" / "other.txt").write_text("Another book. " + SAMPLE_TEXT, encoding="utf-8")
    return folder


def files(folder) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name != "unlimisum-run.json"}


def test_ray_outputs_and_stdout_equal_the_local_run(summarize, library, tmp_path):
    local, distributed = tmp_path / "local", tmp_path / "ray"
    assert summarize(library, "-o", local).exit_code == 0
    result = summarize(library, "-o", distributed, "--engine", "ray", "--workers", "2")
    assert result.exit_code == 0, result.output
    assert len(files(local)) == 4 and files(distributed) == files(local)
    record = json.loads((distributed / "unlimisum-run.json").read_text())
    assert record["engine"] == "ray" and record["versions"]["ray"] == ray.__version__
    assert record["model"]["fingerprint"] and [doc["status"] for doc in record["documents"]] == ["done"] * 4

    local_lines = summarize("--json", "--per-chapter", library).stdout.splitlines()
    ray_lines = summarize("--json", "--per-chapter", library, "--engine", "ray", "--workers", "2").stdout.splitlines()
    assert len(local_lines) == 4 and len(ray_lines) == 4  # in input order, whichever worker finished first
    for local_record, ray_record in zip(map(json.loads, local_lines), map(json.loads, ray_lines)):
        assert ray_record["path"] == local_record["path"] and ray_record["summary"] == local_record["summary"]
        assert [part["summary"] for part in ray_record["chapters"]] == [
            part["summary"] for part in local_record["chapters"]]
    assert len(json.loads(ray_lines[0])["chapters"]) == 2  # small.epub: two chapters, each summarized


def test_one_book_is_encoded_across_two_workers_into_the_local_store_bit_for_bit(summarize, tmp_path, monkeypatch):
    book = tmp_path / "long.txt"
    book.write_text(SAMPLE_TEXT * 30, encoding="utf-8")  # 6,121 tokens: 191 windows of 64, in 6 parts of 32
    exact = ["--json", "--evidence", "--dtype", "float32", "--storage-dtype", "float32", "--key-store", "per-layer"]
    local = summarize(book, *exact, "--cache-dir", tmp_path / "local")
    assert local.exit_code == 0, local.output
    # a tiny model's part takes a millisecond: as a real one's, long enough that both workers take some
    monkeypatch.setenv(SLOW_PART_ENV, "0.5")
    spread = summarize(book, *exact, "--cache-dir", tmp_path / "ray", "--engine", "ray", "--workers", "2", "-v")
    assert spread.exit_code == 0, spread.output
    assert "Ray: 191 windows encoded in 6 parts by 2 workers;" in spread.stderr
    (local_entry,) = (tmp_path / "local").iterdir()
    (ray_entry,) = (tmp_path / "ray").iterdir()
    assert local_entry.name == ray_entry.name  # the same key: text, model, settings
    names = sorted(path.name for path in ray_entry.iterdir())
    assert names == ["ends.bin", "ids.bin", "keys.bin", "meta.json", "states.bin"]
    for name in names[:-2] + ["states.bin"]:  # the store (and per-layer keys) the driver assembled, as written
        assert (ray_entry / name).read_bytes() == (local_entry / name).read_bytes(), name
    local_record, ray_record = json.loads(local.stdout), json.loads(spread.stdout)
    for field in ("summary", "coverage", "window_coverage", "evidence"):  # the summary was made on the driver
        assert ray_record[field] == local_record[field], field


def test_a_ray_batch_shows_a_books_control_characters_and_never_obeys_them(summarize, tmp_path):
    from tests.test_hostile_text import acted_on, hostile_text

    (tmp_path / "book.txt").write_text(hostile_text(), encoding="utf-8")
    (tmp_path / "other.txt").write_text(hostile_text().replace("Chapter 1", "Part 1"), encoding="utf-8")
    result = summarize(tmp_path / "book.txt", tmp_path / "other.txt", "--per-chapter", "--evidence", "-v",
                       "--engine", "ray", "--workers", "2")
    assert result.exit_code == 0, result.output
    assert acted_on(result.stdout) == [] and acted_on(result.stderr) == []
    # stdout is a pipe here: Markdown, the book's brackets escaped for a renderer
    assert "## Chapter 3: \u241b\\]0;PWNED-TITLE\u2407 The end\u2421" in result.stdout
    assert "Chapter 1: \\[bold red\\]Loud\\[/\\]" in result.stdout


def test_bad_inputs_fail_one_line_each_and_the_others_are_written(summarize, library, tmp_path):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")  # found on the driver, before Ray starts
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nnot really a pdf\n")  # found by the worker that reads it
    out = tmp_path / "out"
    result = summarize(library / "small.txt", tmp_path / "empty.txt", tmp_path / "broken.pdf", library / "small.epub",
                       "-o", out, "--engine", "ray", "--workers", "2")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("unlimisum: error:")]
    assert len(errors) == 2 and any("empty.txt: empty file" in line for line in errors)
    assert any("broken.pdf" in line for line in errors)
    assert sorted(files(out)) == ["small.epub.summary.md", "small.txt.summary.md"]


def test_ctrl_c_leaves_no_partial_file_then_resume_survives_a_worker_dying_mid_book(
        summarize, library, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    assert summarize(library, "-o", reference).exit_code == 0
    out = tmp_path / "out"

    real_update = BatchProgress.update

    def ctrl_c_after_the_first_book(progress):
        if progress.done:
            raise KeyboardInterrupt
        real_update(progress)

    monkeypatch.setattr(BatchProgress, "update", ctrl_c_after_the_first_book)
    interrupted = summarize(library, "-o", out, "--engine", "ray", "--workers", "2")
    assert interrupted.exit_code == 130
    assert "interrupted after 1 of 4 inputs; rerun with --skip-existing to resume" in interrupted.stderr
    written = files(out)
    assert len(written) == 1 and all(written[name] == files(reference)[name] for name in written)  # whole files only
    assert json.loads((out / "unlimisum-run.json").read_text())["status"] == "interrupted"
    monkeypatch.setattr(BatchProgress, "update", real_update)

    token = tmp_path / "crash-once"
    token.write_text("")
    crashing = library / "sub" / "other.txt"  # the last book: never started before the Ctrl-C above
    monkeypatch.setenv(CRASH_HOOK_ENV, f"{crashing}::{token}")  # its worker leaves half a file, then dies
    resumed = summarize(library, "-o", out, "--engine", "ray", "--workers", "2", "--skip-existing")
    assert resumed.exit_code == 0, resumed.output
    assert not token.exists()  # the crash did happen
    assert "died; retrying it on another worker (attempt 2 of 3)" in resumed.stderr
    assert files(out) == files(reference)  # every output complete and correct, no temporary file left
    record = json.loads((out / "unlimisum-run.json").read_text())
    attempts = {doc["path"]: doc["attempts"] for doc in record["documents"] if doc["status"] == "done"}
    assert attempts[str(crashing)] == 2 and len(attempts) == 3

    monkeypatch.delenv(CRASH_HOOK_ENV)
    times = {path: path.stat().st_mtime_ns for path in out.rglob("*.summary.md")}
    again = summarize(library, "-o", out, "--engine", "ray", "--skip-existing")
    assert again.exit_code == 0, again.output
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*.summary.md")} == times
    assert again.stderr.count("skipped ") == 4


# -- clusters as they are -------------------------------------------------------------------------------


@ray.remote(num_cpus=1)
class Holder:
    """Someone else's work on the cluster, holding one CPU."""

    def ping(self) -> bool:
        return True


@contextmanager
def cpus_held(count: int):
    """``count`` of the instance's 2 CPUs taken by other work, until the block ends."""
    holders = [Holder.remote() for _ in range(count)]
    ray_get([holder.ping.remote() for holder in holders], f"{count} actors holding a CPU each to start")
    wait_for_free_cpus(2 - count)
    try:
        yield
    finally:
        for holder in holders:
            ray.kill(holder)


def test_a_cluster_smaller_than_workers_uses_what_fits_and_ends(summarize, library, tmp_path):
    out = tmp_path / "out"
    with cpus_held(1):  # 1 CPU free: --workers 2 cannot all be placed
        result = summarize(library / "small.txt", library / "sub" / "other.txt", "-o", out, "--engine", "ray",
                           "--workers", "2", "-v")
    assert result.exit_code == 0, result.output
    assert ("unlimisum: note: --workers 2: the Ray cluster has room for 1 now, short of CPU (1 free, 1 per worker); "
            "using 1") in result.stderr
    assert "Ray worker on 127.0.0.1 ready: 1 torch threads" in result.stderr
    assert sorted(files(out)) == ["other.txt.summary.md", "small.txt.summary.md"]


def test_no_room_for_a_worker_is_an_error_naming_the_resource(summarize, library, monkeypatch):
    book = library / "small.txt"
    no_gpu = summarize(book, "--engine", "ray", "--gpus-per-worker", "1")
    assert no_gpu.exit_code == 1
    assert no_gpu.stderr.splitlines() == [
        "unlimisum: error: the Ray cluster has no room for a worker: each needs 1 CPU, 1 GPU, 2.0 GiB memory, and "
        f"its node has free {free_now()}; short of GPU (0 free, 1 per worker)"]

    # the plan saw 2 CPUs free, but other work took them before the workers were placed: a bounded wait
    real_plan = ray_engine.plan_workers
    stale = [NodeFree("stale", cpus=2, memory=8 * GIB)]
    monkeypatch.setattr(ray_engine, "plan_workers", lambda nodes, books, **options: real_plan(stale, books, **options))
    monkeypatch.setattr(ray_engine, "PLACEMENT_SECONDS", 3.0)
    with cpus_held(2):
        unplaced = summarize(book, library / "sub" / "other.txt", "--engine", "ray", "--workers", "2")
        free = free_now()
    assert unplaced.exit_code == 1
    assert unplaced.stderr.splitlines() == [
        "unlimisum: error: no Ray worker could be placed within 3 s: each needs 1 CPU and 4.0 GiB memory, and its "
        f"node has free {free}"]


def free_now() -> str:
    from ray._private.state import available_resources_per_node

    (free,) = available_resources_per_node().values()
    return f"CPU {free.get('CPU', 0):g}, GPU {free.get('GPU', 0):g}, memory {free['memory'] / GIB:.1f} GiB"


def test_a_worker_that_cannot_start_is_one_line_not_retried(summarize, library, tiny_model_dir, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model_dir("bart"), damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    books = [library / "small.txt", library / "sub" / "other.txt"]
    local = summarize(*books, "-m", damaged)
    distributed = summarize(*books, "-m", damaged, "--engine", "ray", "--workers", "2")
    assert local.exit_code == distributed.exit_code == 1
    assert distributed.stderr.splitlines() == local.stderr.splitlines()  # the one line a local run gives
    assert len(local.stderr.splitlines()) == 1 and "could not be loaded" in local.stderr

    # workers whose code does not import (another unlimisum first on their path): one line, no retries
    broken = tmp_path / "broken"
    (broken / "unlimisum").mkdir(parents=True)
    (broken / "unlimisum" / "__init__.py").write_text('raise ImportError("not the unlimisum you installed")\n')
    run = unlimisum_command(tmp_path, tiny_model_dir("bart"), books, "--workers", "2", env={"PYTHONPATH": str(broken)})
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines() == [
        "unlimisum: error: a Ray worker could not start: ImportError: not the unlimisum you installed (is "
        "unlimisum installed on every node, in the same environment as the driver?)"]


def test_a_folder_named_unlimisum_in_the_working_directory_and_a_local_instance_on_loopback(
        library, tiny_model_dir, tmp_path):
    work = tmp_path / "work"
    (work / "unlimisum").mkdir(parents=True)  # say, the clone beside the data
    (work / "unlimisum" / "__init__.py").write_text('raise ImportError("the clone, not the installed package")\n')
    shutil.copy(library / "small.txt", work / "small.txt")
    listening: set = set()
    run = unlimisum_command(work, tiny_model_dir("bart"), ["small.txt"], "-o", "out", listening=listening)
    assert run.returncode == 0, run.stderr
    assert (work / "out" / "small.txt.summary.md").read_text().startswith("<!-- written by unlimisum -->")
    assert len(listening) >= 3  # Ray's servers were seen: GCS, raylet, workers
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening


COMMAND_SECONDS = 600  # a whole `unlimisum summarize --engine ray` process of these tests, starting Ray


def unlimisum_command(cwd: Path, model: Path, books: list, *options: str, env: dict | None = None,
                      listening: set | None = None) -> subprocess.CompletedProcess:
    """The `unlimisum` command (``python -I -m unlimisum``: nothing from the working directory or PYTHONPATH
    in the driver itself) with --engine ray and its own local Ray instance; ``listening`` collects the
    (address, port) every process of the run listens on while it runs."""
    command = [sys.executable, "-I", "-m", "unlimisum", "summarize", "-m", str(model), *FAST,
               *map(str, books), "--engine", "ray", *options]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    environment.update(HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **(env or {}))
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    output: dict = {}  # read while it runs (a full pipe would stop it), until it ends
    reader = threading.Thread(target=lambda: output.update(zip(("stdout", "stderr"), process.communicate())))
    reader.start()
    deadline = time.monotonic() + COMMAND_SECONDS
    while reader.is_alive():
        if listening is not None:
            listening.update(listen_addresses(process.pid))
        reader.join(0.5)  # how often the listening sockets are looked at
        if reader.is_alive() and time.monotonic() > deadline:
            process.kill()
            reader.join(WAIT_SECONDS)
            pytest.fail(f"`unlimisum summarize --engine ray` did not end within {COMMAND_SECONDS} s: "
                        f"{output.get('stderr', '')[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output["stdout"], output["stderr"])


def listen_addresses(pid: int) -> set:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    found = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        found.update((c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN)
    return found


def test_workers_share_the_cpus_budget_memory_and_their_warnings_come_back(summarize, library, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "cache"  # cannot be created: a warning for each book, the summaries go on
    books = [library / "small.txt", library / "sub" / "other.txt"]
    local = summarize(*books, "--cache-dir", cache)
    assert local.exit_code == 0, local.output
    distributed = summarize(*books, "--cache-dir", cache, "--engine", "ray", "--workers", "1", "-v")
    assert distributed.exit_code == 0, distributed.output
    lines = distributed.stderr.splitlines()
    ready = [line for line in lines if "Ray worker on 127.0.0.1 ready" in line]
    assert len(ready) == 1 and "ready: 2 torch threads" in ready[0]  # both CPUs of the node: one worker
    assert "GiB memory budget" in ready[0]
    warnings_of = [line for line in local.stderr.splitlines() if "warning:" in line]
    assert len(warnings_of) == 2 and "could not write to the cache" in warnings_of[0]
    assert [line for line in lines if "warning:" in line] == warnings_of
    order = [line for line in lines if "warning:" in line or line.startswith("done ")]
    assert [line.split(":")[0] for line in order] == [  # each book's warning with it: just before its line
        "unlimisum", f"done {books[0]}", "unlimisum", f"done {books[1]}"], order


@ray.remote(num_cpus=0)
class Busy:
    """A worker in the middle of a long book: its call ends only when it is told to (or killed)."""

    def ready(self) -> str:
        return "here"

    def read(self, token: str) -> None:
        while os.path.exists(token):
            time.sleep(0.05)


def test_a_worker_that_stops_answering_is_killed_and_seen_to_end_on_a_real_instance(tmp_path):
    """What the engine does with an unreachable worker (tests/test_engine_ray_standin.py shows when), on Ray itself:
    killed while busy, without a restart, and ended once a call to it fails as dead."""
    token = tmp_path / "still-reading"
    token.write_text("")
    busy = Busy.remote()
    assert ray_get(busy.ready.remote(), "a busy actor to answer") == "here"
    reading = busy.read.remote(str(token))
    engine = ray_engine.RayEngine.__new__(ray_engine.RayEngine)
    engine.ray = ray
    assert engine._end_actor(busy) is True
    with pytest.raises(ray.exceptions.RayActorError):
        # its book never ends: the worker is gone, though the token still says "read on"
        ray_get(reading, "a killed actor's call to fail")
    assert token.exists()
