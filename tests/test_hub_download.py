"""The first run with the default model: fetched from a hub, shown as our own bar; no hub, one quick error.

The hub is a stand-in on 127.0.0.1 (tests/hub_server.py) reached through HF_ENDPOINT, serving a tiny
BART under the default model's name, without tokenizer files as the real checkpoint, and the
tokenizer under ``facebook/bart-base``'s name: the real console script runs as on a person's first
use, HF_HUB_OFFLINE unset, with an empty Hugging Face cache.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests import test_cli_terminal
from tests.hub_server import StandInHub
from tests.test_cli_output import FakeClock, terminal
from tests.test_cli_process import console_script, process_env
from tests.tiny_models import build_tiny_model
from unlimisum.cli.progress import ProgressDisplay, format_bytes
from unlimisum.config import DEFAULT_MODEL
from unlimisum.models import checkpoint
from unlimisum.summarizer import ProgressEvent

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_REPO = "facebook/bart-base"
SUMMARIZE = ["summarize", "samples/story.epub", "--max-new-tokens", "8", "--min-new-tokens", "4",
             "--num-beams", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory):
    """{repo: folder}: the default model's name with a tiny BART's config and weights (about 3 MB, so
    that a download takes more than one read), and the base tokenizer's name with its tokenizer."""
    root = tmp_path_factory.mktemp("hub")
    full = build_tiny_model(root / "full", "bart", d_model=128)
    model, tokenizer = root / "model", root / "tokenizer"
    model.mkdir()
    tokenizer.mkdir()
    for path in full.iterdir():
        if path.name in {"config.json", "generation_config.json", "model.safetensors"}:
            shutil.copy(path, model / path.name)
        if path.name in {"config.json"} or path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(path, tokenizer / path.name)
    assert not checkpoint.has_tokenizer_files(checkpoint.Location("model", model))  # as the real checkpoint
    return {DEFAULT_MODEL: model, TOKENIZER_REPO: tokenizer}


# The stand-in hub answers from a thread of this process: on a busy machine (the suite beside a benchmark) an
# answer can take longer than the few seconds a real hub is given, so the runs here give it a minute.
PATIENT = {"UNLIMISUM_HUB_TIMEOUT": "60", "HF_HUB_ETAG_TIMEOUT": "60", "HF_HUB_DOWNLOAD_TIMEOUT": "60"}


def first_use_env(endpoint: str, home: Path, **extra) -> dict:
    """The environment of a person's first run: no HF_HUB_OFFLINE, the hub at ``endpoint``, an own cache."""
    env = dict(process_env(), HF_ENDPOINT=endpoint, HF_HOME=str(home), **PATIENT, **extra)
    env.pop("HF_HUB_OFFLINE")
    env.pop("UNLIMISUM_MODEL", None)
    env.pop("HF_HUB_CACHE", None)
    return env


