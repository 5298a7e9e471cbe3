"""A 32-bit safetensors checkpoint loaded in 16 bits: the same model, read a tensor at a time (the peak memory
it saves is measured by bench/weights_memory.py, not asserted: it moves with what ran before it)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, GenerationConfig

from tests.tiny_decoders import build_tiny_decoder_dir
from tests.tiny_models import build_tiny_model
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
