"""The install a user does: `pip install .` alone (no extras), then the console script as a person runs it.

Run by .ci/run's install stage (UNLIMISUM_INSTALLED_STAGE=1, in a fresh virtual environment holding the CPU torch,
unlimisum installed from the checkout, and pytest): each command runs the venv's `unlimisum` script in a folder of
its own, with the default path (no dtype or kernel override: ``--dtype auto`` picks bfloat16 where the CPU has 16-bit
units), an empty cache home and HF_HUB_OFFLINE, on tiny float32 safetensors checkpoints built here, as the hub's are.
Elsewhere (the README's suite, which installs the test extra and an editable checkout) these tests skip: what they
check is the installed package without extras, and that only the stage has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_decoders import build_tiny_decoder_dir
from tests.tiny_models import SAMPLE_TEXT, build_tiny_model

pytestmark = pytest.mark.skipif(os.environ.get("UNLIMISUM_INSTALLED_STAGE") != "1",
                                reason="the installed package without extras: .ci/run's install stage runs these")

SHORT = ["--max-new-tokens", "8", "--min-new-tokens", "4", "--num-beams", "1"]
BOOK = "".join(f"Chapter {number}: Part {number}\n\n{SAMPLE_TEXT * 3}\n\n" for number in (1, 2, 3))


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A folder with the checkpoints (float32 safetensors), a book with three chapters, and a long book."""
    root = tmp_path_factory.mktemp("installed")
    bart = build_tiny_model(root / "bart", "bart", window=64, d_model=32)
    qwen = build_tiny_decoder_dir(root / "qwen")
    assert (bart / "model.safetensors").is_file() and (qwen / "model.safetensors").is_file()
    (root / "book.txt").write_text(BOOK, encoding="utf-8")
    # from kernels.COMPILED_MIN_STATES (16,384) tokens a store runs (and first compiles) the compiled kernels (from
    # COMPILED_TOP_K_MIN_STATES, 8,192, the top-k alone)
    (root / "long.txt").write_text(SAMPLE_TEXT * 400, encoding="utf-8")
    return root


def unlimisum(place: Path, *args: str, home: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The venv's console script, run from an empty folder (not the checkout: the installed package answers)."""
    script = Path(sys.executable).with_name("unlimisum")
    assert script.is_file(), f"no console script beside {sys.executable}"
    cwd = place / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("UNLIMISUM_", "NUMBA_")) and key not in ("PYTHONPATH", "XDG_CACHE_HOME")}
    env.update(HF_HUB_OFFLINE="1", NO_COLOR="1", UNLIMISUM_CACHE_HOME=str(home or place / "home"))
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def succeeded(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-3000:]}"
    return run.stdout


def test_the_console_script_runs_the_installed_package(place):
    run = subprocess.run([sys.executable, "-c", "import unlimisum; print(unlimisum.__file__)"], cwd=place,
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    location = Path(succeeded(run).strip())
    assert "site-packages" in location.parts, location  # not the checkout's source: `pip install .`, not -e
    extras = subprocess.run([sys.executable, "-m", "pip", "show", "accelerate", "datasets", "rouge-score"],
                            capture_output=True, text=True)
    assert "Name:" not in extras.stdout, "the stage installs no extra; found: " + extras.stdout


@pytest.mark.parametrize("dtype", [[], ["--dtype", "bfloat16"]], ids=["default dtype", "bfloat16"])
def test_an_encoder_decoder_summarizes(place, dtype):
    summary = succeeded(unlimisum(place, "summarize", str(place / "book.txt"), "-m", str(place / "bart"),
                                  *SHORT, *dtype))
    assert summary.strip()


@pytest.mark.parametrize("dtype", [[], ["--dtype", "bfloat16"]], ids=["default dtype", "bfloat16"])
def test_a_decoder_only_model_summarizes(place, dtype):
    summary = succeeded(unlimisum(place, "summarize", str(place / "book.txt"), "-m", str(place / "qwen"),
                                  *SHORT, *dtype))
    assert summary.strip()


def test_per_chapter_with_evidence(place):
    summary = succeeded(unlimisum(place, "summarize", str(place / "book.txt"), "-m", str(place / "bart"), *SHORT,
                                  "--per-chapter", "--evidence"))
    assert summary.count("\n## ") >= 3, summary  # one section per chapter after the book's summary
    assert "[^1]" in summary, summary  # the first sentence's footnote of evidence


def test_an_html_page_into_a_folder(place):
    out = place / "pages"
    succeeded(unlimisum(place, "summarize", str(place / "book.txt"), "-m", str(place / "bart"), *SHORT,
                        "--format", "html", "-o", str(out)))
    page = out / "book.txt.summary.html"
    assert page.is_file() and "<html" in page.read_text(encoding="utf-8").lower()


def test_ingest_info_and_the_cache_list(place):
    assert "Chapter 3" in succeeded(unlimisum(place, "ingest", str(place / "book.txt")))
    assert "versions" in succeeded(unlimisum(place, "info"))
    cached = place / "encoded"
    succeeded(unlimisum(place, "summarize", str(place / "book.txt"), "-m", str(place / "bart"), *SHORT,
                        "--cache-dir", str(cached)))
    listing = unlimisum(place, "cache", "list", "--cache-dir", str(cached))
    assert "1 encoded book" in listing.stderr and succeeded(listing).strip()


def test_a_long_book_compiles_its_kernels_into_the_cache_home_never_into_the_package(place):
    """A read-only or shared install keeps working: nothing is written inside the installed package (checked by
    its files before and after, as root ignores a read-only mode), the kernels go to the cache home."""
    package = Path(subprocess.run([sys.executable, "-c", "import unlimisum, os; print(os.path.dirname("
                                   "unlimisum.__file__))"], cwd=place, capture_output=True, text=True).stdout.strip())
    before = {path: path.stat().st_mtime_ns for path in package.rglob("*")}
    home = place / "long-home"
    modes = {path: path.stat().st_mode for path in [package, *package.rglob("*")]}
    try:
        for path in modes:  # read-only, as a system-wide install is for a user
            path.chmod(path.stat().st_mode & ~0o222)
        summary = succeeded(unlimisum(place, "summarize", str(place / "long.txt"), "-m", str(place / "bart"),
                                      *SHORT, "--key-store", "per-layer", home=home))
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert summary.strip()
    assert {path: path.stat().st_mtime_ns for path in package.rglob("*")} == before
    assert list((home / "kernels").rglob("*.nbi")), "no compiled kernel was kept in the cache home"
    cleared = unlimisum(place, "cache", "clear", "--kernels", home=home)
    assert "removed" in cleared.stderr and not list((home / "kernels").rglob("*.nbi"))
