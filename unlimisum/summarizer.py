"""Document -> summary: tokenize, encode in windows, index, generate with retrieval attention."""

from __future__ import annotations

import resource
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import torch

from unlimisum import checkpoint, compat
from unlimisum.attention import RetrievalSession, retrieval
from unlimisum.config import EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.datastore import Datastore, DatastoreBuilder, plan_index
from unlimisum.document import Document
from unlimisum.encoding import auto_batch_size, encode_windows, plan_windows
from unlimisum.errors import ConfigError, EmptyDocumentError
from unlimisum.models import LoadedModel, load_model
from unlimisum.placement import storage_dtype


# Chapters generated together with --per-chapter: batching speeds generation up, while the
# datastores of a batch are held at once, so a book of 60 chapters is not read in one go.
CHAPTERS_PER_BATCH = 8


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report: ``stage`` is tokenize, encode, index, generate or chapter.

    ``chapter`` (``summarize(per_chapter=True)``, after the whole-document summary): before each
    batch of chapters, ``completed`` chapters of ``total`` are summarized and ``document`` is the
    title of the next one (``info["titles"]``: the titles of the batch, in the order their
    tokenize/encode/index events come); after the last batch, ``completed == total``.
    """

    stage: str
    completed: int
    total: int | None
    document: str = ""  # title or source of the document the event is about
    info: dict = field(default_factory=dict)


ProgressCallback = Callable[[ProgressEvent], None]


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
    datastore_bytes: int
    generated_tokens: int
    timings: dict  # stage -> seconds: tokenize, encode (includes index building), generate, search
    peak_rss_bytes: int  # the process's peak resident memory so far
    peak_gpu_bytes: int | None  # peak CUDA memory during this call, when on CUDA
    tensor_cache_bytes: int | None = None  # decoder self-attention state retained, with --tensor-cache


@dataclass(frozen=True)
class Summary:
    """The summary of one document (and of each chapter, when asked for)."""

    text: str
    title: str
    source: str
    stats: SummaryStats
    chapters: tuple["Summary", ...] = ()
    token_ids: tuple[int, ...] = ()  # the generated ids, special tokens included

    def to_dict(self) -> dict:
        """Plain data (for JSON): every field, chapters and stats included."""
        return asdict(self)


class _GenerationProgress:
    """A stopping criterion that never stops: it reports each generated token."""

    def __init__(self, report: Callable[[int], None]):
        self.report = report
        self.steps = 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.steps += 1
        self.report(self.steps)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(frozen=True)
class Generated:
    """What one generate() call over a batch of datastores produced and cost."""

    token_ids: torch.Tensor  # [B, T]
    seconds: float
    search_seconds: float  # within `seconds`
    tensor_cache_bytes: int | None  # self-attention state retained at the end, with a Tensor Cache


@dataclass
class _Encoded:
    name: str
    store: Datastore
    n_tokens: int
    windows: int
    seconds: dict


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
        progress: ProgressCallback | None = None,
    ):
        """``tensor_cache``: a ``unlimisum.tensor_cache.TensorCacheSettings`` to bound the decoder's
        self-attention memory, or None for the model's ordinary cache."""
        if isinstance(model, str):
            model = ModelConfig(name=model)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model)
        self.encoding = encoding
        self.index = index
        self.retrieval = retrieval
        self.generation = generation
        self.tensor_cache = tensor_cache
        self.progress = progress or (lambda event: None)
        if generation.extra.get("num_return_sequences", 1) != 1:
            raise ConfigError("num_return_sequences must be 1: unlimisum returns one summary per document")
        limit, wanted = self.loaded.max_target_length, generation.max_new_tokens
        if limit is not None and wanted is not None and wanted > limit:
            raise ConfigError(
                f"max_new_tokens {wanted} exceeds the {limit} positions the decoder of model "
                f"'{self.loaded.name}' has"
            )

    # -- public -------------------------------------------------------------------------

    def summarize(self, item: str | Document, *, per_chapter: bool = False) -> Summary:
        """Summarize one text or document; with ``per_chapter`` each chapter gets its own summary too."""
        document = item if isinstance(item, Document) else Document.from_text(item)
        whole = self.summarize_many([document])[0]
        if not per_chapter:
            return whole
        chapters = [
            Document.from_text(chapter.text, title=chapter.title, source=document.source)
            for chapter in document.chapters
            if chapter.text.strip()
        ]
        if len(chapters) < 2:  # one chapter: its summary is the whole summary
            return whole
        parts, total = [], len(chapters)
        for start in range(0, total, CHAPTERS_PER_BATCH):
            batch = chapters[start : start + CHAPTERS_PER_BATCH]
            titles = [chapter.title for chapter in batch]
            self.progress(ProgressEvent("chapter", start, total, titles[0], {"titles": titles}))
            parts.extend(self.summarize_many(batch))
        self.progress(ProgressEvent("chapter", total, total, chapters[-1].title, {"titles": []}))
        return Summary(whole.text, whole.title, whole.source, whole.stats, tuple(parts), whole.token_ids)

    def summarize_many(self, items: Sequence[str | Document]) -> list[Summary]:
        """Summarize several documents in one generation batch (each has its own datastore)."""
        documents = [item if isinstance(item, Document) else Document.from_text(item) for item in items]
        if not documents:
            return []
        on_cuda = self.loaded.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.loaded.device)
        encoded = [self._encode(document) for document in documents]
        name = encoded[0].name if len(encoded) == 1 else f"{len(encoded)} documents"
        run = self.generate([enc.store for enc in encoded], name=name)
        output = run.token_ids
        tokenizer = self.loaded.tokenizer
        texts = [text.strip() for text in tokenizer.batch_decode(output, skip_special_tokens=True)]
        special = torch.tensor(sorted(set(tokenizer.all_special_ids)), device=output.device)
        counts = (~torch.isin(output, special)).sum(dim=1).tolist()
        peak_gpu = torch.cuda.max_memory_allocated(self.loaded.device) if on_cuda else None
        summaries = []
        for document, enc, text, n_generated, ids in zip(documents, encoded, texts, counts, output.tolist()):
            timings = dict(enc.seconds, generate=run.seconds, search=run.search_seconds)
            stats = SummaryStats(
                model=self.loaded.name, input_tokens=enc.n_tokens, windows=enc.windows,
                window=self._window(), index_kind=enc.store.kind, index_device=enc.store.device,
                retrieval_k=min(self._retrieval_k(), enc.n_tokens), datastore_bytes=enc.store.nbytes,
                generated_tokens=n_generated, timings=timings, peak_rss_bytes=_peak_rss_bytes(),
                peak_gpu_bytes=peak_gpu, tensor_cache_bytes=run.tensor_cache_bytes,
            )
            summaries.append(
                Summary(text=text, title=document.title, source=document.source, stats=stats, token_ids=tuple(ids))
            )
        return summaries

    # -- stages ---------------------------------------------------------------------------

    def _window(self) -> int:
        return self.encoding.window or self.loaded.max_source_length

    def _retrieval_k(self) -> int:
        k = self.retrieval.retrieval_k or self.loaded.max_source_length
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
        dtype = storage_dtype(self.index, self.loaded.dtype)
        return replace(self.index, storage_dtype=str(dtype).removeprefix("torch."))

    def tokenize(self, document: Document) -> torch.Tensor:
        """All of the document's tokens, special tokens included, no truncation: [N] int64."""
        text = document.text
        if not text.strip():
            raise EmptyDocumentError("there is no text to summarize", source=document.source)
        tokenizer = self.loaded.tokenizer
        ids = tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        unknown = tokenizer.unk_token_id
        special = set(tokenizer.all_special_ids) - {unknown}
        checkpoint.check_encoding(len(ids), sum(i in special for i in ids),
                                  sum(i == unknown for i in ids) if unknown is not None else 0, text,
                                  source=document.source)
        return torch.tensor(ids, dtype=torch.long)

    def _encode(self, document: Document) -> _Encoded:
        name = document.title or document.source
        started = time.perf_counter()
        self.progress(ProgressEvent("tokenize", 0, 1, name))
        input_ids = self.tokenize(document)
        tokenized = time.perf_counter()
        n_tokens = len(input_ids)
        self.progress(ProgressEvent("tokenize", 1, 1, name, {"tokens": n_tokens}))

        model = self.loaded.model
        plan = plan_windows(n_tokens, self._window(), self.encoding.overlap)
        d_model = model.config.d_model
        index_config = self._index_config()
        index_plan = plan_index(n_tokens, d_model, index_config, top_k=self._retrieval_k(),
                                queries_per_step=self._queries_per_step(), model_device=self.loaded.device)
        builder = DatastoreBuilder(n_tokens, d_model, index_plan, index_config)
        batch_size = self.encoding.batch_size or auto_batch_size(plan.window, plan.n_windows, self.loaded.device)
        if batch_size < 1:
            raise ConfigError(f"encode batch size must be at least 1, got {batch_size}")
        info = {"tokens": n_tokens, "index": index_plan.kind, "index_device": index_plan.device}
        self.progress(ProgressEvent("encode", 0, plan.n_windows, name, info))
        encode_windows(
            model.get_encoder(), input_ids, plan, builder.add, batch_size=batch_size,
            encoder_inputs=self.loaded.architecture.encoder_inputs,
            on_batch=lambda done: self.progress(ProgressEvent("encode", done, plan.n_windows, name, info)),
        )
        encoded = time.perf_counter()
        self.progress(ProgressEvent("index", 0, 1, name, info))
        store = builder.finish()
        finished = time.perf_counter()
        self.progress(ProgressEvent("index", 1, 1, name, dict(info, bytes=store.nbytes)))
        seconds = {"tokenize": tokenized - started, "encode": encoded - tokenized, "index": finished - encoded}
        return _Encoded(name, store, n_tokens, plan.n_windows, seconds)

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
        progress = _GenerationProgress(lambda steps: self.progress(ProgressEvent("generate", steps, total, name)))
        session = RetrievalSession(stores=list(stores), top_k=self._retrieval_k())
        started = time.perf_counter()
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
        return Generated(output, time.perf_counter() - started, session.stats.search_seconds, retained)


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
    ``retrieval_k`` (input tokens each cross-attention head retrieves per step); and any
    ``generate()`` option, meaning what it means there: ``max_new_tokens``, ``num_beams``,
    ``no_repeat_ngram_size``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``.
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
    retrieval_config = RetrievalConfig(retrieval_k=options.pop("retrieval_k", None))
    generation_names = set(GenerationOptions.__dataclass_fields__) - {"extra"}
    generation = {name: options.pop(name) for name in list(options) if name in generation_names}
    generation = GenerationOptions(**generation, extra=options)  # the rest goes to generate() as is
    configs = dict(encoding=EncodingConfig(**encoding), index=IndexConfig(**index),
                   retrieval=retrieval_config, generation=generation)
    if model_fields:
        if isinstance(model, LoadedModel):
            raise ConfigError("model options (" + ", ".join(model_fields) + ") need a model name, not a loaded model")
        name = model.name if isinstance(model, ModelConfig) else model
        configs["model_config"] = ModelConfig(name=name, **model_fields)
    return configs
