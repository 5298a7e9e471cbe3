"""End to end: summarize() equals the unmodified model where the input fits, and reads inputs of any length."""

import pytest
import torch

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.models import compat
from unlimisum.config import EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.document import Chapter, Document
from unlimisum.errors import ConfigError, EmptyDocumentError, ModelNotFoundError, UnsupportedModelError
from unlimisum.summarizer import Summarizer, summarize
from unlimisum.search import kernels
from unlimisum.search import packed as packing

SHORT = "The lighthouse keeper counted the ships that passed in the night."
EXACT = IndexConfig(kind="exact", device="cpu", storage_dtype="float32")
ALL_TOKENS = RetrievalConfig(retrieval_k=100_000)


def _reference_ids(loaded, text, generation, encoder_dtype=None):
    tokens = loaded.tokenizer(text, return_tensors="pt")
    extra = loaded.architecture.encoder_inputs(tokens.input_ids) if loaded.architecture.encoder_inputs else {}
    with torch.inference_mode():
        if encoder_dtype is None:
            out = loaded.model.generate(**tokens, **extra, **generation.to_generate_kwargs())
        else:  # the unmodified model fed the very states a 16-bit datastore holds
            states = loaded.model.get_encoder()(**tokens, **extra).last_hidden_state.to(encoder_dtype).float()
            out = loaded.model.generate(
                encoder_outputs=compat.encoder_outputs(states), attention_mask=tokens.attention_mask,
                **generation.to_generate_kwargs(),
            )
    return tuple(out[0].tolist())


