"""Shared fixtures: tiny random models saved to folders, built once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests compare against float32 references on every CPU: --dtype auto must not pick bfloat16 on CPUs with
# bf16 units (tests/test_precision.py covers that choice itself).
os.environ["UNLIMISUM_CPU_BFLOAT16"] = "0"
# What unlimisum measures once per machine (unlimisum/measurements.py) goes to a folder of this test session,
# shared with the processes the tests start (the first one measures, the others reuse), never ~/.cache.
_MEASUREMENTS = tempfile.mkdtemp(prefix="unlimisum-test-cache-")
os.environ["UNLIMISUM_CACHE_HOME"] = _MEASUREMENTS
atexit.register(shutil.rmtree, _MEASUREMENTS, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models gain nothing from threads, and two of them on two shared cores oversubscribe badly.
torch.set_num_threads(1)

from tests.tiny_models import build_tiny_model  # noqa: E402

ALL_FAMILIES = [
    "bart", "mbart", "pegasus", "marian", "led", "pegasus_x", "blenderbot", "blenderbot-small", "plbart",
    "t5", "mt5", "longt5",
]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir("bart")`` -> folder of a tiny random BART with a 64-token window (cached)."""
    built: dict[tuple, object] = {}

    def build(model_type: str = "bart", window: int = 64):
        key = (model_type, window)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"{model_type}-{window}")
            built[key] = build_tiny_model(folder, model_type, window=window)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """``tiny_loaded("t5")`` -> a LoadedModel of the tiny model (cached; do not mutate)."""
    from unlimisum.config import ModelConfig
    from unlimisum.models import load_model

    loaded: dict[str, object] = {}

    def load(model_type: str = "bart"):
        if model_type not in loaded:
            loaded[model_type] = load_model(ModelConfig(name=str(tiny_model_dir(model_type)), device="cpu"))
        return loaded[model_type]

    return load


@pytest.fixture(scope="session")
def _cached_loader():
    from tests.cli_helpers import CachedLoader
    from unlimisum import models

    return CachedLoader(models.load_model)


@pytest.fixture
def loader(_cached_loader, monkeypatch, request):
    """The real load_model behind a per-session cache, for the CLI tests; ``loader.calls`` counts the loads."""
    from unlimisum import models

    monkeypatch.setattr(models, "load_model", _cached_loader)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on a shared machine
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("UNLIMISUM_MODEL", raising=False)
    return _cached_loader


@pytest.fixture
def two_threads():
    """torch on two threads for the test (the suite runs on one), then as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
