"""--dtype auto on a CPU: bfloat16 where measured faster, float32 elsewhere; the needle model agrees in both."""

from __future__ import annotations

import torch

from tests.test_needle import FIXTURE, GENERATION, make_input
from unlimisum.config import IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model, precision
from unlimisum.summarizer import Summarizer

CPU = torch.device("cpu")


def test_auto_is_bfloat16_only_where_measured_faster(monkeypatch):
    monkeypatch.delenv("UNLIMISUM_CPU_BFLOAT16", raising=False)
    monkeypatch.setattr(precision, "cpu_bfloat16_speedup", lambda: 2.6)
    fast = precision.choose_auto_dtype(CPU)
    assert fast.dtype == torch.bfloat16 and "2.6x faster" in fast.reason
    monkeypatch.setattr(precision, "cpu_bfloat16_speedup", lambda: 0.4)
    slow = precision.choose_auto_dtype(CPU)
    assert slow.dtype == torch.float32 and "0.4x" in slow.reason
    monkeypatch.setenv("UNLIMISUM_CPU_BFLOAT16", "1")
    assert precision.choose_auto_dtype(CPU).dtype == torch.bfloat16


def test_the_measurement_is_a_positive_ratio():
    precision.cpu_bfloat16_speedup.cache_clear()
    assert precision.cpu_bfloat16_speedup() > 0


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