@pytest.mark.parametrize("model_type", ["bart", "led", "t5", "pegasus_x"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_input_that_fits_one_window_gives_the_unmodified_models_ids(tiny_loaded, model_type, num_beams):
    loaded = tiny_loaded(model_type)
    generation = GenerationOptions(max_new_tokens=16, min_new_tokens=16, num_beams=num_beams)
    summary = Summarizer(loaded, index=EXACT, retrieval=ALL_TOKENS, generation=generation).summarize(SHORT)
    assert summary.stats.windows == 1
    assert summary.token_ids == _reference_ids(loaded, SHORT, generation)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_16_bit_store_gives_the_ids_of_the_model_fed_the_same_states(tiny_loaded, num_beams):
    loaded = tiny_loaded("bart")
    generation = GenerationOptions(max_new_tokens=16, min_new_tokens=16, num_beams=num_beams)
    index = IndexConfig(kind="exact", device="cpu")  # default 16-bit storage
    summary = Summarizer(loaded, index=index, retrieval=ALL_TOKENS, generation=generation).summarize(SHORT)
    assert summary.token_ids == _reference_ids(loaded, SHORT, generation, encoder_dtype=torch.float16)


def test_generation_options_reach_generate(tiny_loaded):
    loaded = tiny_loaded("bart")
    generation = GenerationOptions(
        max_new_tokens=12, min_new_tokens=12, num_beams=2, no_repeat_ngram_size=2, length_penalty=0.5,
        repetition_penalty=1.3,
    )
    summary = Summarizer(loaded, index=EXACT, retrieval=ALL_TOKENS, generation=generation).summarize(SHORT)
    assert summary.token_ids == _reference_ids(loaded, SHORT, generation)
    ids = summary.token_ids[1:]
    bigrams = list(zip(ids, ids[1:]))
    assert len(bigrams) == len(set(bigrams))  # no_repeat_ngram_size=2 was applied


def test_batch_of_documents_equals_one_at_a_time(tiny_loaded):
    loaded = tiny_loaded("bart")
    texts = [SAMPLE_TEXT * 6, SHORT, SAMPLE_TEXT * 2]  # multi-window and single-window inputs together
    generation = GenerationOptions(max_new_tokens=10, min_new_tokens=10, num_beams=2)
    summarizer = Summarizer(loaded, index=EXACT, generation=generation)
    together = summarizer.summarize_many(texts)
    alone = [summarizer.summarize(text) for text in texts]
    assert together[0].stats.windows > 1
    for batched, single in zip(together, alone):
        assert batched.token_ids == single.token_ids
        assert batched.stats.input_tokens == single.stats.input_tokens


def test_sampling_with_a_seed_is_reproducible(tiny_loaded):
    loaded = tiny_loaded("bart")
    generation = GenerationOptions(max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=1.5, seed=7)
    summarizer = Summarizer(loaded, generation=generation)
    first, second = summarizer.summarize(SAMPLE_TEXT * 3), summarizer.summarize(SAMPLE_TEXT * 3)
    assert first.token_ids == second.token_ids
    other = Summarizer(loaded, generation=GenerationOptions(
        max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=1.5, seed=8)).summarize(SAMPLE_TEXT * 3)
    assert other.token_ids != first.token_ids


def test_stats_and_progress_events(tiny_loaded):
    loaded = tiny_loaded("bart")
    events = []
    summarizer = Summarizer(
        loaded, encoding=EncodingConfig(batch_size=2), generation=GenerationOptions(max_new_tokens=5),
        progress=events.append,
    )
    summary = summarizer.summarize(Document(title="Story", chapters=(Chapter("One", SAMPLE_TEXT * 4),)))
    stats = summary.stats
    assert summary.title == "Story"
    assert stats.input_tokens == len(loaded.tokenizer(SAMPLE_TEXT * 4)["input_ids"])
    assert stats.windows > 1 and stats.window == 64 and stats.retrieval_k == 64
    assert stats.index_kind == "exact" and stats.index_device == "cpu"
    d_model = loaded.model.config.d_model
    assert stats.datastore_bytes <= 2.2 * stats.input_tokens * d_model  # one 16-bit copy of the states
    packed_ran = kernels.kernel_for(torch.device("cpu"), torch.bfloat16, d_model).scores == "packed"
    # beside it, the packed kernel's copies when that kernel ran
    assert stats.packed_bytes == (packing.packed_bytes(stats.input_tokens, d_model) if packed_ran else 0)
    assert set(stats.timings) >= {"tokenize", "encode", "index", "prepare", "generate", "search"}
    assert stats.peak_rss_bytes > 0 and stats.peak_gpu_bytes is None
    stages = [event.stage for event in events]
    assert (stages.index("tokenize") < stages.index("encode") < stages.index("index") < stages.index("prepare")
            < stages.index("generate"))
    prepared = [event for event in events if event.stage == "prepare"]
    assert [(event.completed, event.total) for event in prepared] == [(0, 1), (1, 1)]
    assert prepared[-1].info["bytes"] == stats.datastore_bytes
    assert prepared[-1].info["packed_bytes"] == stats.packed_bytes
    encode_events = [event for event in events if event.stage == "encode"]
    assert encode_events[-1].completed == encode_events[-1].total == stats.windows
    generating = [event.completed for event in events if event.stage == "generate"]
    assert generating[-1] == max(generating) == stats.generated_tokens  # the bar ends at the done line's figure


def test_per_chapter_summaries(tiny_loaded):
    loaded = tiny_loaded("bart")
    document = Document(title="Book", chapters=(Chapter("One", SAMPLE_TEXT), Chapter("Two", SHORT), Chapter("Blank", " ")))
    summary = Summarizer(loaded, generation=GenerationOptions(max_new_tokens=4)).summarize(document, per_chapter=True)
    assert [part.title for part in summary.chapters] == ["One", "Two"]
    assert summary.stats.input_tokens > summary.chapters[0].stats.input_tokens


def test_summarize_function_takes_flat_options(tiny_model_dir):
    folder = str(tiny_model_dir("bart"))
    summary = summarize(
        SAMPLE_TEXT * 3, model=folder, device="cpu", index="exact", retrieval_k=16, overlap=0.25, encode_batch=2,
        max_new_tokens=6, min_new_tokens=6, num_beams=2,
    )
    assert summary.stats.retrieval_k == 16 and summary.stats.generated_tokens <= 6
    assert isinstance(summary.text, str)


def test_approximate_indexes_run_end_to_end(tiny_loaded):
    loaded = tiny_loaded("bart")
    for kind in ("ivf", "hnsw"):
        summary = Summarizer(
            loaded, index=IndexConfig(kind=kind, device="cpu"), generation=GenerationOptions(max_new_tokens=4)
        ).summarize(SAMPLE_TEXT * 40)
        assert summary.stats.index_kind == kind


@pytest.mark.slow
def test_hundred_thousand_token_input_end_to_end(tiny_loaded):
    import psutil

    loaded = tiny_loaded("bart")
    text = SAMPLE_TEXT * 1200
    summary = Summarizer(loaded, generation=GenerationOptions(max_new_tokens=8, num_beams=2)).summarize(text)
    assert summary.stats.input_tokens >= 100_000
    assert summary.stats.windows > 3000
    assert psutil.Process().memory_info().rss < 4 * 2**30
    assert summary.stats.peak_rss_bytes < 4 * 2**30


def test_empty_document_is_an_error(tiny_loaded):
    with pytest.raises(EmptyDocumentError, match="no text"):
        Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=8)).summarize(
            Document.from_text("  \n", source="blank.txt")
        )


def test_max_new_tokens_beyond_the_decoders_positions_is_refused(tiny_loaded):
    with pytest.raises(ConfigError, match="exceeds the 64 positions"):
        Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=65))


