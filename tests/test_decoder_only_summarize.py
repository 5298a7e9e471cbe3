"""Decoder-only models through the Summarizer, summarize() and the CLI: prompts, chapters, stats, placement.

Tiny random models saved as checkpoints (tests/tiny_decoders.py) with a locally trained tokenizer,
one with a chat template and one without. With k at least the prompt and float32 storage, the
summary is exactly what the model's own generate() gives after the same prompt.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.test_evidence import check_records
from tests.tiny_decoders import build_tiny_decoder_dir
from tests.tiny_models import SAMPLE_TEXT
from unlimisum import Chapter, Document, read_document
from unlimisum.cli.app import app
from unlimisum.config import (
    EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, PromptConfig, RetrievalConfig,
)
from unlimisum.decoder_only.plan import store_devices
from unlimisum.decoder_only.prompting import build_prompt
from unlimisum.errors import ConfigError
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

GREEDY = GenerationOptions(max_new_tokens=10, do_sample=False, num_beams=1)
EXACT = dict(encoding=EncodingConfig(window=32), index=IndexConfig(storage_dtype="float32"),
             retrieval=RetrievalConfig(retrieval_k=100_000), generation=GREEDY)
BOOK = Document("A book", tuple(Chapter(f"Chapter {i}", f"Part {i}. " + SAMPLE_TEXT * 2) for i in range(1, 4)),
                source="book.txt")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_decoder_dir(tmp_path_factory.mktemp("qwen2-chat"), "qwen2")


@pytest.fixture(scope="module")
def chat_model(chat_dir):
    return load_model(ModelConfig(name=str(chat_dir), device="cpu"))


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    folder = build_tiny_decoder_dir(tmp_path_factory.mktemp("llama-plain"), "llama", chat_template=False,
                                    max_positions=256)
    return load_model(ModelConfig(name=str(folder), device="cpu"))


def plain_continuation(loaded, prompt_ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = loaded.model.generate(prompt_ids.unsqueeze(0), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                    **GREEDY.to_generate_kwargs())
    return out[0, len(prompt_ids):].tolist()


def test_the_summary_is_what_generate_gives_after_the_chat_prompt(chat_model):
    tokenizer = chat_model.tokenizer
    template = PromptConfig()
    messages = [{"role": "user", "content": template.template.replace("{text}", BOOK.text)}]
    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = build_prompt(tokenizer, BOOK.text, template)
    assert prompt.ids.tolist() == list(expected_ids)
    assert tokenizer.decode(prompt.ids[prompt.text_start:prompt.text_end]) == BOOK.text
    summary = Summarizer(chat_model, **EXACT).summarize(BOOK)
    assert list(summary.token_ids) == plain_continuation(chat_model, prompt.ids)
    assert summary.text == tokenizer.decode(summary.token_ids, skip_special_tokens=True).strip()
    assert len(prompt.ids) > 10 * 32  # the prompt is many windows long
    stats = summary.stats
    assert stats.input_tokens == len(prompt.ids) and stats.window == 32 and stats.positions == "true"
    assert stats.windows == -(-(len(prompt.ids) - 1) // 32)
    assert stats.datastore_bytes == (len(prompt.ids) - 1) * 2 * 2 * 2 * 16 * 4  # k+v x layers x KV heads x dim x fp32
    assert [span.title for span in summary.coverage] == ["Chapter 1", "Chapter 2", "Chapter 3"]
    assert abs(sum(span.share for span in summary.coverage) - 1) < 1e-9
    assert set(stats.timings) == {"tokenize", "prefill", "generate", "search", "evidence"}


def test_a_system_message_goes_through_the_chat_template(chat_model):
    config = PromptConfig(template="Sum up: {text}", system="Be brief.")
    prompt = build_prompt(chat_model.tokenizer, "One line.", config)
    rendered = chat_model.tokenizer.decode(prompt.ids)
    assert rendered == "<|begin|><|system|>Be brief.<|end|><|user|>Sum up: One line.<|end|><|assistant|>"


def test_without_a_chat_template_the_prompt_is_the_template_with_the_tokenizers_specials(plain_model):
    tokenizer = plain_model.tokenizer
    prompt = build_prompt(tokenizer, "The keeper wrote.", PromptConfig(template="Text: {text}\nSummary:"))
    assert prompt.ids.tolist() == tokenizer("Text: The keeper wrote.\nSummary:")["input_ids"]
    assert prompt.ids[0] == tokenizer.bos_token_id and prompt.ids[-1] != tokenizer.eos_token_id
    assert tokenizer.decode(prompt.ids[prompt.text_start:prompt.text_end]).strip() == "The keeper wrote."
    with pytest.raises(ConfigError, match="--system needs a model with a chat template"):
        build_prompt(tokenizer, "x", PromptConfig(system="Be brief."))


def test_sinks_are_the_prompt_up_to_the_text(chat_model):
    summarizer = Summarizer(chat_model, **EXACT)
    prompt = build_prompt(chat_model.tokenizer, BOOK.text, PromptConfig())
    assert summarizer.family.plan(prompt).sinks == prompt.text_start > 4


def test_per_chapter_summaries_read_each_chapter_in_its_own_prompt(chat_model):
    summarizer = Summarizer(chat_model, **EXACT)
    summary = summarizer.summarize(BOOK, per_chapter=True)
    assert [part.title for part in summary.chapters] == ["Chapter 1", "Chapter 2", "Chapter 3"]
    for part, chapter in zip(summary.chapters, BOOK.chapters):
        prompt = build_prompt(chat_model.tokenizer, chapter.text, PromptConfig())
        assert list(part.token_ids) == plain_continuation(chat_model, prompt.ids)
        assert part.coverage[0].title == "window 1"


@pytest.fixture(scope="module")
def roomy_model(tmp_path_factory):
    """2,048 positions: the book's prompt (1,339 tokens) and its summary fit, read in chunks of a quarter of them."""
    folder = build_tiny_decoder_dir(tmp_path_factory.mktemp("qwen2-roomy"), "qwen2", max_positions=2048)
    return load_model(ModelConfig(name=str(folder), device="cpu"))


