"""`unlimisum info`: versions, devices, faiss, model cache, and the index plan for --tokens N."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from unlimisum.cli import app
from unlimisum.diagnostics import ASSUMED_D_MODEL
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
    assert set(report) == {"versions", "devices", "faiss", "models", "plan", "measurements"}
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


def test_a_model_folder_that_does_not_exist_is_named_not_offered_for_download(info, tmp_path):
    """As summarize says it: a path is a folder, never a hub name (no `hf download /the/path` advice)."""
    missing = tmp_path / "no-model"
    result = info("-m", missing, "--tokens", 100)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == f"unlimisum: error: model folder '{missing}' does not exist"


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


@pytest.mark.parametrize("family, full_layers", [("qwen2", 2), ("gemma2", 1)])
def test_a_decoder_only_model_gets_its_own_plan(info, tmp_path, family, full_layers):
    """Window, sinks, k, position regime, the store's bytes by 2 x full layers x KV heads x head dim x 2 (bfloat16),
    and placement; not the encoder-decoder index plan."""
    from tests.tiny_decoders import build_tiny_decoder_dir

    folder = build_tiny_decoder_dir(tmp_path / family, family)  # 4,096 positions, 2 KV heads of 16
    short, fits, long = (json.loads(info("--json", "--tokens", n, "-m", folder, "--index-device", "cpu").stdout)[
        "plan"] for n in (1000, 3000, 10_000))
    assert short["model_kind"] == long["model_kind"] == "decoder-only" and "d_model" not in short
    assert short["window"] == 1024 and short["retrieval_k"] == 1024  # a quarter of the positions; k the window
    # a prompt that fits is its own window, read in chunks of a quarter of the positions; a longer one retrieves
    assert (fits["exact"], fits["window"], fits["chunk"]) == (True, 2999, 1024) and short["exact"]
    assert (long["exact"], long["window"], long["chunk"]) == (False, 1024, 1024)
    assert "the whole prompt attended exactly" in info("--tokens", 3000, "-m", folder, "--index-device", "cpu").stdout
    assert short["positions"] == "true" and long["positions"] == "fixed distance 1024"
    assert short["store_bytes_per_token"] == 2 * full_layers * 2 * 16 * 2
    assert long["store_bytes"] == 9_999 * short["store_bytes_per_token"]
    assert (short["full_layers"], short["sliding_layers"]) == (full_layers, 2 - full_layers)
    assert (short["keys_device"], short["values_device"]) == ("cpu", "cpu")
    plain = info("--tokens", 10_000, "-m", folder, "--index-device", "cpu").stdout
    assert "decoder-only plan for a prompt of 10,000 tokens" in plain and "index plan" not in plain
    assert f"{short['store_bytes_per_token']:,} bytes per prompt token (2 x {full_layers} full-attention" in plain
    assert "positions:" in plain and "fixed distance 1024" in plain and "placement:" in plain
    small = build_tiny_decoder_dir(tmp_path / "small", family, max_positions=256)  # 64 + 257 > 256 positions
    refused = json.loads(info("--json", "--tokens", 1000, "-m", small, "--index-device", "cpu").stdout)["plan"]
    assert refused["positions"].startswith("refused: ") and "lower --window or --max-new-tokens" in refused["positions"]


def test_plan_says_when_a_store_would_be_too_large_to_pack(info, tiny_model_dir, monkeypatch):
    from unlimisum.search import kernels, packed

    if not packed.available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "packed")
    folder = tiny_model_dir("bart")
    small = json.loads(info("--json", "--tokens", 5000, "-m", folder, "--index-device", "cpu").stdout)["plan"]
    assert small["retrieval_kernel"].startswith("packed scores")
    monkeypatch.setattr(packed, "PACKED_MEMORY_FRACTION", 1e-12)
    large = json.loads(info("--json", "--tokens", 5000, "-m", folder, "--index-device", "cpu").stdout)["plan"]
    assert large["retrieval_kernel"].startswith("float32 for 5,000 tokens: the packed copies")
    assert kernels.SCORE_KERNELS == ("native", "float32", "packed")


def _cache_repo(hub_cache, repo: str, *files: str) -> None:
    """Put ``files`` of ``repo`` into a Hugging Face hub cache laid out as huggingface_hub writes it."""
    folder = hub_cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text("0" * 40, encoding="utf-8")
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files:
        (snapshot / name).write_text("{}", encoding="utf-8")


def test_offline_without_the_default_model_says_summarize_will_fail_and_names_every_download(tmp_path):
    """The user's conditions: HF_HUB_OFFLINE=1 and an empty cache, through the console script."""
    import subprocess

    from tests.test_cli_process import console_script, process_env

    env = {**process_env(), "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run([*console_script(), "info"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    (available,) = [line for line in result.stdout.splitlines() if "available offline:" in line]
    assert "summarize will fail" in available and "HF_HUB_OFFLINE is on" in available, available
    assert "downloaded on first use" not in result.stdout
    assert f"hf download {DEFAULT_MODEL}\n" in result.stdout
    assert 'hf download facebook/bart-base --include "*.json"' in result.stdout  # the tokenizer it is loaded with


@pytest.mark.parametrize("cached, missing", [
    ([], [DEFAULT_MODEL, "facebook/bart-base"]),
    ([DEFAULT_MODEL], ["facebook/bart-base"]),
    ([DEFAULT_MODEL, "facebook/bart-base"], []),
])
def test_available_offline_counts_the_checkpoint_and_the_tokenizer_it_needs(info, tmp_path, monkeypatch, cached,
                                                                            missing):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for repo in cached:
        _cache_repo(tmp_path, repo, "config.json" if repo == DEFAULT_MODEL else "vocab.json")
    models = json.loads(info("--json").stdout)["models"]
    assert models["tokenizer_from"] == "facebook/bart-base"
    assert models["missing_offline"] == missing
    assert [command.split()[2] for command in models["fetch_commands"]] == missing
    text = info().stdout
    (available,) = [line for line in text.splitlines() if "available offline:" in line]
    assert available.endswith("yes") if not missing else "summarize will fail" in available
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert ("downloaded on first use" in info().stdout) == bool(missing)


def test_info_lists_what_was_measured_on_this_machine_and_how_to_measure_again(info, monkeypatch, tmp_path):
    from unlimisum.models import precision

    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("UNLIMISUM_CPU_BFLOAT16")  # --dtype auto measures
    precision._cpu_speedup.cache_clear()
    try:
        first = json.loads(info("--json").stdout)["measurements"]
        names = [entry["name"] for entry in first["entries"]]
        assert names == ["cpu bfloat16 speedup"] and first["file"] == str(tmp_path / "measurements.json")
        when = first["entries"][0]["measured_at"]
        plain = info().stdout
        assert "measured on this machine" in plain and "cpu bfloat16 speedup" in plain
        assert "unlimisum info --remeasure" in plain and str(tmp_path) in plain
        precision._cpu_speedup.cache_clear()  # a new process: the measurement is read back, not made again
        assert json.loads(info("--json").stdout)["measurements"]["entries"][0]["measured_at"] == when
        again = json.loads(info("--json", "--remeasure").stdout)["measurements"]["entries"]
        assert [entry["name"] for entry in again] == ["cpu bfloat16 speedup"]  # forgotten, then measured anew
    finally:
        precision._cpu_speedup.cache_clear()


def test_remeasure_forgets_the_machine_under_every_thread_count_and_its_compiled_kernels(info, monkeypatch,
                                                                                           tmp_path):
    from unlimisum import measurements
    from unlimisum.models import precision

    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    identity = measurements.machine_identity()
    for threads in ("1", "7"):  # what Ray workers of other thread counts kept
        monkeypatch.setattr(measurements, "machine_identity", lambda t=threads: dict(identity, threads=t))
        measurements.MeasurementStore().put(measurements.Measurement("x", 1, "2026-01-01T00:00:00+00:00", 0.1, ""))
    monkeypatch.setattr(measurements, "machine_identity", lambda: identity)
    kernels = tmp_path / "kernels" / "search_1a2b"
    kernels.mkdir(parents=True)
    for name in ("compiled._sums_f32-630.py311.nbi", "compiled_loops._scores_bf16-180.py311.1.nbc"):
        (kernels / name).write_bytes(b"machine code")
    (kernels / "other.program-1.py311.nbi").write_bytes(b"someone else's")
    shown = info().stdout
    assert "compiled kernels:  2 files" in shown
    precision._cpu_speedup.cache_clear()
    try:
        info("--remeasure")
    finally:
        precision._cpu_speedup.cache_clear()
    kept = json.loads((tmp_path / "measurements.json").read_text())
    assert [name for entry in kept.values() for name in entry["measurements"]] in ([], ["cpu bfloat16 speedup"])
    assert sorted(path.name for path in kernels.iterdir()) == ["other.program-1.py311.nbi"]


def test_cache_clear_knows_every_module_whose_kernels_numba_caches():
    """numba names a cached kernel's files after its module: a module of the search that compiles kernels and is
    not in KERNEL_MODULES would leave them behind `cache clear --kernels` and `info --remeasure`."""
    from pathlib import Path

    from unlimisum import diagnostics

    search = Path(diagnostics.__file__).parent / "search"
    compiling = {path.stem for path in search.glob("*.py")  # jit.py's decorations, or numba's own
                 if "jit.begin_decorations()" in path.read_text()
                 or "numba.njit(" in path.read_text() and path.stem != "jit"}
    assert {"compiled_loops", "linear_loops", "grouped_loops"} <= compiling, compiling
    assert compiling <= set(diagnostics.KERNEL_MODULES), compiling
