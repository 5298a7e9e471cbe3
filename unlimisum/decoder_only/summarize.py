"""Document -> Summary with a decoder-only model: prompt, read the prompt in chunks, generate, report.

The Summarizer (unlimisum/summarizer.py) hands documents here when its model is decoder-only. A
summary is what the model generates after the prompt; per chapter, each chapter gets a prompt of
its own (and is read again: unlike an encoder's states, a decoder's keys depend on the prompt
around the text).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from unlimisum.config import DecoderOnlyConfig, GenerationOptions, IndexConfig, PromptConfig
from unlimisum.decoder_only import reading
from unlimisum.decoder_only.plan import (
    RetrievalPlan, default_retrieval_k, default_window, plan_retrieval, store_bytes_per_token, store_devices,
)
from unlimisum.decoder_only.prompting import Prompt, build_prompt
from unlimisum.document import Document
from unlimisum.errors import EmptyDocumentError
from unlimisum.models import LoadedModel
from unlimisum.events import ProgressEvent
from unlimisum.results import EMPTY_SUMMARY, GenerationProgress, Summary, SummaryStats, peak_rss_bytes
from unlimisum import coverage
from unlimisum.coverage import chapter_token_ranges
from unlimisum.unlimiformer.placement import storage_dtype


class DecoderOnlySummarizer:
    """Summarizes documents with a loaded decoder-only model; see ``Summarizer`` for the options."""

    def __init__(self, loaded: LoadedModel, *, window: int | None, index: IndexConfig, retrieval_k: int | None,
                 generation: GenerationOptions, decoder: DecoderOnlyConfig, prompt: PromptConfig, progress):
        self.loaded, self.index, self.generation = loaded, index, generation
        self.decoder, self.prompt, self.progress = decoder, prompt, progress
        self.max_positions = loaded.architecture.max_positions(loaded.model.config)
        self.window = window if window is not None else default_window(self.max_positions)
        self.retrieval_k = retrieval_k if retrieval_k is not None else default_retrieval_k(self.window)

    def summarize(self, document: Document, *, per_chapter: bool = False) -> Summary:
        """The whole document's summary; with ``per_chapter`` one per chapter too, each from its own prompt."""
        whole = self.summarize_text(document.text, document.title, document.source, document)
        chapters = [chapter for chapter in document.chapters if chapter.text.strip()]
        if not per_chapter or len(chapters) < 2:
            return whole
        parts = []
        for number, chapter in enumerate(chapters):
            self.progress(ProgressEvent("chapter", number, len(chapters), chapter.title, {"titles": [chapter.title]}))
            parts.append(self.summarize_text(chapter.text, chapter.title, document.source))
        self.progress(ProgressEvent("chapter", len(chapters), len(chapters), chapters[-1].title, {"titles": []}))
        return replace(whole, chapters=tuple(parts))

    def summarize_text(self, text: str, title: str, source: str, document: Document | None = None) -> Summary:
        """One summary: of ``document`` (coverage by its chapters) or of a chapter's text (coverage by windows)."""
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
        output, cache, mass, seconds = self._read_and_generate(prompt, plan, name)
        seconds = dict(tokenize=tokenized - started, **seconds)
        generated = output[0, prompt.n_tokens:]
        special = set(loaded.tokenizer.all_special_ids)
        stats = SummaryStats(
            model=loaded.name, input_tokens=prompt.n_tokens, windows=-(-(prompt.n_tokens - 1) // plan.window),
            window=plan.window, index_kind="kv-store", index_device=_device_name(plan),
            retrieval_k=plan.retrieval_k, datastore_bytes=cache.store_bytes,
            generated_tokens=sum(t not in special for t in generated.tolist()), timings=seconds,
            peak_rss_bytes=peak_rss_bytes(), peak_gpu_bytes=torch.cuda.max_memory_allocated(loaded.device) if on_cuda
            else None, model_dtype=str(loaded.dtype).removeprefix("torch."),
            positions="true" if plan.true_positions else f"fixed distance {plan.fixed_distance}",
        )
        summary_text = loaded.tokenizer.decode(generated, skip_special_tokens=True).strip()
        text_mass = self._text_mass(mass, prompt)
        windows = coverage.window_ranges(text_mass.shape[0], [(start, min(start + plan.window, text_mass.shape[0]))
                                                              for start in range(0, text_mass.shape[0], plan.window)])
        if document is not None:
            chapters = chapter_token_ranges(document, prompt.text_token_ends, text_mass.shape[0])
            sections = [(chapter.title, chapter.start, chapter.end) for chapter in chapters]
        else:
            sections = windows
        return Summary(text=summary_text, title=title, source=source, stats=stats, token_ids=tuple(generated.tolist()),
                       coverage=coverage.spans(text_mass, sections), window_coverage=coverage.spans(text_mass, windows),
                       warnings=() if summary_text else (EMPTY_SUMMARY,))

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

    def _read_and_generate(self, prompt: Prompt, plan: RetrievalPlan, name: str):
        """(output ids [1, N + T], the cache, attention mass per stored prompt token, seconds per stage)."""
        model, architecture = self.loaded.model, self.loaded.architecture
        options = self.generation
        kwargs = options.to_generate_kwargs()
        if options.seed is not None:
            torch.manual_seed(options.seed)
        tokenizer = self.loaded.tokenizer
        if getattr(model.generation_config, "pad_token_id", None) is None:
            kwargs.setdefault("pad_token_id", tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                              else tokenizer.eos_token_id)
        n_read = prompt.n_tokens - 1
        chunks = -(-n_read // plan.window)
        info = {"tokens": n_read, "window": plan.window}
        total = kwargs.get("max_new_tokens")
        progress = GenerationProgress(lambda written: self.progress(ProgressEvent("generate", written, total, name)),
                                       tokenizer.all_special_ids)
        started = time.perf_counter()
        with torch.inference_mode(), reading.session(model, architecture, plan) as cache:
            self.progress(ProgressEvent("prefill", 0, chunks, name, info))
            reading.prefill(model, cache, prompt.ids[:-1], on_chunk=lambda done: self.progress(
                ProgressEvent("prefill", -(-done // plan.window), chunks, name, info)))
            cache.finish_prefill()
            read_at = time.perf_counter()
            mass = torch.zeros(n_read, device=self.loaded.device)
            cache.set_coverage(mass)
            self.progress(ProgressEvent("generate", 0, total, name))
            output = reading.generate(model, cache, prompt.ids, stopping_criteria=[progress], **kwargs)
        finished = time.perf_counter()
        seconds = {"prefill": read_at - started, "generate": finished - read_at, "search": cache.search_seconds}
        return output, cache, mass, seconds

    @staticmethod
    def _text_mass(mass: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        """[text tokens] attention mass on the text (its last token may be the prompt's last, read by generate())."""
        text = mass[prompt.text_start:prompt.text_end].double().cpu()
        missing = (prompt.text_end - prompt.text_start) - text.shape[0]
        return torch.cat([text, text.new_zeros(missing)]) if missing > 0 else text


def _device_name(plan: RetrievalPlan) -> str:
    keys = "gpu" if plan.keys_device.type == "cuda" else "cpu"
    values = "gpu" if plan.values_device.type == "cuda" else "cpu"
    return keys if keys == values else f"{keys} (values on {values})"
