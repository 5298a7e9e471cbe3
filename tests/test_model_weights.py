"""A 32-bit safetensors checkpoint loaded in 16 bits: the same model, without the whole file held while loading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, GenerationConfig

from tests.tiny_decoders import build_tiny_decoder_dir
from tests.tiny_models import build_tiny_model, build_tokenizer, tiny_config
from unlimisum.config import ModelConfig
from unlimisum.models import load_model, weights


def _same_model(ours, theirs) -> None:
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    for name, tensor in theirs_state.items():
        assert ours_state[name].dtype == tensor.dtype and torch.equal(ours_state[name], tensor), name
    assert type(ours) is type(theirs) and ours.generation_config.to_dict() == theirs.generation_config.to_dict()


@pytest.mark.parametrize("shards", [False, True])
def test_a_float32_checkpoint_loads_in_bfloat16_as_transformers_loads_it(tmp_path, shards):
    folder = build_tiny_model(tmp_path / "bart")
    if shards:  # the shards of an index instead of one file
        model = AutoModelForSeq2SeqLM.from_pretrained(folder)
        (folder / "model.safetensors").unlink()
        model.save_pretrained(folder, max_shard_size="20KB")
        assert (folder / weights.SHARD_INDEX).is_file() and len(weights.safetensors_files(folder)) > 1
    GenerationConfig(num_beams=3, length_penalty=2.0, max_length=40, decoder_start_token_id=2).save_pretrained(folder)
    loaded = load_model(ModelConfig(name=str(folder), device="cpu", dtype="bfloat16"))
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.bfloat16)
    _same_model(loaded.model, reference)
    assert loaded.model.generation_config.num_beams == 3  # the folder's generation config, not the model config's
    # tied embeddings stay tied
    assert loaded.model.get_output_embeddings().weight.data_ptr() == loaded.model.get_input_embeddings().weight.data_ptr()


def test_only_wider_safetensors_take_the_tensor_by_tensor_path(tmp_path):
    folder = build_tiny_model(tmp_path / "bart")
    config = AutoConfig.from_pretrained(folder)
    assert weights.load_converted("seq2seq", folder, config, torch.float32) is None  # nothing to narrow
    assert weights.load_converted("seq2seq", folder, config, torch.bfloat16) is not None
    half = tmp_path / "half"
    AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(half)
    assert weights.load_converted("seq2seq", half, config, torch.float16) is None  # stored in 16 bits already
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    torch.save(AutoModelForSeq2SeqLM.from_pretrained(folder).state_dict(), pickled / "pytorch_model.bin")
    assert weights.safetensors_files(pickled) == [] and weights.load_converted("seq2seq", pickled, config,
                                                                              torch.bfloat16) is None


def test_a_decoder_only_float32_checkpoint_loads_in_bfloat16_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_decoder_dir(tmp_path / "qwen2", "qwen2")
    if not weights.safetensors_files(folder):
        pytest.skip("the tiny decoder is not saved as safetensors")
    loaded = load_model(ModelConfig(name=str(folder), device="cpu", dtype="bfloat16"))
    _same_model(loaded.model, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16))


PEAK_SCRIPT = """
import json, resource, sys
import psutil
from unlimisum.config import ModelConfig
from unlimisum.models import load_model
load_model(ModelConfig(name=sys.argv[2], device="cpu", dtype="bfloat16"))  # every module imported, once
before = psutil.Process().memory_info().rss
loaded = load_model(ModelConfig(name=sys.argv[1], device="cpu", dtype="bfloat16"))
print(json.dumps({"before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_loading_a_float32_checkpoint_in_bfloat16_does_not_hold_the_whole_file(tmp_path):
    """In a fresh process, loading ~260 MiB of float32 weights (many 8 MiB tensors) in bfloat16 adds the bfloat16
    weights (half the file) and what is in flight (measured 0.9-1.4x the file in all, depending on what ran
    before on the machine), not the whole file memory-mapped beside them (1.50x the file, every run: what
    transformers' own loading holds at its peak)."""
    folder = tmp_path / "wide"
    tokenizer = build_tokenizer(folder)
    config = tiny_config("bart", tokenizer, d_model=512)
    config.encoder_layers = config.decoder_layers = 6
    config.encoder_ffn_dim = config.decoder_ffn_dim = 4096
    model = AutoModelForSeq2SeqLM.from_config(config)
    model.save_pretrained(folder)
    file_bytes = (folder / "model.safetensors").stat().st_size
    assert file_bytes > 250 * 2**20
    small = build_tiny_model(tmp_path / "small")
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder), str(small)], capture_output=True, text=True,
                          check=True, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": ""})
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["peak"] - figures["before"] < 1.45 * file_bytes, (figures, file_bytes)
