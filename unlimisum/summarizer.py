"""Document -> summary: encode once (unlimisum/unlimiformer/encoder.py), generate with retrieval attention, report coverage."""

from __future__ import annotations

import resource
import time
import warnings
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import torch

from unlimisum.models import compat
from unlimisum.unlimiformer import coverage
from unlimisum.unlimiformer.retrieval import RetrievalSession, retrieval
from unlimisum.config import (
    DEFAULT_RETRIEVAL_K, DecoderOnlyConfig, EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, PromptConfig,
    RetrievalConfig,
)
from unlimisum.unlimiformer.coverage import CoverageSpan
from unlimisum.unlimiformer.datastore import Datastore
from unlimisum.document import Document
from unlimisum.unlimiformer.encoded import EncodedDocument
from unlimisum.unlimiformer.cache import EncodedCache
from unlimisum.unlimiformer.encoder import DocumentEncoder, EncodePlan
from unlimisum.errors import ConfigError, EmptyDocumentError
from unlimisum.events import ProgressCallback, ProgressEvent  # noqa: F401  (part of this module's API)
from unlimisum.models import LoadedModel, load_model
from unlimisum.unlimiformer.placement import storage_dtype


# Summary.warnings of a summary the model ended at once (it emitted its end token first).
EMPTY_SUMMARY = ("the summary is empty: the model ended it at once; a minimum length (--min-new-tokens N, "
                 "min_new_tokens=N) makes it write")

# Chapters generated together with --per-chapter: batching speeds generation up; every chapter
# of a batch reads a view of the one encoded document, so batching costs no memory.
CHAPTERS_PER_BATCH = 8


@dataclass(frozen=True)
class SummaryStats:
    """What one summary cost: sizes, choices made, time per stage, memory."""

    model: str
    input_tokens: int
    windows: int
    window: int
    index_kind: str
    index_device: str
    retrieval_k: int  # input tokens each cross-attention head attended to per step
    datastore_bytes: int  # the encoded input's one store (16-bit states, plus an approximate index's own)
    generated_tokens: int  # summary tokens: generated tokens other than special tokens
    timings: dict  # stage -> seconds: tokenize, encode, index (or cache_load), prepare, generate, search
    peak_rss_bytes: int  # the process's peak resident memory so far
    peak_gpu_bytes: int | None  # peak CUDA memory during this call, when on CUDA
    tensor_cache_bytes: int | None = None  # decoder self-attention state retained, with --tensor-cache
    cached: bool = False  # the encoded document came from the cache of encoded books
    model_dtype: str = ""  # the weights' dtype ("--dtype auto" chooses bfloat16 where measured faster)
    positions: str | None = None  # decoder-only: "true", or "fixed distance W" when prompt + summary exceed them
    packed_bytes: int = 0  # beside the store: the packed retrieval kernel's copies of it, when that kernel ran


@dataclass(frozen=True)
class Summary:
    """The summary of one document (and of each chapter, when asked for).

    ``coverage``: where the summary looked, as shares of its retrieval attention mass (all steps,
    layers, heads and beams) per chapter of the document (per window for a chapter's own
    summary); ``window_coverage``: the same per encoding window. Each sums to 1.
    """

    text: str
    title: str
    source: str
    stats: SummaryStats
    chapters: tuple["Summary", ...] = ()
    token_ids: tuple[int, ...] = ()  # the generated ids, special tokens included
    coverage: tuple[CoverageSpan, ...] = ()
    window_coverage: tuple[CoverageSpan, ...] = ()
    warnings: tuple[str, ...] = ()  # what the reader of this summary should know (EMPTY_SUMMARY)

    def to_dict(self) -> dict:
        """Plain data (for JSON): every field, chapters and stats included."""
        return asdict(self)


class _GenerationProgress:
    """A stopping criterion that never stops: it reports the summary tokens written so far.

    A step counts when some row's new token is not a special token (the forced start and end tokens and
    the padding after a row's end are not summary tokens), so that the count ends where the statistics'
    ``generated_tokens`` does for one summary.
    """

    def __init__(self, report: Callable[[int], None], special_ids: Sequence[int] = ()):
        self.report = report
        self.special = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
        self.written = 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        newest = input_ids[:, -1]  # [rows]
        if not torch.isin(newest, self.special.to(newest.device)).all():
            self.written += 1
            self.report(self.written)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(frozen=True)
class Generated:
    """What one generate() call over a batch of datastores produced and cost."""

    token_ids: torch.Tensor  # [B, T]
    total: int | None  # the most tokens it could write (max_new_tokens)
    seconds: float
    search_seconds: float  # within `seconds`
    prepare_seconds: float  # before `seconds`: the stores made ready for retrieval (Datastore.prepare)
    tensor_cache_bytes: int | None  # self-attention state retained at the end, with a Tensor Cache
    coverage: tuple[torch.Tensor, ...] = ()  # per store, [N] attention mass per input token


