"""`summarize --engine ray` against a stand-in for Ray: what a real cluster cannot be made to do on cue.

A worker that stops answering (Ray's ``ActorUnavailableError``, a node cut off while it may still be
writing), a book that finishes while an earlier one is still running when Ctrl-C or an error ends the
run, a Ray release without the private APIs the engine uses. The stand-in runs the engine's own
``SummarizeWorker`` in this process (the tiny BART, loaded once per session) and decides which call
ends next, so each case happens the same way every time; its exceptions are Ray's own classes.
Skipped without Ray (tests/test_engine_ray.py runs the engine on a real local instance).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.runs import ray as ray_engine
from unlimisum.search.packed import MEMORY_LIMIT_ENV

ray = pytest.importorskip("ray")
GIB = 1024**3


def unavailable() -> Exception:
    """Ray's error for a worker that stops answering (before ActorUnavailableError, Ray 2.2x: a RayActorError)."""
    if hasattr(ray.exceptions, "ActorUnavailableError"):
        return ray.exceptions.ActorUnavailableError("stand-in: connection lost", None)
    return ray.exceptions.RayActorError(error_msg="stand-in: connection lost")


def died() -> Exception:
    """Ray's error for a call to a worker that has ended (before ActorDiedError: a RayActorError)."""
    return getattr(ray.exceptions, "ActorDiedError", ray.exceptions.RayActorError)()
FAST = ["--device", "cpu", "--max-new-tokens", "6", "--min-new-tokens", "3"]


class StandInRef:
    """One call to an actor's method, run when the engine asks for its value."""

    def __init__(self, stand_in, actor, method: str, args: tuple):
        self.stand_in, self.actor, self.method, self.args = stand_in, actor, method, args
        self.source = args[0].source if method == "summarize" else None


class StandInActor:
    def __init__(self, stand_in, instance, number: int):
        self.stand_in, self.instance, self.number = stand_in, instance, number
        self.killed = False

    def __getattr__(self, method: str):
        stand_in = self.stand_in

        class Method:
            @staticmethod
            def remote(*args):
                return StandInRef(stand_in, self, method, args)

        return Method


class StandInRay:
    """Enough of the ``ray`` module for the engine, one node with 2 CPUs.

    ``order``: the books (sources) whose summaries end, in that order; a book not in it never ends by itself.
    ``unreachable``: books whose first worker stops answering mid-book (it leaves a temporary file, as a
    worker still writing would). ``probe``: what a call to a killed worker gives: ``"died"`` (Ray reports it
    ended) or ``"timeout"`` (it never does). ``interrupt_after``: Ctrl-C once that many books have ended.
    ``lost_parts``: the calls to ``encode_windows`` (1: the first) whose worker stops answering (one book
    spread over the workers). ``events``: what happened, in order.
    """

    exceptions = ray.exceptions

    def __init__(self, order, *, unreachable=(), probe="died", interrupt_after=None, lost_parts=()):
        self.order, self.unreachable, self.probe = list(order), set(unreachable), probe
        self.interrupt_after = interrupt_after
        self.lost_parts, self.part_calls = set(lost_parts), 0
        self.events: list[tuple] = []
        self.ended_books = 0
        self.actors: list[StandInActor] = []

    def is_initialized(self):
        return True

    def nodes(self):
        return [{"NodeID": "node", "Alive": True, "Resources": {"CPU": 2.0, "memory": 8.0 * GIB}}]

    def cluster_resources(self):
        return {"CPU": 2.0, "memory": 8.0 * GIB}

    def shutdown(self):
        pass

    def kill(self, actor, no_restart=True):
        self.events.append(("kill", actor.number, no_restart))
        actor.killed = True

    def remote(self, cls):
        stand_in = self

        class ActorClass:
            @staticmethod
            def options(**options):
                return ActorClass

            @staticmethod
            def remote(*args):
                actor = StandInActor(stand_in, cls(*args), len(stand_in.actors) + 1)
                stand_in.actors.append(actor)
                return actor

        return ActorClass

    def wait(self, refs, num_returns=1, timeout=None):
        if refs and all(ref.actor.killed for ref in refs):  # after Ctrl-C: the killed workers are gone
            return list(refs), []
        starting = [ref for ref in refs if ref.method != "summarize"]
        if starting:
            return [starting[0]], [ref for ref in refs if ref is not starting[0]]
        if self.interrupt_after is not None and self.ended_books >= self.interrupt_after:
            self.events.append(("ctrl-c",))
            self.interrupt_after = None
            raise KeyboardInterrupt
        for source in self.order:
            for ref in refs:
                if ref.source == source:
                    return [ref], [other for other in refs if other is not ref]
        raise AssertionError(f"stand-in: none of {[ref.source for ref in refs]} can end")

    def get(self, ref, timeout=None):
        actor = ref.actor
        if ref.method == "ready":
            if actor.killed:
                self.events.append(("probe", actor.number, self.probe))
                if self.probe == "timeout":
                    raise ray.exceptions.GetTimeoutError("stand-in: still not ended")
                raise died()
            return "127.0.0.1"
        if ref.method == "start":
            return actor.instance.start()
        if ref.method == "encode_windows":
            self.part_calls += 1
            if self.part_calls in self.lost_parts:
                self.events.append(("part lost", actor.number))
                raise unavailable()
            self.events.append(("part", actor.number))
            return actor.instance.encode_windows(*ref.args)
        job, several = ref.args
        if job.source in self.unreachable:
            self.unreachable.discard(job.source)
            partial = Path(job.output).parent / f".{Path(job.output).name}.standin.partial"
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text("<!-- written by unlimisum -->\nhalf a summ")
            self.events.append(("unreachable", actor.number, job.source))
            raise unavailable()
        self.order.remove(job.source)
        self.ended_books += 1
        self.events.append(("summarized", actor.number, job.source))
        return actor.instance.summarize(job, several)


