"""The facade: ``Summarizer`` loads a model, chooses its family's summarize path and returns ``Summary``s;
``summarize()`` does it in one call, splitting flat keyword options into the configs.

Encoder-decoder models summarize through ``unlimisum/unlimiformer/summarize.py``, decoder-only models
through ``unlimisum/decoder_only/summarize.py``; both return the types of ``unlimisum/results.py``.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from unlimisum.config import (
    DecoderOnlyConfig, EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, PromptConfig, RetrievalConfig,
)
from unlimisum.document import Document
from unlimisum.errors import ConfigError
from unlimisum.events import ProgressCallback, ProgressEvent  # noqa: F401  (part of this module's API)
from unlimisum.models import LoadedModel, load_model
from unlimisum.results import EMPTY_SUMMARY, Summary, SummaryStats  # noqa: F401  (part of this module's API)
from unlimisum.unlimiformer.cache import EncodedCache
from unlimisum.search.datastore import Datastore
from unlimisum.unlimiformer.encoded import EncodedDocument
from unlimisum.unlimiformer.encoding import WindowPlan
from unlimisum.unlimiformer.summarize import EncoderDecoderSummarizer, Generated


class Summarizer:
    """A loaded model plus the options of how to read and summarize with it."""

    def __init__(
        self,
        model: str | ModelConfig | LoadedModel = ModelConfig(),
        *,
        encoding: EncodingConfig = EncodingConfig(),
        index: IndexConfig = IndexConfig(),
        retrieval: RetrievalConfig = RetrievalConfig(),
        generation: GenerationOptions = GenerationOptions(),
        tensor_cache=None,
        cache: EncodedCache | None = None,
        progress: ProgressCallback | None = None,
        decoder: DecoderOnlyConfig = DecoderOnlyConfig(),
        prompt: PromptConfig = PromptConfig(),
    ):
        """``tensor_cache``: a ``unlimisum.tensor_cache.TensorCacheSettings`` to bound the decoder's
        self-attention memory, or None for the model's ordinary cache. ``cache``: an ``EncodedCache``
        of encoded books (None: every document is encoded). ``decoder`` and ``prompt``: how a
        decoder-only model reads (sinks, blocks) and what it is asked (unlimisum/decoder_only/)."""
        if isinstance(model, str):
            model = ModelConfig(name=model)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, progress)
        self.encoding = encoding
        self.index = index
        self.retrieval = retrieval
        self.tensor_cache = tensor_cache
        self.cache = cache
        self.progress = progress or (lambda event: None)
        if generation.extra.get("num_return_sequences", 1) != 1:
            raise ConfigError("num_return_sequences must be 1: unlimisum returns one summary per document")
        _check_passed_on(self.loaded, generation.extra)
        for name in ("temperature", "repetition_penalty", "top_p"):  # generate() would refuse them mid-run
            value = getattr(generation, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be greater than 0, got {value}")
        limit, wanted = self.loaded.max_target_length, generation.max_new_tokens
        if limit is not None and wanted is not None and wanted > limit:
            raise ConfigError(
                f"max_new_tokens {wanted} exceeds the {limit} positions the decoder of model "
                f"'{self.loaded.name}' has"
            )
        self.generation = generation.for_decoder(limit)  # the default, at most the decoder's positions
        # the family's summarize path: EncoderDecoderSummarizer or DecoderOnlySummarizer
        self.family = self._decoder_only(decoder, prompt) if self.loaded.is_decoder_only else EncoderDecoderSummarizer(
            self.loaded, encoding=encoding, index=index, retrieval=retrieval, generation=self.generation,
            tensor_cache=tensor_cache, cache=cache, progress=self.progress,
        )

    def _decoder_only(self, decoder: DecoderOnlyConfig, prompt: PromptConfig):
        """Decoder-only models summarize through unlimisum/decoder_only/: the seq2seq stages do not apply."""
        from unlimisum.decoder_only.prompting import check_template
        from unlimisum.decoder_only.summarize import DecoderOnlySummarizer

        if self.tensor_cache is not None:
            raise ConfigError("the Tensor Cache bounds an encoder-decoder model's decoder; "
                              f"'{self.loaded.name}' is decoder-only (its summary tokens stay in the exact window)")
        if self.encoding.int8:
            raise ConfigError(f"--encode-int8 quantizes an encoder; '{self.loaded.name}' is decoder-only")
        if self.index.kind not in ("auto", "exact"):
            raise ConfigError(f"index '{self.index.kind}' is an approximate index of encoder states; decoder-only "
                              f"model '{self.loaded.name}' searches its stored keys exactly (use auto or exact)")
        if self.cache is not None:
            warnings.warn("the cache of encoded books holds encoder states; decoder-only models read the prompt "
                          "each time", stacklevel=4)
        check_template(prompt)
        return DecoderOnlySummarizer(
            self.loaded, window=self.encoding.window, index=self.index, retrieval_k=self.retrieval.retrieval_k,
            generation=self.generation, decoder=decoder, prompt=prompt, progress=self.progress,
            evidence=self.retrieval.evidence, evidence_passages=self.retrieval.evidence_passages,
        )

    def summarize(self, item: str | Document, *, per_chapter: bool = False) -> Summary:
        """Summarize one text or document; with ``per_chapter`` each chapter gets its own summary too.

        An encoder-decoder model encodes the document once: each chapter's summary reads a view of the
        same store over the chapter's tokens, which kept the context of their neighbours that the windows
        gave them. A decoder-only model reads each chapter as a prompt of its own.
        """
        document = item if isinstance(item, Document) else Document.from_text(item)
        return self.family.summarize(document, per_chapter=per_chapter)

    def summarize_many(self, items: Sequence[str | Document]) -> list[Summary]:
        """Summarize several documents (an encoder-decoder model: in one generation batch, each document with
        its own datastore; a decoder-only model: one prompt at a time)."""
        documents = [item if isinstance(item, Document) else Document.from_text(item) for item in items]
        if self.loaded.is_decoder_only:
            return [self.family.summarize(document) for document in documents]
        return self.family.summarize_many(documents)

    def encode(self, document: Document) -> EncodedDocument:
        """The document's tokens, encoder states (one store), windows and chapter token ranges."""
        return self._encoder_decoder("encode").encode(document)

    def tokenize(self, document: Document) -> torch.Tensor:
        """All of the document's tokens, special tokens included, no truncation: [N] int64."""
        return self._encoder_decoder("tokenize").tokenize(document)

    def window_states(self, input_ids: torch.Tensor, plan: WindowPlan, *, batch_size: int) -> torch.Tensor:
        """The kept encoder states [n_kept, d] of the windows of ``plan`` over ``input_ids`` [N], encoded here in
        batches of ``batch_size`` (a Ray worker's part of a book; ``WindowPlan.part``)."""
        return self._encoder_decoder("encoding windows").window_states(input_ids, plan, batch_size=batch_size)

    def generate(self, stores: Sequence[Datastore], name: str = "") -> Generated:
        """Generate from encoded inputs, one datastore per document (in batch order)."""
        return self._encoder_decoder("generate").generate(stores, name)

    def _encoder_decoder(self, what: str) -> EncoderDecoderSummarizer:
        if self.loaded.is_decoder_only:
            raise ConfigError(f"model '{self.loaded.name}' is decoder-only: it reads a prompt, it has no encoder "
                              f"({what} is for encoder-decoder models)")
        return self.family


