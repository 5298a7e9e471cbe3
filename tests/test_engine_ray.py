"""`summarize --engine ray` on one local Ray instance (2 CPUs) shared by the module, with a tiny BART.

Skipped when Ray is not installed (`pip install -e ".[ray]"`). Greedy decoding: the Ray run's
files and stdout must equal the local run's, byte for byte.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tests.cli_helpers import write_small_books
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.engines.progress import BatchProgress
from unlimisum.engines.ray import CRASH_HOOK_ENV, start_local_ray

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray instance and worker processes: 50-90 s on 2 shared CPU cores

FAST = ["--device", "cpu", "--max-new-tokens", "6", "--min-new-tokens", "3"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for the module, started as the engine starts one (on 127.0.0.1, no dashboard);
    the engine uses the one this process already has."""
    folder = start_local_ray(ray, num_cpus=2, log_to_driver=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


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