@pytest.fixture
def stand_in(monkeypatch, loader):
    """``stand_in(ray)``: the engine uses ``ray``; the worker's settings of threads and memory are undone."""
    import torch

    monkeypatch.setenv(MEMORY_LIMIT_ENV, "0")  # the worker sets it: restored (removed) after the test
    threads = torch.get_num_threads()

    def use(fake):
        monkeypatch.setattr(ray_engine, "require_ray", lambda: fake)
        state = types.ModuleType("ray._private.state")  # what the stand-in's node has free
        state.available_resources_per_node = lambda: {"node": fake.cluster_resources()}
        monkeypatch.setitem(sys.modules, "ray._private.state", state)
        return fake

    yield use
    torch.set_num_threads(threads)


@pytest.fixture
def books(tmp_path):
    """Three books; the first's name holds a glob pattern, and the second's is what the pattern matches."""
    folder = tmp_path / "books"
    folder.mkdir()
    names = ["Book [1].txt", "Book 1.txt", "c.txt"]
    for name in names:
        (folder / name).write_text(f"{name}. {SAMPLE_TEXT}", encoding="utf-8")
    return [folder / name for name in names]


def run(tiny_model_dir, *args):
    return CliRunner().invoke(app, ["summarize", "-m", str(tiny_model_dir("bart")), *FAST, *map(str, args),
                                    "--engine", "ray", "--workers", "2"])


def reference(tiny_model_dir, books, *args) -> str:
    local = CliRunner().invoke(app, ["summarize", "-m", str(tiny_model_dir("bart")), *FAST, *map(str, books), *args])
    assert local.exit_code == 0, local.output
    return local.stdout


def summaries(json_lines: str) -> list[tuple]:
    """(path, summary) of each JSON line (the timings differ from run to run)."""
    return [(record["path"], record["summary"]) for record in map(json.loads, json_lines.splitlines())]


def test_a_worker_that_stops_answering_is_killed_and_seen_to_end_before_its_book_is_retried(
        stand_in, tiny_model_dir, books, tmp_path):
    out = tmp_path / "out"
    book = str(books[0])
    fake = stand_in(StandInRay([str(path) for path in books], unreachable={book}))
    result = run(tiny_model_dir, *books, "-o", out)
    assert result.exit_code == 0, result.output
    unreachable = next(event for event in fake.events if event[0] == "unreachable")
    worker = unreachable[1]
    after = fake.events[fake.events.index(unreachable):]
    assert after[1:3] == [("kill", worker, True), ("probe", worker, "died")]  # killed, no restart; then ended
    retried = next(event for event in after if event[0] == "summarized" and event[2] == book)
    assert retried[1] not in (worker,) and retried[1] > 2  # a new worker, started in its place
    assert "retrying it on another worker (attempt 2 of 3)" in result.stderr
    written = sorted(path.name for path in out.iterdir() if path.name != "unlimisum-run.json")
    assert written == ["Book 1.txt.summary.md", "Book [1].txt.summary.md", "c.txt.summary.md"]  # no partial left
    record = json.loads((out / "unlimisum-run.json").read_text())
    assert {doc["path"]: doc["attempts"] for doc in record["documents"]}[book] == 2