@dataclass(frozen=True)
class _Part:
    """What one summary of a generation batch reads: the whole document, or one chapter's tokens of it."""

    title: str
    source: str
    encoded: EncodedDocument
    start: int = 0
    end: int | None = None  # None: to the end of the document

    @property
    def stop(self) -> int:
        return self.encoded.n_tokens if self.end is None else self.end

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == self.encoded.n_tokens

    def store(self) -> Datastore:
        return self.encoded.store if self.is_whole else self.encoded.store.view(self.start, self.stop)

    def windows(self) -> list[tuple[str, int, int]]:
        """(title, start, end) of the encoding windows' kept ranges within this part, relative to its start."""
        clipped = [(max(a, self.start) - self.start, min(b, self.stop) - self.start) for a, b in self.encoded.windows]
        return coverage.window_ranges(self.stop - self.start, clipped)

    def sections(self) -> list[tuple[str, int, int]]:
        """The ranges coverage is reported by: chapters for the whole document, windows for a chapter."""
        if self.is_whole:
            return [(chapter.title, chapter.start, chapter.end) for chapter in self.encoded.chapters]
        return self.windows()


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
        limit, wanted = self.loaded.max_target_length, generation.max_new_tokens
        if limit is not None and wanted is not None and wanted > limit:
            raise ConfigError(
                f"max_new_tokens {wanted} exceeds the {limit} positions the decoder of model "
                f"'{self.loaded.name}' has"
            )
        self.generation = generation.for_decoder(limit)  # the default, at most the decoder's positions
        window = encoding.window
        if not self.loaded.is_decoder_only and window is not None and window > self.loaded.max_source_length:
            raise ConfigError(f"window {window} exceeds the {self.loaded.max_source_length}-token encoder window of "
                              f"model '{self.loaded.name}'")
        self._decoder_only = self._decoder_only_summarizer(decoder, prompt) if self.loaded.is_decoder_only else None

    def _decoder_only_summarizer(self, decoder: DecoderOnlyConfig, prompt: PromptConfig):
        """Decoder-only models summarize through unlimisum/decoder_only/: the seq2seq stages below do not apply."""
        from unlimisum.decoder_only.prompting import check_template
        from unlimisum.decoder_only.summarize import DecoderOnlySummarizer

        if self.tensor_cache is not None:
            raise ConfigError("the Tensor Cache bounds an encoder-decoder model's decoder; "
                              f"'{self.loaded.name}' is decoder-only (its summary tokens stay in the exact window)")
        if self.index.kind not in ("auto", "exact"):
            raise ConfigError(f"index '{self.index.kind}' is an approximate index of encoder states; decoder-only "
                              f"model '{self.loaded.name}' searches its stored keys exactly (use auto or exact)")
        if self.cache is not None:
            warnings.warn("the cache of encoded books holds encoder states; decoder-only models read the prompt "
                          "each time", stacklevel=3)
        check_template(prompt)
        return DecoderOnlySummarizer(
            self.loaded, window=self.encoding.window, index=self.index, retrieval_k=self.retrieval.retrieval_k,
            generation=self.generation, decoder=decoder, prompt=prompt, progress=self.progress,
        )

    # -- public -------------------------------------------------------------------------

    def summarize(self, item: str | Document, *, per_chapter: bool = False) -> Summary:
        """Summarize one text or document; with ``per_chapter`` each chapter gets its own summary too.

        The document is encoded once: each chapter's summary reads a view of the same store over
        the chapter's tokens, which kept the context of their neighbours that the windows gave them.
        """
        document = item if isinstance(item, Document) else Document.from_text(item)
        if self._decoder_only is not None:
            return self._decoder_only.summarize(document, per_chapter=per_chapter)
        encoded = self.encode(document)
        whole = self._summarize_parts([_Part(document.title, document.source, encoded)])[0]
        chapters = encoded.chapters
        if not per_chapter or len(chapters) < 2:  # one chapter: its summary is the whole summary
            return whole
        parts, total = [], len(chapters)
        for start in range(0, total, CHAPTERS_PER_BATCH):
            batch = chapters[start : start + CHAPTERS_PER_BATCH]
            titles = [chapter.title for chapter in batch]
            self.progress(ProgressEvent("chapter", start, total, titles[0], {"titles": titles}))
            parts.extend(self._summarize_parts(
                [_Part(chapter.title, document.source, encoded, chapter.start, chapter.end) for chapter in batch]
            ))
        self.progress(ProgressEvent("chapter", total, total, chapters[-1].title, {"titles": []}))
        return replace(whole, chapters=tuple(parts))

    def summarize_many(self, items: Sequence[str | Document]) -> list[Summary]:
        """Summarize several documents in one generation batch (each has its own datastore)."""
        documents = [item if isinstance(item, Document) else Document.from_text(item) for item in items]
        if self._decoder_only is not None:  # one prompt at a time
            return [self._decoder_only.summarize(document) for document in documents]
        return self._summarize_parts([_Part(d.title, d.source, self.encode(d)) for d in documents])

    def encode(self, document: Document) -> EncodedDocument:
        """The document's tokens, encoder states (one store), windows and chapter token ranges."""
        if self._decoder_only is not None:
            raise ConfigError(f"model '{self.loaded.name}' is decoder-only: it reads a prompt, it has no encoder")
        return self._encoder().encode(document)

    def tokenize(self, document: Document) -> torch.Tensor:
        """All of the document's tokens, special tokens included, no truncation: [N] int64."""
        if not document.text.strip():
            raise EmptyDocumentError("there is no text to summarize", source=document.source)
        return self._encoder().tokenize(document)[0]

    # -- stages ---------------------------------------------------------------------------

    def _encoder(self) -> DocumentEncoder:
        plan = EncodePlan(window=self._window(), index=self._index_config(), retrieval_k=self._retrieval_k(),
                          queries_per_step=self._queries_per_step())
        return DocumentEncoder(self.loaded, self.encoding, plan, self.progress, self.cache)

    def _summarize_parts(self, parts: Sequence[_Part]) -> list[Summary]:
        """One generation batch over the parts' stores; a Summary per part."""
        if not parts:
            return []
        on_cuda = self.loaded.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.loaded.device)
        stores = [part.store() for part in parts]
        name = (parts[0].title or parts[0].source) if len(parts) == 1 else f"{len(parts)} documents"
        run = self.generate(stores, name=name)
        output = run.token_ids
        tokenizer = self.loaded.tokenizer
        texts = [text.strip() for text in tokenizer.batch_decode(output, skip_special_tokens=True)]
        special = torch.tensor(sorted(set(tokenizer.all_special_ids)), device=output.device)
        counts = (~torch.isin(output, special)).sum(dim=1).tolist()
        self.progress(ProgressEvent("generate", max(counts), run.total, name))  # the count ends at the summary's
        peak_gpu = torch.cuda.max_memory_allocated(self.loaded.device) if on_cuda else None
        summaries = []
        for part, store, mass, text, n_generated, ids in zip(parts, stores, run.coverage, texts, counts,
                                                                output.tolist()):
            windows = part.windows()
            timings = dict(part.encoded.seconds, prepare=run.prepare_seconds, generate=run.seconds,
                           search=run.search_seconds)
            stats = SummaryStats(
                model=self.loaded.name, input_tokens=store.n_tokens, windows=len(windows),
                window=self._window(), index_kind=store.kind, index_device=store.device,
                retrieval_k=min(self._retrieval_k(), store.n_tokens), datastore_bytes=store.nbytes,
                packed_bytes=store.packed_nbytes,
                generated_tokens=n_generated, timings=timings, peak_rss_bytes=_peak_rss_bytes(),
                peak_gpu_bytes=peak_gpu, tensor_cache_bytes=run.tensor_cache_bytes, cached=part.encoded.cached,
                model_dtype=str(self.loaded.dtype).removeprefix("torch."),
            )
            mass = mass.cpu()
            summaries.append(Summary(
                text=text, title=part.title, source=part.source, stats=stats, token_ids=tuple(ids),
                coverage=coverage.spans(mass, part.sections()), window_coverage=coverage.spans(mass, windows),
                warnings=() if text else (EMPTY_SUMMARY,),
            ))
        return summaries

    def _window(self) -> int:
        return self.encoding.window or self.loaded.max_source_length

    def _retrieval_k(self) -> int:
        k = self.retrieval.retrieval_k or min(self.loaded.max_source_length, DEFAULT_RETRIEVAL_K)
        if k < 1:
            raise ConfigError(f"retrieval k must be at least 1, got {k}")
        return k

    def _queries_per_step(self) -> int:
        """Retrieval queries of one document in one decoder step and layer: heads x beams."""
        config = self.loaded.model.config
        heads = next((getattr(config, name) for name in ("decoder_attention_heads", "num_heads", "num_attention_heads")
                      if isinstance(getattr(config, name, None), int)), 1)
        beams = self.generation.num_beams or getattr(self.loaded.model.generation_config, "num_beams", 1) or 1
        return heads * beams

    def _index_config(self) -> IndexConfig:
        """The index options with an automatic storage dtype resolved for this model."""
        if self.index.storage_dtype != "auto":
            return self.index
        dtype = storage_dtype(self.index)
        return replace(self.index, storage_dtype=str(dtype).removeprefix("torch."))

    def generate(self, stores: Sequence[Datastore], name: str = "") -> Generated:
        """Generate from encoded inputs, one datastore per document (in batch order)."""
        model = self.loaded.model
        options = self.generation
        kwargs = options.to_generate_kwargs()
        if options.seed is not None:
            torch.manual_seed(options.seed)
        batch = len(stores)
        # generate() only needs the encoder's shape; every cross-attention reads the datastores instead
        stand_in = torch.zeros(batch, 1, model.config.d_model, dtype=self.loaded.dtype, device=self.loaded.device)
        attention_mask = torch.ones(batch, 1, dtype=torch.long, device=self.loaded.device)
        total = kwargs.get("max_new_tokens")
        progress = _GenerationProgress(lambda written: self.progress(ProgressEvent("generate", written, total, name)),
                                       self.loaded.tokenizer.all_special_ids)
        mass = tuple(torch.zeros(store.n_tokens, device=store.states().device) for store in stores)
        session = RetrievalSession(stores=list(stores), retrieval_k=self._retrieval_k(), coverage=mass)
        preparing = time.perf_counter()
        self.progress(ProgressEvent("prepare", 0, batch, name))
        for store in stores:  # kernels measured and stores packed here, not silently inside the first step
            store.prepare()
        prepared = {"packed_bytes": sum(store.packed_nbytes for store in stores),
                    "seconds": time.perf_counter() - preparing}
        if batch == 1:  # views of one book (a batch of chapters) share its store: their sum would count it again
            prepared["bytes"] = stores[0].nbytes
        self.progress(ProgressEvent("prepare", batch, batch, name, prepared))
        started = time.perf_counter()
        prepare_seconds = started - preparing
        self.progress(ProgressEvent("generate", 0, total, name))
        with ExitStack() as stack:
            stack.enter_context(retrieval(model, self.loaded.architecture, session))
            if self.tensor_cache is not None:
                from unlimisum.tensor_cache import tensor_cache

                memory = stack.enter_context(tensor_cache(model, self.loaded.architecture, self.tensor_cache))
                kwargs.update(memory.generate_kwargs())
            stack.enter_context(torch.inference_mode())
            output = model.generate(
                encoder_outputs=compat.encoder_outputs(stand_in), attention_mask=attention_mask,
                stopping_criteria=[progress], **kwargs,
            )
            retained = memory.retained_bytes() if self.tensor_cache is not None else None
        return Generated(output, total, time.perf_counter() - started, session.stats.search_seconds,
                         prepare_seconds, retained, mass)