def summarize(
    text_or_document: str | Document,
    model: str | ModelConfig | LoadedModel = ModelConfig(),
    *,
    per_chapter: bool = False,
    progress: ProgressCallback | None = None,
    **options,
) -> Summary:
    """Summarize a text or Document with ``model`` (hub name, local folder, or loaded model).

    Keyword options: ``tokenizer, device, dtype, trust_remote_code`` (model); ``overlap, encode_batch, window,
    encode_int8`` (encoding); ``index, index_device, exact_max_tokens, storage_dtype, key_store`` (datastore);
    ``retrieval_k`` (input tokens each cross-attention head retrieves per step), ``evidence`` (False: no
    evidence pass), ``evidence_passages`` (passages kept per summary sentence), ``support`` (False: no
    ablation pass) and ``support_by`` ("hiding" or "removal"); for decoder-only
    models ``prompt`` (a template with ``{text}``), ``system``, ``window`` (the exact local window),
    ``sinks, block_size, block_representatives, prefill_selection``; and any ``generate()`` option,
    meaning what it means there: ``max_new_tokens``, ``num_beams``, ``no_repeat_ngram_size``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``.
    """
    configs = configs_from_options(model, options)
    summarizer = Summarizer(configs.pop("model_config", model), progress=progress, **configs)
    return summarizer.summarize(text_or_document, per_chapter=per_chapter)


