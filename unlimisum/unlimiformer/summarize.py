"""The encoder-decoder family's summarize path: encode once, generate with retrieval attention, report coverage.

``EncoderDecoderSummarizer`` is what ``unlimisum.Summarizer`` delegates to for BART, PEGASUS, LED, T5 and
the other rows of ``unlimisum/models/architectures.py``; ``unlimisum/decoder_only/summarize.py`` is its
counterpart for decoder-only models. The document is encoded once (``encoder.py``); the whole-book
summary searches its one store, each chapter's summary a view of it, several chapters in one batch.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from unlimisum import coverage, evidence
from unlimisum.config import DEFAULT_RETRIEVAL_K, EncodingConfig, GenerationOptions, IndexConfig, RetrievalConfig
from unlimisum.document import Document
from unlimisum.errors import ConfigError, EmptyDocumentError
from unlimisum.events import ProgressCallback, ProgressEvent
from unlimisum.models import LoadedModel, compat
from unlimisum.results import EMPTY_SUMMARY, GenerationProgress, Summary, SummaryStats, peak_rss_bytes
from unlimisum.search import compiled, projections
from unlimisum.unlimiformer.cache import EncodedCache
from unlimisum.search.datastore import Datastore
from unlimisum.unlimiformer.encoded import EncodedDocument
from unlimisum.unlimiformer.encoder import DocumentEncoder, EncodePlan
from unlimisum.unlimiformer.encoding import WindowEncoder, WindowPlan, plan_windows
from unlimisum.search.keys import key_weights, value_weights
from unlimisum.unlimiformer.removal import StoreRemoval
from unlimisum.search.placement import storage_dtype
from unlimisum.unlimiformer.reread import (GenerationRecorder, Reading, SummaryReader, end_tokens, returned_length,
                                           supports_of)
from unlimisum.unlimiformer.retrieval import RetrievalSession, retrieval

# Summary.warnings when the evidence pass failed: the summary is kept, without evidence or coverage.
EVIDENCE_FAILED = "no evidence: the pass that finds it failed after the summary was written"

# Chapters generated together with --per-chapter: batching speeds generation up; every chapter
# of a batch reads a view of the one encoded document, so batching costs no memory.
CHAPTERS_PER_BATCH = 8


@dataclass(frozen=True)
class Generated:
    """What one generate() call over a batch of datastores produced and cost."""

    token_ids: torch.Tensor  # [B, T]
    total: int | None  # the most tokens it could write (max_new_tokens)
    seconds: float
    search_seconds: float  # within `seconds`
    prepare_seconds: float  # before `seconds`: the stores made ready for retrieval (Datastore.prepare)
    tensor_cache_bytes: int | None  # self-attention state retained at the end, with a Tensor Cache
    coverage: tuple[torch.Tensor, ...] = ()  # per store, [N] attention mass per input token (every step)
    recorder: "GenerationRecorder | None" = None  # the evidence pass's reading, recorded while generating


@dataclass(frozen=True)
class _PartEvidence:
    """What the evidence pass found for one part (or, without it, the coverage counted while generating)."""

    mass: torch.Tensor | None  # [N] float32 CPU attention mass per input token; None: the pass failed
    evidence: tuple  # SentenceEvidence per sentence of the summary
    seconds: dict  # "evidence" (the reading) and "support" (the sentences read again): seconds each
    warnings: tuple[str, ...] = ()  # why there is no evidence (the summary itself is kept)


@dataclass(frozen=True)
class _Part:
    """What one summary of a generation batch reads: the whole document, or one chapter's tokens of it."""

    title: str
    source: str
    encoded: EncodedDocument
    document: Document | None = None  # what evidence quotes from
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