def test_within_the_models_positions_the_whole_prompt_is_read_exactly_by_default(roomy_model):
    """No --window: a prompt that fits the model's positions is its own window, read in chunks of 512, with no
    retrieval: the summary is the plain model's."""
    summarizer = Summarizer(roomy_model, index=IndexConfig(storage_dtype="float32"), generation=GREEDY)
    prompt = build_prompt(roomy_model.tokenizer, BOOK.text, PromptConfig())
    plan = summarizer.family.plan(prompt)
    assert plan.exact and plan.window == len(prompt.ids) - 1 and plan.chunk == 512
    summary = summarizer.summarize(BOOK)
    assert list(summary.token_ids) == plain_continuation(roomy_model, prompt.ids)
    assert summary.stats.window == len(prompt.ids) - 1 and summary.stats.windows == -(-plan.window // 512) == 3
    assert summary.stats.positions == "true" and summary.evidence
    assert abs(sum(span.share for span in summary.coverage) - 1) < 1e-9


def test_a_whole_prompt_window_is_widened_as_each_step_reads_it_not_held_twice(roomy_model, monkeypatch):
    """A generation step's window longer than WIDENED_WINDOW_TOKENS stays in the store's 16 bits (a widened
    copy would hold the prompt twice more) and is widened as each step attends: the same numbers, so the same
    summary and evidence as a window widened once."""
    from unlimisum.decoder_only import cache

    def run(widened_tokens: int):
        monkeypatch.setattr(cache, "WIDENED_WINDOW_TOKENS", widened_tokens)
        dtypes = set()
        real = cache.attend
        monkeypatch.setattr(cache, "attend", lambda q, parts, *a, **k: len(parts) == 4  # a step's: the tail too
                            and dtypes.add(parts[2].keys.dtype) or real(q, parts, *a, **k))
        summary = Summarizer(roomy_model, generation=GREEDY).summarize(BOOK)  # bfloat16 storage
        monkeypatch.setattr(cache, "attend", real)
        return summary, dtypes

    widened, widened_dtypes = run(100_000)
    stored, stored_dtypes = run(8)
    assert widened_dtypes == {torch.float32} and stored_dtypes == {torch.bfloat16}
    assert stored.token_ids == widened.token_ids and stored.evidence == widened.evidence


def test_beyond_the_models_positions_far_tokens_sit_at_a_fixed_distance(plain_model):
    """256 positions, a prompt of ~700 tokens: the far tokens are placed one window before every query."""
    summarizer = Summarizer(plain_model, encoding=EncodingConfig(window=32), generation=GREEDY)
    summary = summarizer.summarize(BOOK)
    assert summary.stats.input_tokens > 256
    assert summary.stats.positions == "fixed distance 32"
    assert summary.stats.retrieval_k == 32  # the default: the window, at most 1,024
    with pytest.raises(ConfigError, match="lower --window or --max-new-tokens"):
        Summarizer(plain_model, encoding=EncodingConfig(window=200), generation=GREEDY).summarize(BOOK)


def test_what_decoder_only_models_refuse(chat_model):
    from unlimisum.tensor_cache import TensorCacheSettings

    with pytest.raises(ConfigError, match="decoder-only"):
        Summarizer(chat_model, tensor_cache=TensorCacheSettings(window=8))
    with pytest.raises(ConfigError, match=r"\{text\} exactly once"):
        Summarizer(chat_model, prompt=PromptConfig(template="no placeholder"))
    for kind in ("ivf", "hnsw"):  # not silently ignored: the stored keys are searched exactly
        with pytest.raises(ConfigError, match=f"index '{kind}' is an approximate index"):
            Summarizer(chat_model, index=IndexConfig(kind=kind))
    assert Summarizer(chat_model, index=IndexConfig(kind="exact")).family is not None


def test_summarize_takes_the_decoder_only_options_flat(chat_dir, chat_model):
    import unlimisum

    summary = unlimisum.summarize(BOOK.text, model=chat_model, window=32, retrieval_k=100_000,
                                  storage_dtype="float32", prompt="Summarize: {text}", max_new_tokens=10,
                                  do_sample=False, num_beams=1, sinks=6, prefill_selection="tokens")
    prompt = build_prompt(chat_model.tokenizer, BOOK.text, PromptConfig(template="Summarize: {text}"))
    assert list(summary.token_ids) == plain_continuation(chat_model, prompt.ids)


def test_the_cli_summarizes_with_a_decoder_only_model(chat_dir, chat_model, tmp_path, loader):
    book = tmp_path / "book.txt"
    book.write_text(BOOK.text)
    result = CliRunner().invoke(app, ["summarize", str(book), "-m", str(chat_dir), "--device", "cpu", "--window", "32",
                                      "--prompt", "Summarize: {text}", "--max-new-tokens", "10", "--num-beams", "1",
                                      "--storage-dtype", "float32", "--retrieval-k", "100000", "--json", "-q"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    document = read_document(str(book))  # what the CLI read: chapters found by their headings
    prompt = build_prompt(chat_model.tokenizer, document.text, PromptConfig(template="Summarize: {text}"))
    expected = chat_model.tokenizer.decode(plain_continuation(chat_model, prompt.ids), skip_special_tokens=True).strip()
    assert record["summary"] == expected
    assert record["stats"]["positions"] == "true" and record["stats"]["window"] == 32
    bad = CliRunner().invoke(app, ["summarize", str(book), "-m", str(chat_dir), "--prompt", "no text here"])
    assert bad.exit_code == 2 and "{text}" in bad.stderr


def test_the_store_goes_where_it_fits():
    index = IndexConfig()
    gpu, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert store_devices(100, 100, index, gpu, cuda_free_bytes=1000)[:2] == (gpu, gpu)
    assert store_devices(300, 300, index, gpu, cuda_free_bytes=1000)[:2] == (gpu, cpu)  # values to the CPU
    assert store_devices(600, 600, index, gpu, cuda_free_bytes=1000)[:2] == (cpu, cpu)
    assert store_devices(1, 1, index, cpu)[:2] == (cpu, cpu)
    assert store_devices(1, 1, IndexConfig(device="cpu"), gpu, cuda_free_bytes=10**12)[:2] == (cpu, cpu)


@pytest.fixture(scope="module")
def sampling_dir(tmp_path_factory):
    """A chat checkpoint whose generation config samples, as instruct checkpoints' do (Qwen2.5-Instruct's values)."""
    from transformers import GenerationConfig

    folder = build_tiny_decoder_dir(tmp_path_factory.mktemp("qwen2-sampling"), "qwen2")
    config = GenerationConfig.from_pretrained(folder)
    config.do_sample, config.temperature, config.top_p, config.top_k = True, 0.7, 0.8, 20
    config.save_pretrained(folder)
    return folder


def test_no_sample_searches_greedily_where_the_checkpoint_samples(sampling_dir, tmp_path, loader):
    book = tmp_path / "book.txt"
    book.write_text(BOOK.text)
    loaded = load_model(ModelConfig(name=str(sampling_dir), device="cpu"))
    document = read_document(str(book))
    prompt = build_prompt(loaded.tokenizer, document.text, PromptConfig(template="Summarize: {text}"))
    greedy = loaded.tokenizer.decode(plain_continuation(loaded, prompt.ids), skip_special_tokens=True).strip()
    common = [str(book), "-m", str(sampling_dir), "--device", "cpu", "--window", "32", "--prompt", "Summarize: {text}",
              "--max-new-tokens", "10", "--num-beams", "1", "--storage-dtype", "float32", "--retrieval-k", "100000",
              "--json", "-q"]

    def summary(*options: str) -> str:
        result = CliRunner().invoke(app, ["summarize", *common, *options])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["summary"]

    assert summary("--no-sample") == greedy
    assert summary("--seed", "1") != greedy  # the checkpoint's own default samples
    settings = tmp_path / "run.toml"
    settings.write_text("sample = false\n")
    assert summary("--config", str(settings)) == greedy
    contradiction = CliRunner().invoke(app, ["summarize", *common, "--no-sample", "--temperature", "0.5"])
    assert contradiction.exit_code == 2 and "--no-sample contradicts --temperature" in contradiction.stderr


# -- evidence ----------------------------------------------------------------------------------

FAR = dict(encoding=EncodingConfig(window=32), index=IndexConfig(storage_dtype="float32"), generation=GREEDY)


def summaries_by_path(loaded, **options):
    """The same summary three ways: no evidence (coverage counted while generating), evidence recorded while
    generating (one row), and evidence from the reread pass (forced, as after beam search)."""
    from unlimisum.decoder_only.summarize import DecoderOnlySummarizer

    def run(with_evidence: bool, reread: bool):
        summarizer = Summarizer(loaded, **FAR, retrieval=RetrievalConfig(retrieval_k=8, evidence=with_evidence))
        original = DecoderOnlySummarizer._rereads
        DecoderOnlySummarizer._rereads = (lambda self, kwargs: True) if reread else original
        try:
            return summarizer.summarize(BOOK, **options)
        finally:
            DecoderOnlySummarizer._rereads = original

    return run(False, False), run(True, False), run(True, True)


def shares(summary, spans: str = "window_coverage") -> torch.Tensor:
    return torch.tensor([span.share for span in getattr(summary, spans)])


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_evidence_recorded_while_generating_equals_the_reread_pass(family, tmp_path):
    """k=8 of ~600 far tokens. Recorded while generating (each step its own token's attention) and read again
    after the prompt at once (each token choosing its own far tokens), the evidence and the coverage are the
    same, and the coverage is what generation counts without evidence. Gemma 2's sliding layers must be
    rewound to the prompt's end for the reread (it fails without that)."""
    loaded = load_model(ModelConfig(name=str(build_tiny_decoder_dir(tmp_path, family)), device="cpu"))
    during, recorded, reread = summaries_by_path(loaded)
    assert recorded.token_ids == reread.token_ids == during.token_ids and len(during.token_ids) >= 2
    assert not during.evidence and "evidence" not in during.stats.timings and "evidence" in reread.stats.timings
    for spans in ("coverage", "window_coverage"):
        torch.testing.assert_close(shares(recorded, spans), shares(during, spans), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(shares(reread, spans), shares(during, spans), rtol=1e-4, atol=1e-6)
    assert shares(during).max() < 0.9  # spread over many windows: retrieval mattered
    assert [e.sentence for e in recorded.evidence] == [e.sentence for e in reread.evidence]
    for ours, theirs in zip(recorded.evidence, reread.evidence):
        assert [(s.chapter_index, s.start_char, s.end_char) for s in ours.sources] == \
            [(s.chapter_index, s.start_char, s.end_char) for s in theirs.sources]
        torch.testing.assert_close(torch.tensor([s.share for s in ours.sources]),
                                   torch.tensor([s.share for s in theirs.sources]), rtol=1e-4, atol=1e-5)
    if recorded.text:
        check_records(recorded, BOOK)


def test_a_reread_pass_with_one_far_set_for_all_its_tokens_differs(chat_model, monkeypatch):
    """The test above can fail: the reread pass's tokens sharing one far set (a generation step's rule for its
    rows) give other masses."""
    from unlimisum.decoder_only import cache as cache_module
    from unlimisum.decoder_only.summarize import DecoderOnlySummarizer

    reference = Summarizer(chat_model, **FAR, retrieval=RetrievalConfig(retrieval_k=8, evidence=False)).summarize(BOOK)
    real = cache_module.RetrievalLayer._decode_far
    monkeypatch.setattr(cache_module.RetrievalLayer, "_decode_far",
                        lambda self, q, start, end, per_query=False: real(self, q, start, end, False))
    monkeypatch.setattr(cache_module.RetrievalLayer, "_add_evidence", _evidence_of_shared_far_set)
    monkeypatch.setattr(DecoderOnlySummarizer, "_rereads", lambda self, kwargs: True)
    shared = Summarizer(chat_model, **FAR, retrieval=RetrievalConfig(retrieval_k=8)).summarize(BOOK)
    assert (shares(shared) - shares(reference)).abs().max() > 1e-3


def _evidence_of_shared_far_set(self, mass, first, sink_end, far_ids, far_start, first_local, prompt):
    sinks, far, local = (part[0] for part in mass[:3])  # [G, C, n]
    queries = sinks.shape[1]
    span = lambda a, b: torch.arange(a, b).expand(queries, -1)  # noqa: E731
    far_positions = (span(far_start, far_start + far.shape[-1]) if far_ids is None else
                     far_ids[0].expand(-1, queries, -1).permute(1, 0, 2).reshape(queries, -1))  # [G, 1, k]: one set
    far_mass = far.sum(dim=0) if far_ids is None else far.permute(1, 0, 2).reshape(queries, -1)
    self.evidence(first, torch.cat([span(0, sink_end), far_positions, span(first_local, prompt)], dim=1),
                  torch.cat([sinks.sum(dim=0), far_mass, local.sum(dim=0)], dim=1))


def test_with_beams_decoder_only_evidence_comes_from_the_reread_pass(chat_model, monkeypatch):
    """Beam search runs several rows, none of them the returned sequence throughout: the evidence and coverage
    come from reading the returned summary again; greedy search records them while generating (no reread)."""
    from unlimisum.decoder_only.summarize import DecoderOnlySummarizer

    calls = []
    real = DecoderOnlySummarizer._reread
    monkeypatch.setattr(DecoderOnlySummarizer, "_reread", lambda self, *args: calls.append(1) or real(self, *args))
    beams = GenerationOptions(max_new_tokens=10, do_sample=False, num_beams=2)
    summary = Summarizer(chat_model, encoding=FAR["encoding"], index=FAR["index"], generation=beams,
                         retrieval=RetrievalConfig(retrieval_k=8)).summarize(BOOK)
    assert calls and abs(sum(span.share for span in summary.coverage) - 1) < 1e-9
    if summary.text:
        check_records(summary, BOOK)
    calls.clear()
    Summarizer(chat_model, **FAR, retrieval=RetrievalConfig(retrieval_k=8)).summarize(BOOK)
    assert not calls


def test_decoder_only_evidence_per_chapter_quotes_each_chapter_from_its_own_prompt(chat_model):
    summarizer = Summarizer(chat_model, **FAR, retrieval=RetrievalConfig(retrieval_k=8))
    summary = summarizer.summarize(BOOK, per_chapter=True)
    with_text = [part for part in (summary, *summary.chapters) if part.text]
    assert with_text, "the tiny model writes something"
    for part in with_text:
        check_records(part, BOOK)
    for number, part in enumerate(summary.chapters):
        assert {source.chapter_index for sentence in part.evidence for source in sentence.sources} <= {number}
    no_evidence = Summarizer(chat_model, **FAR, retrieval=RetrievalConfig(retrieval_k=8, evidence=False))
    assert no_evidence.summarize(BOOK).evidence == ()