def _check_passed_on(loaded: LoadedModel, extra: dict) -> None:
    """Refuse, before any document is read, an option neither unlimisum nor ``generate()`` knows (a misspelled
    one, or an unlimisum option under another name): generate() itself would refuse it only after the whole
    input was encoded. ``generate()`` takes its own parameters, the fields of a ``GenerationConfig`` and the
    model's ``forward`` inputs."""
    import inspect

    from transformers import GenerationConfig

    known = GenerationConfig()
    accepted = set(inspect.signature(loaded.model.generate).parameters) | set(
        inspect.signature(loaded.model.forward).parameters)
    unknown = [name for name in extra if name not in accepted and not hasattr(known, name)]
    if unknown:
        raise ConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                          f"not an unlimisum option (docs/python.md) and not one generate() of model "
                          f"'{loaded.name}' takes")


def configs_from_options(model, options: dict) -> dict:
    """Split flat keyword options into the config objects Summarizer takes."""
    options = dict(options)
    model_keys = {"tokenizer": "tokenizer", "device": "device", "dtype": "dtype", "trust_remote_code": "trust_remote_code"}
    model_fields = {field_name: options.pop(key) for key, field_name in model_keys.items() if key in options}
    encoding = {name: options.pop(key) for key, name in
                {"overlap": "overlap", "encode_batch": "batch_size", "window": "window", "encode_int8": "int8"}.items()
                if key in options}
    index = {name: options.pop(key) for key, name in
             {"index": "kind", "index_device": "device", "exact_max_tokens": "exact_max_tokens",
              "storage_dtype": "storage_dtype", "key_store": "key_store"}.items() if key in options}
    if "top_k" in options and not options.get("do_sample"):
        raise ConfigError("top_k is sampling's top-k, as in generate(), and needs do_sample=True; the number of "
                          "input tokens each head retrieves is retrieval_k")
    retrieval_names = ("retrieval_k", "evidence", "evidence_passages", "support", "support_by")
    retrieval_config = RetrievalConfig(**{name: options.pop(name) for name in retrieval_names if name in options})
    prompt = {name: options.pop(key) for key, name in {"prompt": "template", "system": "system"}.items()
              if key in options}
    decoder = {name: options.pop(name) for name in ("sinks", "block_size", "block_representatives", "prefill_selection")
               if name in options}
    generation_names = set(GenerationOptions.__dataclass_fields__) - {"extra"}
    generation = {name: options.pop(name) for name in list(options) if name in generation_names}
    generation = GenerationOptions(**generation, extra=options)  # the rest goes to generate() as is
    configs = dict(encoding=EncodingConfig(**encoding), index=IndexConfig(**index),
                   retrieval=retrieval_config, generation=generation, prompt=PromptConfig(**prompt),
                   decoder=DecoderOnlyConfig(**decoder))
    if model_fields:
        if isinstance(model, LoadedModel):
            raise ConfigError("model options (" + ", ".join(model_fields) + ") need a model name, not a loaded model")
        name = model.name if isinstance(model, ModelConfig) else model
        configs["model_config"] = ModelConfig(name=name, **model_fields)
    return configs