def test_missing_model_names_itself(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        Summarizer(ModelConfig(name="no-such-org/no-such-model", device="cpu"))


def test_unsupported_model_fails_before_loading_weights(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)  # a config and no weights at all
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Summarizer(ModelConfig(name=str(tmp_path), device="cpu"))


def test_public_api_is_importable_from_the_package(tiny_model_dir):
    import unlimisum

    assert unlimisum.summarize is summarize and unlimisum.Summarizer is Summarizer
    assert callable(unlimisum.read_document) and issubclass(unlimisum.errors.ConfigError, unlimisum.UnlimisumError)
    with pytest.raises(AttributeError):
        unlimisum.no_such_name


def test_tensor_cache_with_a_window_covering_the_summary_changes_nothing(tiny_loaded):
    from unlimisum.tensor_cache import TensorCacheSettings

    loaded = tiny_loaded("bart")
    generation = GenerationOptions(max_new_tokens=12, min_new_tokens=12, num_beams=2)
    plain = Summarizer(loaded, index=EXACT, generation=generation).summarize(SAMPLE_TEXT * 3)
    bounded = Summarizer(
        loaded, index=EXACT, generation=generation, tensor_cache=TensorCacheSettings(window=64)
    ).summarize(SAMPLE_TEXT * 3)
    assert bounded.token_ids == plain.token_ids
    assert plain.stats.tensor_cache_bytes is None and bounded.stats.tensor_cache_bytes > 0


def test_tensor_cache_state_does_not_grow_with_the_summary(tiny_loaded):
    from unlimisum.tensor_cache import TensorCacheSettings

    loaded = tiny_loaded("t5")  # relative positions: no decoder position limit
    settings = TensorCacheSettings(window=4)
    sizes = []
    for length in (16, 48):
        generation = GenerationOptions(max_new_tokens=length, min_new_tokens=length)
        summary = Summarizer(loaded, generation=generation, tensor_cache=settings).summarize(SAMPLE_TEXT * 2)
        sizes.append(summary.stats.tensor_cache_bytes)
    assert sizes[0] == sizes[1] > 0


def test_per_chapter_on_a_one_chapter_document_adds_no_parts(tiny_loaded):
    summary = Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=4)).summarize(
        Document(title="Note", chapters=(Chapter("Only", SAMPLE_TEXT),)), per_chapter=True
    )
    assert summary.chapters == ()


def test_several_return_sequences_are_refused(tiny_loaded):
    with pytest.raises(ConfigError, match="num_return_sequences"):
        Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=4, extra={"num_return_sequences": 2}))


def test_top_k_means_sampling_top_k_and_retrieval_k_has_its_own_name():
    from unlimisum.summarizer import configs_from_options

    configs = configs_from_options("m", {"do_sample": True, "top_k": 50, "retrieval_k": 128})
    assert configs["generation"].top_k == 50 and configs["generation"].to_generate_kwargs()["top_k"] == 50
    assert configs["retrieval"].retrieval_k == 128
    assert configs_from_options("m", {"top_k": 5, "do_sample": True})["retrieval"].retrieval_k is None


def test_default_retrieval_k_is_the_window_up_to_1024(tiny_model_dir):
    from unlimisum.config import DEFAULT_RETRIEVAL_K
    from unlimisum.models import load_model

    few = GenerationOptions(max_new_tokens=8)
    short = Summarizer(load_model(ModelConfig(name=str(tiny_model_dir("bart")), device="cpu")), generation=few)
    assert short.family.retrieval_k() == 64  # the model's window
    long = Summarizer(load_model(ModelConfig(name=str(tiny_model_dir("bart", window=2048)), device="cpu")),
                      generation=few)
    assert long.family.retrieval_k() == DEFAULT_RETRIEVAL_K == 1024
    asked = Summarizer(long.loaded, generation=few, retrieval=RetrievalConfig(retrieval_k=4096))
    assert asked.family.retrieval_k() == 4096


def test_the_key_store_and_the_way_support_is_measured_are_python_options_too():
    from unlimisum.summarizer import configs_from_options

    configs = configs_from_options("m", {"key_store": "shared", "support_by": "removal", "max_new_tokens": 9})
    assert configs["index"].key_store == "shared" and configs["retrieval"].support_by == "removal"
    assert configs["generation"].extra == {}  # neither is handed to generate()


@pytest.mark.parametrize("options, named", [
    ({"key_stor": "shared"}, "option 'key_stor'"),  # misspelled: generate() would refuse it after the whole input
    ({"num_beam": 2, "max_lenght": 9}, "options 'num_beam', 'max_lenght'"),
])
def test_an_option_nobody_takes_is_refused_before_any_work(tiny_loaded, options, named):
    with pytest.raises(ConfigError, match=f"unknown {named}: not an unlimisum option"):
        Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=4, extra=options))
    # generate()'s own parameters, its configuration's fields and the model's inputs pass on
    Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=4, extra={
        "output_scores": True, "streamer": None, "decoder_attention_mask": None}))


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty", "top_p"])
def test_a_sampling_setting_that_is_not_positive_is_refused_before_any_work(tiny_loaded, name):
    with pytest.raises(ConfigError, match=f"{name} must be greater than 0, got 0.0"):
        Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=4, do_sample=True,
                                                                     **{name: 0.0}))


def test_top_k_without_sampling_is_refused_naming_retrieval_k():
    from unlimisum.summarizer import configs_from_options

    with pytest.raises(ConfigError, match="retrieval_k"):
        configs_from_options("m", {"top_k": 16})