def test_the_first_run_downloads_the_default_model_under_our_progress_bar(hub_repos, tmp_path, monkeypatch):
    weights = (hub_repos[DEFAULT_MODEL] / "model.safetensors").stat().st_size
    with StandInHub(hub_repos, bytes_per_second=1.5e6) as stand_in:  # about 2 s for the weights
        env = first_use_env(stand_in.url, tmp_path / "hf")
        monkeypatch.setattr(test_cli_terminal, "process_env", lambda: env)
        run = test_cli_terminal.run_terminal(console_script() + SUMMARIZE, ROOT)
        downloaded = list(stand_in.requests)

        transcript = run.transcript
        assert run.code == 0, transcript[-2000:]
        assert ("GET", f"/{DEFAULT_MODEL}/resolve/main/config.json") in downloaded
        assert any(method == "GET" and path.endswith("/model.safetensors") for method, path in downloaded)
        assert f"first use of {DEFAULT_MODEL}: downloading it into the Hugging Face cache" in transcript
        assert f"first use of {TOKENIZER_REPO}: downloading it" in transcript
        # our bar while the weights come: bytes so far of the total, the rate, the time left
        moving = re.findall(rf"downloading.*?(\d+\.\d) MiB/{re.escape(format_bytes(weights))} · "
                            r"[\d.]+ [KM]iB/s · [\dms.]+ s? ?left", transcript)
        assert moving and float(moving[0]) > 0, transcript[:3000]
        assert "it/s" not in transcript and "%|" not in transcript  # no tqdm of huggingface_hub's
        assert "Retrying" not in transcript and "Warning" not in transcript
        screen = "\n".join(run.screen)
        assert "done samples/story.epub" in screen
        assert "downloading" not in screen.split(f"first use of {TOKENIZER_REPO}")[-1].split("done")[-1]

        # the next run reads the cache: offline no request at all, online the listings only
        offline = subprocess.run(console_script() + SUMMARIZE, cwd=ROOT, env=dict(env, HF_HUB_OFFLINE="1"),
                                 capture_output=True, text=True, timeout=300)
        assert offline.returncode == 0, offline.stderr
        assert stand_in.requests == downloaded
        assert "first use" not in offline.stderr and offline.stdout.strip()

        online = subprocess.run(console_script() + SUMMARIZE, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300)
        assert online.returncode == 0, online.stderr
        asked = stand_in.requests[len(downloaded):]
        assert ("GET", f"/api/models/{DEFAULT_MODEL}/revision/main") in asked  # is there a newer commit?
        assert not any("/resolve/" in path for _, path in asked), asked  # no file is fetched again
        assert "first use" not in online.stderr


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_without_a_hub_the_first_run_fails_at_once_naming_every_download(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = first_use_env(endpoint, tmp_path / "hf")
    result = subprocess.run(console_script() + SUMMARIZE, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no retry warnings of huggingface_hub's
    assert f"the Hugging Face hub ({endpoint}) cannot be reached" in lines[0]
    assert f"`hf download {DEFAULT_MODEL}`" in lines[0] and f"`hf download {TOKENIZER_REPO} --include" in lines[0]
    # at once: huggingface_hub's retries (about 27 s of them) would be logged with -vv; none was made. (Not a
    # wall-clock limit: on a loaded machine starting Python and torch alone may take longer than the retries.)
    verbose = subprocess.run(console_script() + SUMMARIZE + ["-vv"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert verbose.returncode == 1 and "cannot be reached" in verbose.stderr
    for retry in ("Retrying in", "thrown while requesting"):
        assert retry not in verbose.stderr, verbose.stderr


def test_a_connection_lost_while_downloading_is_one_line_and_the_hub_warnings_are_for_vv(hub_repos, tmp_path):
    with StandInHub(hub_repos, cut=("model.safetensors",)) as stand_in:
        env = first_use_env(stand_in.url, tmp_path / "hf")
        plain = subprocess.run(console_script() + SUMMARIZE, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
        verbose = subprocess.run(console_script() + SUMMARIZE + ["-vv"], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=300)
    assert plain.returncode == verbose.returncode == 1
    error = [line for line in plain.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "downloading model.safetensors failed" in error[0], plain.stderr
    assert f"`hf download {DEFAULT_MODEL}`" in error[0]
    assert "Trying to resume" not in plain.stderr  # huggingface_hub's retries, under the display otherwise
    assert "Trying to resume" in verbose.stderr


def test_the_download_bar_counts_bytes_with_rate_and_time_left():
    console, clock = terminal(), FakeClock()
    display = ProgressDisplay(console, clock=clock, auto_refresh=False)
    mib = 2**20
    with display:
        display.loading_model("org/model")
        display(ProgressEvent("download", 0, 4 * mib, "org/model", {"files": 1, "file": "model.safetensors"}))
        clock.now += 2.0
        display(ProgressEvent("download", mib, 4 * mib, "org/model", {"files": 1, "file": "model.safetensors"}))
        display.refresh()
        drawn = console.file.getvalue()
        display(ProgressEvent("download", 4 * mib, 4 * mib, "org/model", {"files": 1}))
        display(ProgressEvent("download", 4 * mib, 4 * mib, "org/model", {"files": 1}))  # the closing report
        display.refresh()
        after = console.file.getvalue()[len(drawn):]
    assert "first use of org/model: downloading it into the Hugging Face cache" in drawn
    assert "1.0 MiB/4.0 MiB · 512.0 KiB/s · 6.0 s left" in drawn
    assert "loading model org/model" in after and "downloading" not in after and "first use" not in after


def test_the_files_from_pretrained_reads_are_the_ones_fetched():
    from unlimisum.models import hub

    sizes = {name: 1 for name in (
        "config.json", "generation_config.json", "tokenizer.json", "merges.txt", "spiece.model", "README.md",
        "model.safetensors", "pytorch_model.bin", "flax_model.msgpack", "tf_model.h5", "training_args.bin",
        "modeling_custom.py",
    )}
    text = ["config.json", "generation_config.json", "merges.txt", "spiece.model", "tokenizer.json"]
    assert hub.needed_files(sizes, weights=False) == text
    assert hub.needed_files(sizes, weights=True) == text + ["model.safetensors"]
    del sizes["model.safetensors"]
    assert hub.needed_files(sizes, weights=True) == text + ["pytorch_model.bin"]
    assert "modeling_custom.py" in hub.needed_files(sizes, weights=False, code=True)
    shards = {"model.safetensors.index.json": 1, "model-00001-of-00002.safetensors": 1,
              "model-00002-of-00002.safetensors": 1, "consolidated.safetensors": 1, "params.json": 1}
    assert hub.needed_files(shards, weights=True) == [
        "model.safetensors.index.json", "params.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors"]


def test_the_hub_can_be_given_longer_to_answer(monkeypatch):
    from unlimisum.models import hub

    monkeypatch.delenv(hub.PROBE_SETTING, raising=False)
    assert hub.probe_seconds() == hub.PROBE_SECONDS
    for value, seconds in (("30", 30.0), ("0.5", 0.5), ("soon", hub.PROBE_SECONDS), ("-1", hub.PROBE_SECONDS)):
        monkeypatch.setenv(hub.PROBE_SETTING, value)
        assert hub.probe_seconds() == seconds