def test_a_worker_not_seen_to_end_fails_its_book_and_leaves_what_it_may_still_write(
        stand_in, tiny_model_dir, books, tmp_path):
    out = tmp_path / "out"
    book = str(books[0])
    fake = stand_in(StandInRay([str(path) for path in books], unreachable={book}, probe="timeout"))
    result = run(tiny_model_dir, *books, "-o", out)
    assert result.exit_code == 1
    assert ("stopped answering and was not seen to end within 60 s; not retried, since it may still be writing "
            "(--skip-existing resumes)") in result.stderr
    assert [event for event in fake.events if event[0] == "summarized" and event[2] == book] == []  # not run twice
    assert (out / ".Book [1].txt.summary.md.standin.partial").exists()  # it may still be writing it
    assert (out / "Book 1.txt.summary.md").exists() and (out / "c.txt.summary.md").exists()


def test_a_dead_workers_partial_file_is_removed_and_not_another_books(stand_in, tiny_model_dir, books, tmp_path):
    """``Book [1].txt`` globbed as a pattern matched ``Book 1.txt``'s temporary file (a live worker's) and
    left its own."""
    out = tmp_path / "out"
    out.mkdir()
    other = out / ".Book 1.txt.summary.md.live1234.partial"  # another worker writing, right now
    other.write_text("half")
    job = type("Job", (), {"output": out / "Book [1].txt.summary.md"})()
    own = out / ".Book [1].txt.summary.md.dead5678.partial"
    own.write_text("half")
    ray_engine._remove_partials(job)
    assert other.exists() and not own.exists()


def test_one_book_across_the_workers_survives_a_worker_lost_mid_part(stand_in, tiny_model_dir, tmp_path):
    book = tmp_path / "long.txt"
    book.write_text(SAMPLE_TEXT * 12, encoding="utf-8")  # 2,400 tokens: 76 windows of 64, in 3 parts of 32
    expected = summaries(reference(tiny_model_dir, [book], "--json"))
    fake = stand_in(StandInRay([], lost_parts={2}))
    result = run(tiny_model_dir, book, "--json")
    assert result.exit_code == 0, result.output
    assert summaries(result.stdout) == expected  # summarized here, from the workers' states
    lost = fake.events.index(next(event for event in fake.events if event[0] == "part lost"))
    worker = fake.events[lost][1]
    assert fake.events[lost + 1:lost + 3] == [("kill", worker, True), ("probe", worker, "died")]
    parts = [event[1] for event in fake.events if event[0] == "part"]
    later = [event[1] for event in fake.events[lost:] if event[0] == "part"]
    assert len(parts) == 3 and later and worker not in later  # the lost part went to another worker
    assert len(fake.actors) == 3  # and one was started in its place
    assert "a Ray worker died while encoding part 2 of the book; handing it to another (attempt 2 of 3)" in (
        result.stderr)

    fake = stand_in(StandInRay([], lost_parts={1, 2, 3}))
    failed = run(tiny_model_dir, book, "--json")
    problem = "the Ray workers encoding a part of the book died 3 times (a node lost, or out of memory?)"
    assert failed.exit_code == 1 and problem in failed.stderr
    assert json.loads(failed.stdout)["error_type"] == "WorkerDiedError"


def test_a_worker_needs_the_drivers_folder_only_when_it_reads_and_writes_books(stand_in, tiny_model_dir, tmp_path):
    from unlimisum.config import EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
    from unlimisum.runs.runner import SummarizeSettings

    stand_in(StandInRay([]))  # its fixture puts back the threads and memory budget a worker's start sets
    settings = SummarizeSettings(model=ModelConfig(name=str(tiny_model_dir("bart")), device="cpu"),
                                 encoding=EncodingConfig(), index=IndexConfig(), retrieval=RetrievalConfig(),
                                 generation=GenerationOptions())
    elsewhere = str(tmp_path / "a folder only the driver has")
    with pytest.raises(ray_engine.SharedStorageError, match="inputs and --output-dir must be on storage every node"):
        ray_engine.SummarizeWorker(settings, elsewhere, 1, None).start()
    parts_only = ray_engine.SummarizeWorker(settings, elsewhere, 1, None, reads_files=False)
    assert parts_only.start()["threads"] == 1  # it encodes parts of a book the driver read: no folder needed


