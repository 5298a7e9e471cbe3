"""`unlimisum info`: versions, devices, faiss, model cache, and the index plan for --tokens N."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from unlimisum.cli import app
from unlimisum.cli.info import ASSUMED_D_MODEL
from unlimisum.config import DEFAULT_MODEL, IndexConfig


@pytest.fixture
def info(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("UNLIMISUM_MODEL", raising=False)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["info", *map(str, args)])


def test_plain_report_names_versions_devices_faiss_and_cache(info):
    result = info()
    assert result.exit_code == 0, result.output
    for heading in ("versions", "devices", "faiss", "models"):
        assert heading in result.stdout.splitlines()
    for label in ("unlimisum:", "torch:", "transformers:", "cuda:", "mps:", "build:", "HF_HOME:", "hub cache:"):
        assert label in result.stdout
    assert DEFAULT_MODEL in result.stdout
    assert "index plan" not in result.stdout  # only with --tokens


def test_json_report_with_a_plan_from_a_local_model_config(info, tiny_model_dir):
    result = info("--json", "--tokens", 5000, "-m", tiny_model_dir("bart"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"versions", "devices", "faiss", "models", "plan"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["devices"]["cuda_available"] == torch.cuda.is_available()
    assert report["models"]["hf_hub_offline"] is True
    assert report["models"]["model_available_offline"] is True
    plan = report["plan"]
    assert plan["tokens"] == 5000 and plan["d_model"] == 32 and plan["d_model_source"] == "model config"
    assert plan["kind"] in {"exact", "ivf", "hnsw"} and plan["reason"]
    if not torch.cuda.is_available():
        assert (plan["kind"], plan["device"]) == ("exact", "cpu")


def test_plan_without_a_local_model_assumes_768(info):
    tokens = IndexConfig().exact_max_tokens + 1
    result = info("--json", "--tokens", tokens, "-m", "no-such-org/no-such-model", "--index-device", "cpu")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert plan["d_model"] == ASSUMED_D_MODEL and plan["d_model_source"].startswith("assumed")
    assert plan["device"] == "cpu" and plan["kind"] == IndexConfig().approximate_kind  # above exact_max_tokens on the CPU
    plain = info("--tokens", tokens, "-m", "no-such-org/no-such-model", "--index-device", "cpu")
    assert f"index plan for {tokens:,} tokens" in plain.stdout and "reason:" in plain.stdout


@pytest.mark.parametrize("args", [["--tokens", "0"], ["--index", "kd-tree"], ["--index-device", "tpu"]])
def test_usage_errors_exit_2(info, args):
    assert info(*args).exit_code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_index_without_cuda_is_a_usage_error(info):
    result = info("--tokens", 10, "--index-device", "gpu")
    assert result.exit_code == 2
    assert "CUDA is not available" in result.stderr


def test_info_lists_the_supported_model_families():
    result = CliRunner().invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    families = json.loads(result.stdout)["models"]["supported_model_types"]
    assert {"bart", "led", "t5", "pegasus"} <= set(families)
