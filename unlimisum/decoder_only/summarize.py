"""Document -> Summary with a decoder-only model: prompt, read the prompt in chunks, generate, report.

The Summarizer (unlimisum/summarizer.py) hands documents here when its model is decoder-only. A
summary is what the model generates after the prompt; per chapter, each chapter gets a prompt of
its own (and is read again: unlike an encoder's states, a decoder's keys depend on the prompt
around the text). Evidence keeps per summary token the prompt positions its attention went to (sinks,
far tokens, the local window): recorded while generate() writes one row (greedy search, sampling), or,
after beam search, by a reread pass over the returned summary, all its tokens at once after the prompt,
each retrieving its own far tokens as it did while being generated.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace

import torch

from unlimisum.config import DecoderOnlyConfig, GenerationOptions, IndexConfig, PromptConfig
from unlimisum.decoder_only import reading, selection
from unlimisum.decoder_only.plan import (
    RetrievalPlan, default_retrieval_k, default_window, plan_retrieval, store_bytes_per_token, store_devices,
)
from unlimisum.decoder_only.prompting import Prompt, UnprotectedPromptWarning, build_prompt, unprotected_turn_end
from unlimisum.decoder_only.token_mass import TokenMassRecorder, rows_per_forward
from unlimisum.document import Document
from unlimisum.errors import EmptyDocumentError
from unlimisum.models import LoadedModel
from unlimisum.events import ProgressEvent
from unlimisum.results import EMPTY_SUMMARY, GenerationProgress, Summary, SummaryStats, peak_rss_bytes
from unlimisum import coverage, evidence
from unlimisum.coverage import chapter_token_ranges
from unlimisum.models import compat
from unlimisum.search import compiled, projections
from unlimisum.search.placement import storage_dtype

# summary tokens read at a time by the reread pass at most: each brings its own far tokens ([G, k, D] per layer)
EVIDENCE_CHUNK = 64


class DecoderOnlySummarizer:
    """Summarizes documents with a loaded decoder-only model; see ``Summarizer`` for the options."""

    def __init__(self, loaded: LoadedModel, *, window: int | None, index: IndexConfig, retrieval_k: int | None,
                 generation: GenerationOptions, decoder: DecoderOnlyConfig, prompt: PromptConfig, progress,
                 evidence: bool = True, evidence_passages: int = evidence.DEFAULT_PASSAGES):
        self.loaded, self.index, self.generation = loaded, index, generation
        self.decoder, self.prompt, self.progress = decoder, prompt, progress
        self.evidence, self.evidence_passages = evidence, evidence_passages
        self.max_positions = loaded.architecture.max_positions(loaded.model.config)
        self.window = window  # None: the whole prompt where it fits the model's positions (plan_retrieval)
        self.retrieval_k = retrieval_k if retrieval_k is not None else \
            default_retrieval_k(window if window is not None else default_window(self.max_positions))
        unprotected = unprotected_turn_end(loaded.tokenizer)
        if unprotected is not None:
            warnings.warn(unprotected, UnprotectedPromptWarning, stacklevel=4)  # the Summarizer's caller

    def summarize(self, document: Document, *, per_chapter: bool = False) -> Summary:
        """The whole document's summary; with ``per_chapter`` one per chapter too, each from its own prompt."""
        whole = self.summarize_text(document.text, document.title, document.source, document, quoted=(document, 0))
        starts = evidence.chapter_starts(document)
        chapters = [(chapter, start) for chapter, start in zip(document.chapters, starts) if chapter.text.strip()]
        if not per_chapter or len(chapters) < 2:
            return whole
        parts = []
        for number, (chapter, start) in enumerate(chapters):
            self.progress(ProgressEvent("chapter", number, len(chapters), chapter.title, {"titles": [chapter.title]}))
            parts.append(self.summarize_text(chapter.text, chapter.title, document.source, quoted=(document, start)))
        self.progress(ProgressEvent("chapter", len(chapters), len(chapters), chapters[-1][0].title, {"titles": []}))
        return replace(whole, chapters=tuple(parts))

    def summarize_text(self, text: str, title: str, source: str, document: Document | None = None, *,
                       quoted: tuple[Document, int] | None = None) -> Summary:
        """One summary: of ``document`` (coverage by its chapters) or of a chapter's text (coverage by windows).

        ``quoted``: the document evidence quotes from and where ``text`` starts in its text (None: no evidence).
        """
        if not text.strip():
            raise EmptyDocumentError("there is no text to summarize", source=source)
        loaded, name = self.loaded, title or source
        started = time.perf_counter()
        self.progress(ProgressEvent("tokenize", 0, 1, name))
        prompt = build_prompt(loaded.tokenizer, text, self.prompt, source)
        tokenized = time.perf_counter()
        self.progress(ProgressEvent("tokenize", 1, 1, name, {"tokens": prompt.n_tokens}))
        plan = self.plan(prompt)
        on_cuda = loaded.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(loaded.device)
        run = self._read_and_generate(prompt, plan, name, quoted is not None)
        output, mass, token_mass = run.output, run.mass, run.token_mass
        seconds = dict(tokenize=tokenized - started, **run.seconds)
        generated = output[0, prompt.n_tokens:]
        special = set(loaded.tokenizer.all_special_ids)
        stats = SummaryStats(
            model=loaded.name, input_tokens=prompt.n_tokens, windows=-(-(prompt.n_tokens - 1) // plan.chunk),
            window=plan.window, index_kind="kv-store", index_device=_device_name(plan),
            retrieval_k=plan.retrieval_k, datastore_bytes=run.store_bytes,
            generated_tokens=sum(t not in special for t in generated.tolist()), timings=seconds,
            peak_rss_bytes=peak_rss_bytes(), peak_gpu_bytes=torch.cuda.max_memory_allocated(loaded.device) if on_cuda
            else None, model_dtype=str(loaded.dtype).removeprefix("torch."),
            positions="true" if plan.true_positions else f"fixed distance {plan.fixed_distance}",
        )
        summary_text = loaded.tokenizer.decode(generated, skip_special_tokens=True).strip()
        text_mass = self._text_mass(mass, prompt)
        windows = coverage.window_ranges(text_mass.shape[0], [(start, min(start + plan.chunk, text_mass.shape[0]))
                                                              for start in range(0, text_mass.shape[0], plan.chunk)])
        if document is not None:
            chapters = chapter_token_ranges(document, prompt.text_token_ends, text_mass.shape[0])
            sections = [(chapter.title, chapter.start, chapter.end) for chapter in chapters]
        else:
            sections = windows
        found = ()
        if token_mass is not None and summary_text:
            found = self._evidence(summary_text, generated.tolist(), token_mass, prompt, quoted, len(text))
        return Summary(text=summary_text, title=title, source=source, stats=stats, token_ids=tuple(generated.tolist()),
                       coverage=coverage.spans(text_mass, sections), window_coverage=coverage.spans(text_mass, windows),
                       warnings=() if summary_text else (EMPTY_SUMMARY,), evidence=found)

    def plan(self, prompt: Prompt) -> RetrievalPlan:
        """The retrieval plan of one prompt: window, sinks, k, position regime, where the store lives."""
        config = self.loaded.model.config
        dtype = storage_dtype(self.index)
        per_token = store_bytes_per_token(config, self.loaded.architecture.layer_windows(config), dtype)
        half = (prompt.n_tokens - 1) * per_token // 2  # keys, and as many bytes of values
        keys_device, values_device, _ = store_devices(half, half, self.index, self.loaded.device)
        return plan_retrieval(
            prompt_tokens=prompt.n_tokens - 1, text_start=prompt.text_start,
            max_new_tokens=self.generation.max_new_tokens or 0, max_positions=self.max_positions, window=self.window,
            retrieval_k=self.retrieval_k, config=self.decoder, storage_dtype=dtype, keys_device=keys_device,
            values_device=values_device,
        )

    def _read_and_generate(self, prompt: Prompt, plan: RetrievalPlan, name: str, with_evidence: bool) -> "_Run":
        """Read the prompt, generate after it and, ``with_evidence``, read the summary once more (evidence pass)."""
        model, architecture = self.loaded.model, self.loaded.architecture
        options = self.generation
        kwargs = options.to_generate_kwargs()
        if options.seed is not None:
            torch.manual_seed(options.seed)
        tokenizer = self.loaded.tokenizer
        if getattr(model.generation_config, "pad_token_id", None) is None:
            kwargs.setdefault("pad_token_id", tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                              else tokenizer.eos_token_id)
        with_evidence = with_evidence and self.evidence
        n_read = prompt.n_tokens - 1
        chunks = -(-n_read // plan.chunk)
        info = {"tokens": n_read, "chunk": plan.chunk}
        total = kwargs.get("max_new_tokens")
        progress = GenerationProgress(lambda written: self.progress(ProgressEvent("generate", written, total, name)),
                                       tokenizer.all_special_ids)
        started = time.perf_counter()
        token_mass = None
        if plan.keys_device.type == "cpu" and n_read >= selection.GROUPED_SCAN_MIN_KEYS:
            compiled.warm(["select_grouped"], plan.storage_dtype)  # compiled while the prompt is read (first run)
        rows = max(kwargs.get(name) or 1 for name in ("num_beams", "num_return_sequences"))
        for counted in {1, rows}:  # the prompt's reading projects its last position; generate() its rows
            projections.prepare(model, counted)
        with torch.inference_mode(), projections.faster_projections(model), \
                reading.session(model, architecture, plan) as cache:
            self.progress(ProgressEvent("prefill", 0, chunks, name, info))
            reading.prefill(model, cache, prompt.ids[:-1], on_chunk=lambda done: self.progress(
                ProgressEvent("prefill", -(-done // plan.chunk), chunks, name, info)))
            cache.finish_prefill()
            cache.mark()
            read_at = time.perf_counter()
            mass = torch.zeros(n_read, device=self.loaded.device)
            rereads = with_evidence and self._rereads(kwargs)
            record = TokenMassRecorder(n_read) if with_evidence and not rereads else None  # recorded while generating
            cache.set_coverage(None if with_evidence else mass)  # with evidence: counted with it
            cache.set_evidence(record.add if record is not None else None)
            self.progress(ProgressEvent("generate", 0, total, name))
            output = reading.generate(model, cache, prompt.ids, stopping_criteria=[progress], **kwargs)
            rereads = rereads or (with_evidence and cache.evidence_skipped)  # generate() ran several rows
            cache.set_evidence(None)
            generated_at = time.perf_counter()
            if rereads:
                record = TokenMassRecorder(n_read)
                self._reread(cache, output[0], n_read, record)
            if with_evidence:
                mass, token_mass = record.results(output.shape[1] - prompt.n_tokens)
        finished = time.perf_counter()
        seconds = {"prefill": read_at - started, "generate": generated_at - read_at, "search": cache.search_seconds}
        if with_evidence:
            seconds["evidence"] = finished - generated_at
        return _Run(output, mass, token_mass, seconds, cache.store_bytes)

    def _rereads(self, kwargs: dict) -> bool:
        """Whether evidence needs the reread pass: with beams (or several sequences) the rows generate() runs
        are not the returned sequence's; one row (greedy search, sampling) is recorded while it is generated,
        each step its own token's. (A search that runs several rows otherwise is caught by the cache.)"""
        config = self.loaded.model.generation_config
        rows = [kwargs.get(name, getattr(config, name, 1)) for name in ("num_beams", "num_return_sequences")]
        return any((value or 1) > 1 for value in rows)

    def _reread(self, cache, row: torch.Tensor, n_read: int, record: TokenMassRecorder) -> None:
        """The reread pass over the returned sequence ``row`` [N + T] (prompt, then summary), into ``record``:
        back at the prompt's end, the summary is read up to EVIDENCE_CHUNK tokens at a time, each token retrieving
        its own far tokens; row t is the position that wrote summary token t."""
        model = self.loaded.model
        inputs = row[n_read:-1]  # the prompt's last token, then the summary but its last: position t writes token t
        cache.rewind()
        cache.set_evidence(record.add)
        argument = compat.cache_argument(model)
        device = next(model.parameters()).device
        chunk = rows_per_forward(n_read, EVIDENCE_CHUNK)
        for start in range(0, inputs.shape[0], chunk):
            ids = inputs[start:start + chunk].unsqueeze(0).to(device)
            positions = torch.arange(n_read + start, n_read + start + ids.shape[1], device=device).unsqueeze(0)
            model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{argument: cache})
        cache.set_evidence(None)

    def _evidence(self, text: str, ids: list[int], token_mass: evidence.TokenMass, prompt: Prompt,
                  quoted: tuple[Document, int], length: int) -> tuple[evidence.SentenceEvidence, ...]:
        """The summary's evidence: prompt positions made text positions (the template's own tokens left out),
        the text's token ends (``length`` characters in all) made characters of the quoted document's text."""
        document, offset = quoted
        n_text = prompt.text_end - prompt.text_start
        positions = token_mass.positions - prompt.text_start
        inside = (positions >= 0) & (positions < n_text)
        token_mass = evidence.TokenMass(positions.clamp(0, max(0, n_text - 1)), token_mass.mass * inside)
        if prompt.text_token_ends is not None:
            ends = [offset + end for end in prompt.text_token_ends]
        else:  # a tokenizer without offsets: the text's characters in proportion
            ends = [offset + round((i + 1) / n_text * length) for i in range(n_text)]
        tokenizer = self.loaded.tokenizer
        return evidence.build(text, ids, lambda part: tokenizer.decode(part, skip_special_tokens=True),
                              set(tokenizer.all_special_ids), token_mass, document, ends, n_text,
                              self.evidence_passages)

    @staticmethod
    def _text_mass(mass: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        """[text tokens] attention mass on the text (its last token may be the prompt's last, read by generate())."""
        text = mass[prompt.text_start:prompt.text_end].double().cpu()
        missing = (prompt.text_end - prompt.text_start) - text.shape[0]
        return torch.cat([text, text.new_zeros(missing)]) if missing > 0 else text


@dataclass(frozen=True)
class _Run:
    """What reading a prompt and generating after it gave."""

    output: torch.Tensor  # [1, N + T] ids: the prompt, then the summary
    mass: torch.Tensor  # [N - 1] attention mass per stored prompt token (the evidence pass's, when it ran)
    token_mass: evidence.TokenMass | None  # per summary token, from the evidence pass; None: it did not run
    seconds: dict  # per stage
    store_bytes: int  # the stored prompt's keys and values


def _device_name(plan: RetrievalPlan) -> str:
    keys = "gpu" if plan.keys_device.type == "cuda" else "cpu"
    values = "gpu" if plan.values_device.type == "cuda" else "cpu"
    return keys if keys == values else f"{keys} (values on {values})"
