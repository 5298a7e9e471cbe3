"""--dtype auto on a CPU: bfloat16 where measured faster, float32 elsewhere; the needle model agrees in both."""

from __future__ import annotations

import pytest
import torch

from tests.test_needle import FIXTURE, GENERATION, make_input
from unlimisum.config import IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model, precision
from unlimisum.document import Document
from unlimisum.summarizer import Summarizer

CPU = torch.device("cpu")


def test_auto_is_bfloat16_only_where_measured_faster(monkeypatch):
    monkeypatch.delenv("UNLIMISUM_CPU_BFLOAT16", raising=False)
    monkeypatch.setattr(precision, "cpu_speedup", lambda dtype: 2.6)
    fast = precision.choose_auto_dtype(CPU)
    assert fast.dtype == torch.bfloat16 and "2.6x faster" in fast.reason
    monkeypatch.setattr(precision, "cpu_speedup", lambda dtype: 0.4)
    slow = precision.choose_auto_dtype(CPU)
    assert slow.dtype == torch.float32 and "0.40x" in slow.reason
    monkeypatch.setenv("UNLIMISUM_CPU_BFLOAT16", "1")
    assert precision.choose_auto_dtype(CPU).dtype == torch.bfloat16


def test_the_measurement_is_a_positive_ratio(monkeypatch, tmp_path):
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))
    precision._cpu_speedup.cache_clear()
    try:
        assert precision.cpu_speedup(torch.bfloat16) > 0
    finally:
        precision._cpu_speedup.cache_clear()


def fake_timer(seconds: dict[str, float], calls: list[str]):
    """A timer for measurements.race that says each candidate (told apart by the dtype of what it returns) took
    ``seconds[dtype]``, and notes each call in ``calls``; the candidate itself runs (it is a small matmul)."""
    def timer(run):
        name = str(run().dtype).removeprefix("torch.")
        calls.append(name)
        return seconds[name]
    return timer


def test_a_cpu_without_16_bit_units_is_settled_by_the_small_shape_with_one_16_bit_call():
    calls = []
    speedup, reason = precision.measure_cpu_speedup(torch.bfloat16, timer=fake_timer(
        {"float32": 0.001, "bfloat16": 0.05}, calls), shapes=((4, 8, 8), (16, 8, 32)))
    assert speedup == pytest.approx(0.02) and "[4x8]x[8x8]" in reason and "[16x8]" not in reason
    assert calls.count("bfloat16") == 1  # the clear loser is called once; the larger shape never runs
    assert calls.count("float32") >= 2


def test_a_cpu_with_16_bit_units_is_measured_at_the_encoders_shape():
    calls = []
    speedup, reason = precision.measure_cpu_speedup(torch.bfloat16, timer=fake_timer(
        {"float32": 0.003, "bfloat16": 0.001}, calls), shapes=((4, 8, 8), (16, 8, 32)))
    assert speedup == pytest.approx(3.0) and "[16x8]x[8x32]" in reason


def test_a_slow_first_call_of_the_16_bit_matmul_does_not_decide_it(monkeypatch):
    """oneDNN writes a shape's kernel at its first call: that call, 100x the others on a Zen 4 with bf16 units, once
    made the race drop bfloat16 as the clear loser and keep float32 for the machine. Each candidate is called once
    before the race, untimed."""
    called = {"float32": 0, "bfloat16": 0}
    real = torch.Tensor.__matmul__

    def matmul(a, b):
        called[str(a.dtype).removeprefix("torch.")] += 1
        return real(a, b)

    def timer(run):
        name = str(run().dtype).removeprefix("torch.")
        first_timed = called[name] == 1  # the warm-up call was not timed: this would be the kernel's first call
        return 0.1 if first_timed and name == "bfloat16" else {"float32": 0.003, "bfloat16": 0.001}[name]

    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    speedup, _ = precision.measure_cpu_speedup(torch.bfloat16, timer=timer, shapes=((4, 8, 8), (16, 8, 32)))
    assert speedup == pytest.approx(3.0)


def test_a_16_bit_dtype_asked_for_where_it_is_much_slower_gets_a_warning(monkeypatch):
    monkeypatch.setattr(precision, "cpu_speedup", lambda dtype: 0.02)
    choice = precision.check_asked_dtype(torch.bfloat16, CPU)
    assert choice is not None and "50x slower than float32" in choice and "--dtype float32" in choice
    assert precision.check_asked_dtype(torch.float32, CPU) is None
    monkeypatch.setattr(precision, "cpu_speedup", lambda dtype: 2.0)
    assert precision.check_asked_dtype(torch.float16, CPU) is None


def test_load_model_carries_the_warning(monkeypatch):
    monkeypatch.setattr(precision, "cpu_speedup", lambda dtype: 0.05)
    loaded = load_model(ModelConfig(name=str(FIXTURE), device="cpu", dtype="bfloat16"))
    assert loaded.dtype_warning and "20x slower" in loaded.dtype_warning


def test_needle_answers_agree_in_bfloat16_and_float32():
    torch.set_num_threads(1)
    float32 = load_model(ModelConfig(name=str(FIXTURE), device="cpu", dtype="float32"))
    bfloat16 = load_model(ModelConfig(name=str(FIXTURE), device="cpu", dtype="bfloat16"))
    assert bfloat16.dtype == torch.bfloat16 and bfloat16.dtype_reason == "bfloat16 as asked"
    filler = sorted(word for word in float32.tokenizer.get_vocab() if word.isalpha())
    for seed in range(6):
        text, content, _ = make_input(filler, 64 * 50, seed / 5, seed)
        answers = [Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16),
                              index=IndexConfig(kind="exact")).summarize(text).text for loaded in (float32, bfloat16)]
        assert answers == [content, content]


def test_int8_encoding_gives_the_needle_models_answers_and_leaves_the_model_as_it_was():
    """--encode-int8 (dynamic int8 linear layers while encoding): the same answers as float32 on inputs 50
    windows long at seven positions (30 of 30 measured in bench.needle_eval's way; six here); afterwards every
    linear layer is the original one again."""
    from torch import nn

    from unlimisum.config import EncodingConfig

    torch.set_num_threads(1)
    loaded = load_model(ModelConfig(name=str(FIXTURE), device="cpu", dtype="float32"))
    before = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    linears = [module for module in loaded.model.modules() if type(module) is nn.Linear]
    filler = sorted(word for word in loaded.tokenizer.get_vocab() if word.isalpha())
    plain, int8 = (Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16),
                              index=IndexConfig(kind="exact"), encoding=EncodingConfig(int8=flag))
                   for flag in (False, True))
    for seed in range(6):
        text, content, _ = make_input(filler, 64 * 50, seed / 5, seed)
        assert plain.summarize(text).text == content
        assert int8.summarize(text).text == content
    encoded = (plain.family.encode(Document.from_text(text)).store.states().float(),
               int8.family.encode(Document.from_text(text)).store.states().float())
    assert not torch.equal(*encoded)  # it did run quantized
    assert (encoded[1] - encoded[0]).norm() / encoded[0].norm() < 0.1
    assert [module for module in loaded.model.modules() if type(module) is nn.Linear] == linears
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_int8_encoding_needs_float32_weights_on_a_cpu():
    from unlimisum.config import EncodingConfig
    from unlimisum.errors import ConfigError

    loaded = load_model(ModelConfig(name=str(FIXTURE), device="cpu", dtype="bfloat16"))
    summarizer = Summarizer(loaded, generation=GENERATION, encoding=EncodingConfig(int8=True))
    with pytest.raises(ConfigError, match="--dtype float32"):
        summarizer.summarize("a few words")
