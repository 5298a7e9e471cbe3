"""Fitting λ, η, g of a frozen model, and the `unlimisum tc fit` command."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.errors import ConfigError
from unlimisum.tensor_cache import TensorCacheSettings, load_params, tensor_cache
from unlimisum.tensor_cache.self_attention import installed_wrappers, wrapped_self_attention
from unlimisum.tensor_cache.fit import FitSettings, fit_tensor_cache

TEXTS = [SAMPLE_TEXT * 4, SAMPLE_TEXT * 3]
QUICK = FitSettings(window=6, context=24, steps=3, batch_size=2, encoder_tokens=12)


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_fit_learns_only_the_tensor_cache_constants(tiny_loaded, model_type):
    loaded = tiny_loaded(model_type)
    model = loaded.model
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    report = fit_tensor_cache(model, loaded.tokenizer, TEXTS, settings=QUICK, architecture=loaded.architecture)

    for name, parameter in model.named_parameters():  # frozen and restored
        assert torch.equal(parameter, weights[name]), name
        assert parameter.requires_grad == flags[name]
    assert installed_wrappers(model, loaded.architecture) == []
    params = report.params
    layers = len(loaded.architecture.decoder_layers(model))
    assert params.decay_logit.shape[0] == params.write_logit.shape[0] == params.gate_logit.shape[0] == layers
    assert params.gate_logit.shape[1] == 1  # one gate per layer by default
    # a memory projection of its own per layer, started from out_proj and moved by the fit
    with wrapped_self_attention(model, loaded.architecture) as wrappers:
        out_proj = torch.stack([wrapper._projection("output").weight.detach() for wrapper in wrappers])
        heads, head_dim = wrappers[0].num_heads, wrappers[0].head_dim
    assert params.projection == "own" and report.summary()["projection"] == "own"
    assert params.memory_projection.shape == out_proj.shape
    assert not torch.equal(params.memory_projection, out_proj)
    # started at out_proj: Adam moves an entry by at most about its learning rate per step
    assert (params.memory_projection - out_proj).abs().max() <= 1.01 * QUICK.steps * QUICK.projection_learning_rate
    assert not torch.allclose(params.gate_logit, torch.full_like(params.gate_logit, QUICK.init_gate_logit))
    # a query map per head, started at identity and moved by the fit as much as Adam's rate allows
    identity = torch.eye(head_dim).expand(layers, heads, head_dim, head_dim)
    assert params.memory_query_map.shape == identity.shape and report.summary()["query_map"] is True
    assert 0 < (params.memory_query_map - identity).abs().max() <= 1.01 * QUICK.steps * QUICK.query_map_learning_rate
    # a write gate per KV head, started at zero (strength 1) and moved likewise
    assert params.memory_write_gate.shape == (layers, heads, head_dim + 1) and report.summary()["write_gate"] is True
    assert 0 < params.memory_write_gate.abs().max() <= 1.01 * QUICK.steps * QUICK.write_gate_learning_rate
    assert len(report.losses) == QUICK.steps and all(map(torch.isfinite, torch.tensor(report.losses)))
    # near positions (t < W) cannot see L2: sliding window and Tensor Cache agree there
    assert report.nll["tensor_cache"]["near"] == pytest.approx(report.nll["sliding_window"]["near"], rel=1e-6)
    assert set(report.nll) == {"full", "sliding_window", "tensor_cache"}
    assert report.held_out_blocks >= 1 and report.train_blocks >= 1


def test_the_chunked_and_dense_forms_fit_alike_and_auto_picks_one(tiny_loaded):
    """Chunks of 5 (uneven against the context of 24) and the dense form: the same losses, fitted numbers and
    held-out report, the sliding-window and full-cache baselines included; "auto" times both and says which ran."""
    from dataclasses import replace

    loaded = tiny_loaded("t5")
    dense = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=replace(QUICK, chunk=None),
                             architecture=loaded.architecture)
    chunked = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=replace(QUICK, chunk=5),
                               architecture=loaded.architecture)
    assert dense.chunk is None and chunked.chunk == 5 and chunked.params.report["chunk"] == 5
    torch.testing.assert_close(torch.tensor(chunked.losses), torch.tensor(dense.losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.params.memory_write_gate, dense.params.memory_write_gate, rtol=1e-4, atol=1e-5)
    for mode in dense.nll:
        assert chunked.nll[mode] == pytest.approx(dense.nll[mode], rel=1e-5), mode
    auto = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=replace(QUICK, chunk="auto", context=40),
                            architecture=loaded.architecture)
    assert auto.chunk in (None, 32) and auto.summary()["chunk"] == auto.chunk  # the chunk sizes below the context
    with pytest.raises(ConfigError, match="--chunk"):
        FitSettings(chunk=0)


def test_a_tied_fit_learns_no_projection_and_the_own_one_starts_from_it(tiny_loaded):
    """--tie-projection: the memory reads through out_proj; only λ, η and the gate are learned. The own
    projection starts as a copy of out_proj, so both fits see the same first loss."""
    from dataclasses import replace

    loaded = tiny_loaded("bart")
    settings = replace(QUICK, init_gate_logit=0.0)  # γ0 = 0.5: the memory read matters from the first step
    tied = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=replace(settings, tie_projection=True),
                            architecture=loaded.architecture)
    assert tied.params.memory_projection is None and tied.params.projection == "tied"
    assert tied.summary()["projection"] == "tied"
    assert not torch.allclose(tied.params.gate_logit, torch.zeros_like(tied.params.gate_logit))
    own = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=settings, architecture=loaded.architecture)
    assert own.losses[0] == pytest.approx(tied.losses[0], rel=1e-6)
    assert own.params.memory_projection is not None


def test_fitted_parameters_drive_generate(tiny_loaded, tmp_path):
    loaded = tiny_loaded("bart")
    report = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=QUICK, architecture=loaded.architecture)
    from unlimisum.tensor_cache import save_params

    path = save_params(report.params, tmp_path / "tc.safetensors")
    tokens = loaded.tokenizer(["A short text."], return_tensors="pt")
    with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(params=path)) as session:
        assert session.window == QUICK.window and not session.gate_closed
        with torch.no_grad():
            out = loaded.model.generate(**tokens, max_new_tokens=20, min_new_tokens=20, **session.generate_kwargs())
        assert out.shape[1] >= 20 and session.retained_bytes() > 0


def test_a_fit_continues_from_a_file_of_this_model(tiny_loaded, tmp_path):
    """start=: every fitted tensor begins where the earlier fit ended (zero steps give it back unchanged), and
    all of them move on; a file of another shape is refused, naming what does not fit."""
    from dataclasses import replace

    from unlimisum.tensor_cache import save_params

    loaded = tiny_loaded("bart")
    first = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=QUICK, architecture=loaded.architecture)
    save_params(first.params, tmp_path / "first.safetensors")
    earlier = load_params(tmp_path / "first.safetensors")
    names = ("decay_logit", "write_logit", "gate_logit", "memory_projection", "memory_query_map", "memory_write_gate")
    unchanged = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=replace(QUICK, steps=0),
                                 architecture=loaded.architecture, start=earlier).params
    for name in names:
        torch.testing.assert_close(getattr(unchanged, name), getattr(first.params, name), rtol=0, atol=0)
    moved = fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=QUICK, architecture=loaded.architecture,
                             start=earlier).params
    for name in names:
        assert not torch.equal(getattr(moved, name), getattr(first.params, name)), name
    with pytest.raises(ConfigError, match="query map of shape"):
        bad = replace(earlier, memory_query_map=earlier.memory_query_map[:, :, :2, :2])
        fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=QUICK, architecture=loaded.architecture,
                         start=bad)
    with pytest.raises(ConfigError, match="gate_logit of shape"):
        fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=replace(QUICK, gate="head"),
                         architecture=loaded.architecture, start=earlier)


def test_fit_explains_too_little_text(tiny_loaded):
    loaded = tiny_loaded("bart")
    with pytest.raises(ConfigError, match="at least 2"):
        fit_tensor_cache(loaded.model, loaded.tokenizer, ["Too short."], settings=QUICK)
    with pytest.raises(ConfigError, match="no far positions"):
        fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=FitSettings(window=30, context=24))
    with pytest.raises(ConfigError, match="exceeds the decoder"):
        fit_tensor_cache(loaded.model, loaded.tokenizer, TEXTS, settings=FitSettings(window=6, context=1000))


def test_tc_fit_command_writes_a_loadable_file(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("bart")
    text = tmp_path / "book.txt"
    text.write_text(SAMPLE_TEXT * 4)
    out = tmp_path / "tc.safetensors"
    result = CliRunner().invoke(app, [
        "tc", "fit", "--model", str(folder), "--text", str(text), "--text", str(text), "--window", "6",
        "--context", "24", "--steps", "2", "--batch-size", "2", "--encoder-tokens", "12", "--device", "cpu",
        "--out", str(out), "--json",
    ])
    assert result.exit_code == 0, result.output
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(numbers["nll"]) == {"full", "sliding_window", "tensor_cache"}
    params = load_params(out)
    assert params.window == 6 and params.model_type == "bart" and params.projection == "own"
    assert params.report["nll_held_out"] == numbers["nll"]
    tied = tmp_path / "tied.safetensors"
    result = CliRunner().invoke(app, [
        "tc", "fit", "--model", str(folder), "--text", str(text), "--text", str(text), "--window", "6",
        "--context", "24", "--steps", "2", "--batch-size", "2", "--encoder-tokens", "12", "--device", "cpu",
        "--out", str(tied), "--tie-projection", "--no-query-map", "--no-write-gate",
    ])
    assert result.exit_code == 0, result.output
    bare = load_params(tied)
    assert bare.projection == "tied" and bare.memory_query_map is None and bare.memory_write_gate is None
    assert params.memory_query_map is not None and params.memory_write_gate is not None
    assert tied.stat().st_size < out.stat().st_size


def test_tc_fit_command_reports_unreadable_input(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(app, [
        "tc", "fit", "--model", str(tiny_model_dir("bart")), "--text", str(tmp_path / "missing.txt"),
        "--out", str(tmp_path / "tc.safetensors"),
    ])
    assert result.exit_code == 1
    assert "missing.txt" in result.output


def test_tc_fit_command_refuses_a_chunk_it_cannot_use(tiny_model_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(SAMPLE_TEXT * 4)
    for bad in ("fast", "0"):
        result = CliRunner().invoke(app, [
            "tc", "fit", "--model", str(tiny_model_dir("bart")), "--text", str(text), "--chunk", bad,
            "--out", str(tmp_path / "tc.safetensors"),
        ])
        assert result.exit_code == 2, result.output
        assert "--chunk must be" in result.output and not (tmp_path / "tc.safetensors").exists()


def test_tc_fit_command_continues_from_a_file(tiny_model_dir, tmp_path):
    """--start FILE: the fit goes on from an earlier one of the same model; one of another model is refused."""
    text = tmp_path / "book.txt"
    text.write_text(SAMPLE_TEXT * 4)

    def fit(folder, out, *extra):
        return CliRunner().invoke(app, [
            "tc", "fit", "--model", str(folder), "--text", str(text), "--text", str(text), "--window", "6",
            "--context", "24", "--steps", "2", "--batch-size", "2", "--encoder-tokens", "12", "--device", "cpu",
            "--out", str(out), *extra,
        ])

    bart = tiny_model_dir("bart")
    assert fit(bart, tmp_path / "first.safetensors").exit_code == 0
    result = fit(bart, tmp_path / "second.safetensors", "--start", str(tmp_path / "first.safetensors"))
    assert result.exit_code == 0, result.output
    first, second = load_params(tmp_path / "first.safetensors"), load_params(tmp_path / "second.safetensors")
    assert second.memory_write_gate.shape == first.memory_write_gate.shape
    assert not torch.equal(second.memory_write_gate, first.memory_write_gate)
    refused = fit(tiny_model_dir("t5"), tmp_path / "t5.safetensors", "--start", str(tmp_path / "first.safetensors"))
    assert refused.exit_code == 2 and "fitted on a bart model" in refused.output
    missing = fit(bart, tmp_path / "third.safetensors", "--start", str(tmp_path / "none.safetensors"))
    assert missing.exit_code != 0 and "none.safetensors" in missing.output