def summarize(
    text_or_document: str | Document,
    model: str | ModelConfig | LoadedModel = ModelConfig(),
    *,
    per_chapter: bool = False,
    progress: ProgressCallback | None = None,
    **options,
) -> Summary:
    """Summarize a text or Document with ``model`` (hub name, local folder, or loaded model).

    Keyword options: ``tokenizer, device, dtype`` (model); ``overlap, encode_batch, window``
    (encoding); ``index, index_device, exact_max_tokens, storage_dtype`` (datastore);
    ``retrieval_k`` (input tokens each cross-attention head retrieves per step); for decoder-only
    models ``prompt`` (a template with ``{text}``), ``system``, ``window`` (the exact local window),
    ``sinks, block_size, block_representatives, prefill_selection``; and any ``generate()`` option,
    meaning what it means there: ``max_new_tokens``, ``num_beams``, ``no_repeat_ngram_size``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``.
    """
    configs = configs_from_options(model, options)
    summarizer = Summarizer(configs.pop("model_config", model), progress=progress, **configs)
    return summarizer.summarize(text_or_document, per_chapter=per_chapter)


def configs_from_options(model, options: dict) -> dict:
    """Split flat keyword options into the config objects Summarizer takes."""
    options = dict(options)
    model_keys = {"tokenizer": "tokenizer", "device": "device", "dtype": "dtype", "trust_remote_code": "trust_remote_code"}
    model_fields = {field_name: options.pop(key) for key, field_name in model_keys.items() if key in options}
    encoding = {name: options.pop(key) for key, name in
                {"overlap": "overlap", "encode_batch": "batch_size", "window": "window"}.items() if key in options}
    index = {name: options.pop(key) for key, name in
             {"index": "kind", "index_device": "device", "exact_max_tokens": "exact_max_tokens",
              "storage_dtype": "storage_dtype"}.items() if key in options}
    if "top_k" in options and not options.get("do_sample"):
        raise ConfigError("top_k is sampling's top-k, as in generate(), and needs do_sample=True; the number of "
                          "input tokens each head retrieves is retrieval_k")
    retrieval_config = RetrievalConfig(retrieval_k=options.pop("retrieval_k", None))
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