def test_ctrl_c_prints_the_summaries_already_finished_in_order(stand_in, tiny_model_dir, books):
    expected = summaries(reference(tiny_model_dir, books, "--json"))
    # the first book never ends; the other two do, then Ctrl-C: they waited for the first to be printed
    stand_in(StandInRay([str(books[2]), str(books[1])], interrupt_after=2))
    result = run(tiny_model_dir, *books, "--json")
    assert result.exit_code == 130
    assert summaries(result.stdout) == [expected[1], expected[2]]  # in input order, not the order they ended
    assert "interrupted after 2 of 3 inputs" in result.stderr

    markdown = reference(tiny_model_dir, books).split("\n\n# ")
    stand_in(StandInRay([str(books[1])], interrupt_after=1))
    result = run(tiny_model_dir, *books)
    assert result.exit_code == 130
    assert result.stdout.strip() == "# " + markdown[1].strip()


def test_an_error_that_ends_the_run_prints_the_summaries_already_finished(stand_in, tiny_model_dir, books,
                                                                         monkeypatch):
    expected = summaries(reference(tiny_model_dir, books, "--json"))
    fake = stand_in(StandInRay([str(books[1]), str(books[0])]))
    real_get = fake.get

    def the_model_fails_on_the_first_book(ref, timeout=None):
        if ref.method == "summarize" and ref.source == str(books[0]):
            raise ray.exceptions.RayTaskError("summarize", "traceback", ray_engine.UnlimisumError("the model broke"))
        return real_get(ref, timeout)

    monkeypatch.setattr(fake, "get", the_model_fails_on_the_first_book)
    result = run(tiny_model_dir, *books, "--json")
    assert result.exit_code == 1
    assert "the model broke" in result.stderr
    assert summaries(result.stdout) == [expected[1]]


# -- Ray's private APIs, each with a fallback -------------------------------------------------------------


def test_without_rays_private_apis_the_engine_falls_back(monkeypatch):
    for name in ("ray._private.state", "ray._private.ray_constants", "ray._private.services"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError, as in a Ray without it
    engine = ray_engine.RayEngine.__new__(ray_engine.RayEngine)
    engine.ray = StandInRay([])
    (node,) = engine._free_nodes()
    assert (node.node_id, node.cpus, node.memory) == ("node", 2.0, 8.0 * GIB)  # the node's totals
    with ray_engine._loopback_only():
        pass
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_engine._is_loopback("auto")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert not ray_engine._is_loopback("auto")


def test_a_ray_without_node_ip_address_is_started_without_it(monkeypatch):
    calls = []

    class OldRay:
        @staticmethod
        def init(**options):
            calls.append(options)
            if "_node_ip_address" in options:
                raise RuntimeError("Unknown keyword argument(s): _node_ip_address")

    folder = ray_engine.start_local_ray(OldRay(), num_cpus=1)
    try:
        assert [sorted(options) for options in calls] == [["_node_ip_address", "address", "include_dashboard", "num_cpus"],
                                                          ["address", "include_dashboard", "num_cpus"]]
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)

    class BrokenRay:
        @staticmethod
        def init(**options):
            raise RuntimeError("no room on this machine")

    with pytest.raises(RuntimeError, match="no room"):
        ray_engine.start_local_ray(BrokenRay())


def test_the_free_resources_of_each_node_come_from_ray_when_it_has_them(monkeypatch):
    state = types.ModuleType("ray._private.state")
    state.available_resources_per_node = lambda: {"node": {"CPU": 1.0, "memory": 3.0 * GIB}}
    monkeypatch.setitem(sys.modules, "ray._private.state", state)
    engine = ray_engine.RayEngine.__new__(ray_engine.RayEngine)
    engine.ray = StandInRay([])
    (node,) = engine._free_nodes()
    assert (node.cpus, node.memory) == (1.0, 3.0 * GIB)
    state.available_resources_per_node = lambda: ["not", "a", "mapping"]  # another Ray's shape: the totals
    (node,) = engine._free_nodes()
    assert (node.cpus, node.memory) == (2.0, 8.0 * GIB)