class EncoderDecoderSummarizer:
    """An encoder-decoder model plus how to encode, index, retrieve and generate with it."""

    def __init__(self, loaded: LoadedModel, *, encoding: EncodingConfig, index: IndexConfig,
                 retrieval: RetrievalConfig, generation: GenerationOptions, tensor_cache=None,
                 cache: EncodedCache | None = None, progress: ProgressCallback):
        """``generation``: with ``max_new_tokens`` resolved (``GenerationOptions.for_decoder``);
        ``tensor_cache``: a ``unlimisum.tensor_cache.TensorCacheSettings``, or None."""
        window = encoding.window
        if window is not None and window > loaded.max_source_length:
            raise ConfigError(f"window {window} exceeds the {loaded.max_source_length}-token encoder window of "
                              f"model '{loaded.name}'")
        if retrieval.evidence_passages < 1:
            raise ConfigError(f"evidence passages must be at least 1, got {retrieval.evidence_passages}")
        if retrieval.support_by not in ("hiding", "removal"):
            raise ConfigError(f"support by '{retrieval.support_by}' is not one of hiding, removal")
        if retrieval.support_by == "removal" and index.kind not in ("auto", "exact"):
            raise ConfigError(f"--support-by removal needs the exact index (its states are encoded again), not "
                              f"--index {index.kind}")
        self.loaded = loaded
        self.encoding = encoding
        self.index = index
        self.retrieval = retrieval
        self.generation = generation
        self.tensor_cache = tensor_cache
        self.cache = cache
        self.progress = progress
        self._int8_made: dict = {}  # --encode-int8: the encoder's int8 linear layers, made on first use
        self.window_encoder: WindowEncoder | None = None  # encodes fresh documents' windows elsewhere (Ray)

    def summarize(self, document: Document, *, per_chapter: bool = False) -> Summary:
        """Summarize one text or document; with ``per_chapter`` each chapter gets its own summary too.

        The document is encoded once: each chapter's summary reads a view of the same store over
        the chapter's tokens, which kept the context of their neighbours that the windows gave them.
        """
        encoded = self.encode(document)
        whole = self._summarize_parts([_Part(document.title, document.source, encoded, document)])[0]
        chapters = encoded.chapters
        if not per_chapter or len(chapters) < 2:  # one chapter: its summary is the whole summary
            return whole
        parts, total = [], len(chapters)
        for start in range(0, total, CHAPTERS_PER_BATCH):
            batch = chapters[start : start + CHAPTERS_PER_BATCH]
            titles = [chapter.title for chapter in batch]
            self.progress(ProgressEvent("chapter", start, total, titles[0], {"titles": titles}))
            parts.extend(self._summarize_parts(
                [_Part(chapter.title, document.source, encoded, document, chapter.start, chapter.end)
                 for chapter in batch]
            ))
        self.progress(ProgressEvent("chapter", total, total, chapters[-1].title, {"titles": []}))
        return replace(whole, chapters=tuple(parts))

    def summarize_many(self, documents: Sequence[Document]) -> list[Summary]:
        """Summarize several documents in one generation batch (each has its own datastore)."""
        return self._summarize_parts([_Part(d.title, d.source, self.encode(d), d) for d in documents])

    def encode(self, document: Document) -> EncodedDocument:
        """The document's tokens, encoder states (one store), windows and chapter token ranges."""
        return self._encoder().encode(document)

    def tokenize(self, document: Document) -> torch.Tensor:
        """All of the document's tokens, special tokens included, no truncation: [N] int64."""
        if not document.text.strip():
            raise EmptyDocumentError("there is no text to summarize", source=document.source)
        return self._encoder().tokenize(document)[0]

    def window_states(self, input_ids: torch.Tensor, plan: WindowPlan, *, batch_size: int) -> torch.Tensor:
        """The kept states [n_kept, d] of every window of ``plan`` over ``input_ids``, encoded in this process in
        batches of ``batch_size``, in the model's dtype (what a Ray worker computes for its part of a book)."""
        kept: list[torch.Tensor] = []
        self._encoder().encode_windows(input_ids, plan, kept.append, batch_size=batch_size)
        return torch.cat(kept)

    def retrieval_k(self) -> int:
        """Input tokens each cross-attention head retrieves per step: as asked, else the model's window
        (at most DEFAULT_RETRIEVAL_K)."""
        k = self.retrieval.retrieval_k or min(self.loaded.max_source_length, DEFAULT_RETRIEVAL_K)
        if k < 1:
            raise ConfigError(f"retrieval k must be at least 1, got {k}")
        return k

    def generate(self, stores: Sequence[Datastore], name: str = "", coverage: bool = True,
                 record: bool = False) -> Generated:
        """Generate from encoded inputs, one datastore per document (in batch order); ``coverage``: add up
        the attention mass of every step (else ``Generated.coverage`` stays zero); ``record``: keep the evidence
        pass's reading as generation goes (``Generated.recorder``), where it writes one row per document (no
        beams) with the model's own self-attention (no Tensor Cache: the reading would start from its states
        at each sentence, which generation does not keep); otherwise the pass reads the summary again."""
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
        progress = GenerationProgress(lambda written: self.progress(ProgressEvent("generate", written, total, name)),
                                       self.loaded.tokenizer.all_special_ids)
        mass = tuple(torch.zeros(store.n_tokens, device=store.states().device) for store in stores)
        session = RetrievalSession(stores=list(stores), retrieval_k=self.retrieval_k(),
                                   coverage=mass if coverage else None)
        recorder = None
        if record and self.tensor_cache is None and self._rows_per_document(kwargs) == 1:
            layers = len(self.loaded.architecture.decoder_layers(model))
            recorder = session.recorder = GenerationRecorder([store.n_tokens for store in stores], total, layers,
                                                             end_tokens(self.loaded))
        preparing = time.perf_counter()
        # a first run on this machine: the kernels the stores run, compiled (most of them while the book was encoded)
        compiled.wait_ready([(kernel, store.storage_dtype) for store in stores
                             for kernel in store.compiled_kernels(self.retrieval_k())]
                            + projections.compiled_kernels(model),
                            lambda done, total, left: self.progress(ProgressEvent("compile", done, total, name,
                                                                                  {"seconds_left": left})))
        self.progress(ProgressEvent("prepare", 0, batch, name))
        for store in stores:  # kernels measured and stores packed here, not silently inside the first step
            store.prepare(queries_per_head=self._rows_per_document(kwargs), retrieval_k=self.retrieval_k())
        projections.prepare(model, batch * self._rows_per_document(kwargs))
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
            stack.enter_context(projections.faster_projections(model))
            if self.tensor_cache is not None:
                from unlimisum.tensor_cache import tensor_cache

                memory = stack.enter_context(tensor_cache(model, self.loaded.architecture, self.tensor_cache))
                kwargs.update(memory.generate_kwargs())
            stack.enter_context(torch.inference_mode())
            criteria = [progress]
            if recorder is not None:
                criteria.append(recorder)
                kwargs["return_dict_in_generate"] = True
            output = model.generate(
                encoder_outputs=compat.encoder_outputs(stand_in), attention_mask=attention_mask,
                stopping_criteria=criteria, **kwargs,
            )
            if recorder is not None:
                recorder.cache, output = output.past_key_values, output.sequences
            retained = memory.retained_bytes() if self.tensor_cache is not None else None
        return Generated(output, total, time.perf_counter() - started, session.stats.search_seconds,
                         prepare_seconds, retained, mass, recorder)

    def _rows_per_document(self, kwargs: dict) -> int:
        """Rows generate() decodes per document: its beams (the options', else the model's own)."""
        beams = kwargs.get("num_beams", getattr(self.loaded.model.generation_config, "num_beams", 1)) or 1
        return beams * (kwargs.get("num_return_sequences", 1) or 1)

    def read_summary(self, store: Datastore, ids: Sequence[int]) -> Reading:
        """The evidence pass over one returned sequence ``ids`` (unlimisum/unlimiformer/reread.py): the decoder
        reads it at once with the retrieval (and Tensor Cache) of generation: per token its input positions and
        log-probability, and the coverage of the returned sequence alone."""
        ids = list(ids)[:returned_length(list(ids), end_tokens(self.loaded))]
        with SummaryReader(self.loaded, self.retrieval_k(), self.tensor_cache) as reader:
            return reader.read(store, ids)

    # -- stages ---------------------------------------------------------------------------

    def _encoder(self) -> DocumentEncoder:
        plan = EncodePlan(window=self._window(), index=self._index_config(), retrieval_k=self.retrieval_k(),
                          queries_per_step=self._queries_per_step(),
                          support=self.retrieval.evidence and self.retrieval.support,
                          summary_tokens=self.generation.to_generate_kwargs()["max_new_tokens"])
        return DocumentEncoder(self.loaded, self.encoding, plan, self.progress, self.cache, self._int8_made,
                               self.window_encoder)

    def _summarize_parts(self, parts: Sequence[_Part]) -> list[Summary]:
        """One generation batch over the parts' stores; a Summary per part."""
        if not parts:
            return []
        on_cuda = self.loaded.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.loaded.device)
        stores = [part.store() for part in parts]
        name = (parts[0].title or parts[0].source) if len(parts) == 1 else f"{len(parts)} documents"
        with_evidence = self.retrieval.evidence
        run = self.generate(stores, name=name, coverage=not with_evidence, record=with_evidence)
        output = run.token_ids
        tokenizer = self.loaded.tokenizer
        texts = [text.strip() for text in tokenizer.batch_decode(output, skip_special_tokens=True)]
        special = torch.tensor(sorted(set(tokenizer.all_special_ids)), device=output.device)
        counts = (~torch.isin(output, special)).sum(dim=1).tolist()
        if max(counts):  # the count ends at the summary's (0 would read as generation starting again)
            self.progress(ProgressEvent("generate", max(counts), run.total, name))
        peak_gpu = torch.cuda.max_memory_allocated(self.loaded.device) if on_cuda else None
        rows = output.tolist()
        found = (self._evidence(parts, stores, rows, texts, name, run.recorder) if with_evidence
                 else [_PartEvidence(mass.cpu(), (), {}) for mass in run.coverage])
        summaries = []
        for part, store, text, n_generated, ids, seen in zip(parts, stores, texts, counts, rows, found):
            windows = part.windows()
            timings = dict(part.encoded.seconds, prepare=run.prepare_seconds, generate=run.seconds,
                           search=run.search_seconds, **seen.seconds)
            stats = SummaryStats(
                model=self.loaded.name, input_tokens=store.n_tokens, windows=len(windows),
                window=self._window(), index_kind=store.kind, index_device=store.device,
                retrieval_k=min(self.retrieval_k(), store.n_tokens), datastore_bytes=store.nbytes,
                packed_bytes=store.packed_nbytes, key_store="per-layer" if store.keys is not None else "shared",
                key_store_bytes=store.keys.nbytes if store.keys is not None else 0,
                key_store_values=store.keys is not None and store.keys.values is not None,
                generated_tokens=n_generated, timings=timings, peak_rss_bytes=peak_rss_bytes(),
                peak_gpu_bytes=peak_gpu, tensor_cache_bytes=run.tensor_cache_bytes, cached=part.encoded.cached,
                model_dtype=str(self.loaded.dtype).removeprefix("torch."),
            )
            summaries.append(Summary(
                text=text, title=part.title, source=part.source, stats=stats, token_ids=tuple(ids),
                coverage=coverage.spans(seen.mass, part.sections()) if seen.mass is not None else (),
                window_coverage=coverage.spans(seen.mass, windows) if seen.mass is not None else (),
                warnings=(() if text else (EMPTY_SUMMARY,)) + seen.warnings, evidence=seen.evidence,
            ))
        return summaries

    def _evidence(self, parts: Sequence[_Part], stores: Sequence[Datastore], rows: list[list[int]],
                  texts: list[str], name: str, recorder: GenerationRecorder | None = None) -> list["_PartEvidence"]:
        """The evidence pass over each returned summary (unlimisum/unlimiformer/reread.py): coverage of the
        returned sequence, each sentence's passages, and each one's support (its passages hidden); the reading
        of each summary is the one ``recorder`` kept while generating, when there is one."""
        tokenizer = self.loaded.tokenizer
        special_ids = set(tokenizer.all_special_ids)
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        eos = end_tokens(self.loaded)
        found = []
        self.progress(ProgressEvent("evidence", 0, len(parts), name))
        with SummaryReader(self.loaded, self.retrieval_k(), self.tensor_cache) as reader:
            for number, (part, store, row, text) in enumerate(zip(parts, stores, rows, texts)):
                try:
                    found.append(self._part_evidence(reader, part, store, row, text, eos, decode, special_ids,
                                                     recorder, number, name))
                except (RuntimeError, ValueError, IndexError, MemoryError) as error:  # the summary is kept
                    found.append(_PartEvidence(None, (), {}, (f"{EVIDENCE_FAILED}: {type(error).__name__}: "
                                                              f"{str(error).splitlines()[0] if str(error) else ''}",)))
                self.progress(ProgressEvent("evidence", number + 1, len(parts), name))
        return found

    def _part_evidence(self, reader: SummaryReader, part: "_Part", store: Datastore, row: list[int], text: str,
                       eos: set[int], decode, special_ids: set[int], recorder: GenerationRecorder | None,
                       number: int, name: str = "") -> "_PartEvidence":
        started = time.perf_counter()
        ids = row[:returned_length(row, eos)]
        _, members = evidence.sentence_rows(text, ids, decode, special_ids, len(ids))
        if recorder is not None:
            reading = recorder.reading(number, reader, ids)
        else:
            reading = reader.read(store, ids, starts=[min(rows) - 1 for rows in members if rows])
        read = time.perf_counter()
        records: tuple = ()
        if part.document is not None and text:
            token_mass = reading.token_mass
            if part.start:  # a chapter's view numbers its tokens from its own start
                token_mass = evidence.TokenMass(token_mass.positions + part.start, token_mass.mass)
            support = None
            if self.retrieval.support:  # reported as sentences are measured: a whole book's take a while
                sentences = len(members)
                removal = self._removal(part, store) if self.retrieval.support_by == "removal" else None
                self.progress(ProgressEvent("support", 0, sentences, name))

                def support(found):
                    return supports_of(reader, reading, store, found, part.start, removal, on_measured=lambda done:
                                       self.progress(ProgressEvent("support", min(done, sentences), sentences, name)))

            records = evidence.build(text, ids, decode, special_ids, token_mass, part.document,
                                     part.encoded.token_ends, part.encoded.n_tokens,
                                     self.retrieval.evidence_passages, support=support)
            if support is not None:
                self.progress(ProgressEvent("support", sentences, sentences, name))
        return _PartEvidence(reading.coverage, records,
                             {"evidence": read - started, "support": time.perf_counter() - read})

    def _removal(self, part: "_Part", store: Datastore) -> StoreRemoval:
        """Support by removal over ``part``'s store: the document's windows encoded again without a sentence's
        passages, as the document was encoded."""
        encoded, encoder = part.encoded, self._encoder()
        plan = plan_windows(encoded.n_tokens, self._window(), self.encoding.overlap)
        if tuple(plan.kept(i) for i in range(plan.n_windows)) != tuple(tuple(w) for w in encoded.windows):
            raise RuntimeError("the book's windows are not the ones --support-by removal would encode again")
        weights = {}
        if store.keys is not None:
            weights["keys"] = key_weights(self.loaded.model, self.loaded.architecture)
            if store.keys.values is not None:
                weights["values"] = value_weights(self.loaded.model, self.loaded.architecture)
        return StoreRemoval(store, encoded.token_ids, plan, encoder.encode_ids, offset=part.start,
                            projections=weights)

    def _window(self) -> int:
        return self.encoding.window or self.loaded.max_source_length

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
