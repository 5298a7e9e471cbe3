"""Document -> EncodedDocument: tokenize, encode in overlapping windows, build the store; once.

With a cache of encoded books the states of a text already encoded by the same model and
settings are loaded (memory-mapped) instead, and a fresh encoding is stored for next time.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from unlimisum.models import checkpoint
from unlimisum.models.quantized import int8_linears
from unlimisum.models.tokens import encode_text, special_ids
from unlimisum.config import EncodingConfig, IndexConfig
from unlimisum.search import compiled, kernels, projections
from unlimisum.search.datastore import DatastoreBuilder, IndexPlan, TorchExactDatastore, plan_index
from unlimisum.document import Document
from unlimisum.coverage import chapter_token_ranges, token_char_ends
from unlimisum.events import ProgressEvent
from unlimisum.unlimiformer.encoded import EncodedDocument
from unlimisum.unlimiformer.cache import CacheKey, EncodedCache, text_sha256
from unlimisum.unlimiformer.encoding import WindowEncoder, WindowPlan, auto_batch_size, encode_windows, plan_windows
from unlimisum.search.keys import (
    KeyStore, KeyStoreBuilder, build_key_store, key_weights, matches, value_weights,
)
from unlimisum.search.placement import KeyStorePlan, free_memory, plan_key_store
from unlimisum.errors import ConfigError, EmptyDocumentError
from unlimisum.models import LoadedModel


@dataclass(frozen=True)
class EncodePlan:
    """What the summarizer decided before encoding: window, index options, and what the index must serve."""

    window: int
    index: IndexConfig  # storage dtype resolved
    retrieval_k: int
    queries_per_step: int  # heads x beams of one document
    support: bool = False  # each sentence's support is read: the key-store plan weighs those readings too
    summary_tokens: int = 0  # the most tokens a summary may write: the steps per-layer values would save at (0: none)


class DocumentEncoder:
    """Encodes documents with one loaded model; reports ``ProgressEvent``s through ``progress``."""

    def __init__(self, loaded: LoadedModel, encoding: EncodingConfig, plan: EncodePlan,
                 progress: Callable, cache: EncodedCache | None = None, int8_made: dict | None = None,
                 elsewhere: WindowEncoder | None = None):
        """``int8_made``: the int8 copies of the encoder's linear layers made so far (``encoding.int8``), kept by
        the caller so that they are made once per model. ``elsewhere``: what encodes a fresh document's windows
        instead of this process (the Ray engine's workers); None: this process."""
        self.loaded, self.encoding, self.plan, self.progress, self.cache = loaded, encoding, plan, progress, cache
        self.int8_made = int8_made if int8_made is not None else {}
        self.elsewhere = elsewhere

    def encode(self, document: Document) -> EncodedDocument:
        """The document's tokens, states, windows and chapter ranges (from the cache when it has them)."""

        text = document.text
        if not text.strip():
            raise EmptyDocumentError("there is no text to summarize", source=document.source)
        name = document.title or document.source
        key = self._cache_key(text) if self.cache is not None else None
        if key is not None:
            started = time.perf_counter()
            self.progress(ProgressEvent("cache", 0, 1, name))
            loaded = self.cache.load(key)
            if loaded is not None:
                encoded = self._from_cache(document, name, loaded)
                encoded.seconds["cache_load"] = time.perf_counter() - started
                self.progress(ProgressEvent("cache", 1, 1, name, {"tokens": encoded.n_tokens,
                                                                   "bytes": encoded.store.nbytes}))
                return encoded
        encoded = self._encode(document, name)
        if key is not None:
            meta = {"title": document.title, "source": document.source, "windows": [list(w) for w in encoded.windows]}
            ends = torch.tensor(encoded.token_ends, dtype=torch.long) if encoded.token_ends is not None else None
            keys = encoded.store.keys.keys if encoded.store.keys is not None else None
            self.cache.store(key, encoded.store.states(), encoded.token_ids, meta, token_ends=ends, keys=keys)
        return encoded

    # -- fresh encoding -----------------------------------------------------------------------------

    def tokenize(self, document: Document) -> tuple[torch.Tensor, list[int] | None]:
        """All tokens, the tokenizer's own special tokens around the text included, no truncation: ([N]
        int64, each token's end character or None for tokenizers without offsets). The strings of added
        tokens in the text (``</s>``, ``<mask>``, ``<tool_call>``) are tokenized as text
        (unlimisum/models/tokens.py)."""
        text, tokenizer = document.text, self.loaded.tokenizer
        try:
            encoding = encode_text(tokenizer, text, add_special_tokens=True, offsets=True)
            ends = token_char_ends(encoding.offsets)
        except NotImplementedError:  # slow (Python) tokenizers have no offsets
            encoding, ends = encode_text(tokenizer, text, add_special_tokens=True), None
        ids = encoding.ids
        unknown, special = tokenizer.unk_token_id, special_ids(tokenizer)
        checkpoint.check_encoding(len(ids), sum(i in special for i in ids),
                                  sum(i == unknown for i in ids) if unknown is not None else 0, text,
                                  source=document.source)
        return torch.tensor(ids, dtype=torch.long), ends

    def _encode(self, document: Document, name: str) -> EncodedDocument:

        started = time.perf_counter()
        self.progress(ProgressEvent("tokenize", 0, 1, name))
        input_ids, ends = self.tokenize(document)
        tokenized = time.perf_counter()
        n_tokens = len(input_ids)
        self.progress(ProgressEvent("tokenize", 1, 1, name, {"tokens": n_tokens}))

        windows = plan_windows(n_tokens, self.plan.window, self.encoding.overlap)
        builder = DatastoreBuilder(n_tokens, self.loaded.model.config.d_model, self._index_plan(n_tokens),
                                   self.plan.index)
        keys_plan = self._key_store_plan(n_tokens, builder.plan)
        compiling = None
        if builder.plan.kind == "exact":  # a first run on this machine compiles its kernels while it encodes
            compiling = compiled.warm(kernels.compiled_kernels_for(n_tokens, builder.dtype, builder.plan.device,
                                                                   builder.dim, per_layer=keys_plan.kind == "per-layer",
                                                                   values=keys_plan.values), builder.dtype,
                                      also=projections.compiled_kernels(self.loaded.model))
        keys = None
        if keys_plan.kind == "per-layer":  # each window's kept states projected once per layer, as they come
            values = value_weights(self.loaded.model, self.loaded.architecture) if keys_plan.values else None
            keys = KeyStoreBuilder(n_tokens, key_weights(self.loaded.model, self.loaded.architecture),
                                   builder.dtype, builder.plan.device, values)
        batch_size = self.encoding.batch_size or auto_batch_size(windows.window, windows.n_windows, self.loaded.device)
        if batch_size < 1:
            raise ConfigError(f"encode batch size must be at least 1, got {batch_size}")
        info = {"tokens": n_tokens, "index": builder.plan.kind, "index_device": builder.plan.device,
                "key_store": keys_plan.kind, "key_store_reason": keys_plan.reason}
        sink = builder.add if keys is None else lambda states: (builder.add(states), keys.add(states))
        self.progress(ProgressEvent("encode", 0, windows.n_windows, name, info))
        encode = self.elsewhere.encode if self.elsewhere is not None else self.encode_windows
        with compiled.core_for(compiling if self.elsewhere is None else None) as when_compiled:
            def on_batch(done: int) -> None:
                when_compiled()
                self.progress(ProgressEvent("encode", done, windows.n_windows, name, info))

            encode(input_ids, windows, sink, batch_size=batch_size, on_batch=on_batch)
        encoded_at = time.perf_counter()
        self.progress(ProgressEvent("index", 0, 1, name, info))
        store = builder.finish()
        store.keys = keys.finish() if keys is not None else None
        if store.keys is not None:
            store.keys = self._with_values(store, builder.plan, name)
        finished = time.perf_counter()
        self.progress(ProgressEvent("index", 1, 1, name, dict(info, bytes=store.nbytes,
                                                              key_store_bytes=_key_bytes(store),
                                                              key_store_values=store.keys is not None
                                                              and store.keys.values is not None)))
        seconds = {"tokenize": tokenized - started, "encode": encoded_at - tokenized, "index": finished - encoded_at}
        kept = tuple(windows.kept(i) for i in range(windows.n_windows))
        chapters = chapter_token_ranges(document, ends, n_tokens)
        return EncodedDocument(name, input_ids, store, kept, chapters, seconds, token_ends=ends)

    def encode_windows(self, input_ids: torch.Tensor, plan: WindowPlan, sink: Callable[[torch.Tensor], None], *,
                       batch_size: int, on_batch: Callable[[int], None] | None = None) -> None:
        """Encode the windows of ``plan`` over ``input_ids`` [N] in this process and hand each one's kept states
        [n_kept, d] to ``sink``, in order (``encoding.encode_windows``, through the architecture's encoding path
        and, with ``--encode-int8``, int8 linear layers)."""
        encoder = self.loaded.model.get_encoder()
        int8 = int8_linears(encoder, self.int8_made) if self.encoding.int8 else nullcontext()
        with self.loaded.architecture.encoding(encoder), int8:
            encode_windows(encoder, input_ids, plan, sink, batch_size=batch_size,
                           encoder_inputs=self.loaded.architecture.encoder_inputs,
                           kept_rows=self.loaded.architecture.kept_rows, on_batch=on_batch)

    def encode_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[n, d] encoder states of one sequence ``input_ids`` [n] (at most a window), encoded as the document's
        windows were (the architecture's encoding path, int8 linear layers with ``--encode-int8``), in the
        model's dtype: support by removal encodes windows again without a sentence's passages."""
        kept = []
        self.encode_windows(input_ids, plan_windows(len(input_ids), max(2, len(input_ids)), 0.0), kept.append,
                            batch_size=1)
        return torch.cat(kept)

    def _key_store_plan(self, n_tokens: int, index: IndexPlan, *, top_k_values: bool = False,
                        free_bytes: int | None = None) -> KeyStorePlan:
        """The shared store or per-layer keys for this model (placement.plan_key_store): with their values for
        dense steps where they fit, and with ``top_k_values`` for top-k steps where they pay (``free_bytes``: the
        memory for the store, the keys and the values, None: measured now)."""
        weights = key_weights(self.loaded.model, self.loaded.architecture)
        if not weights:
            return KeyStorePlan("shared", 0, "shared store: the decoder has no cross-attention layers")
        heads, head_dim, dim = weights[0].shape
        return plan_key_store(n_tokens, dim, len(weights), heads, head_dim, self.plan.index, index,
                              queries_per_head=max(1, self.plan.queries_per_step // heads),
                              retrieval_k=self.plan.retrieval_k, support=self.plan.support,
                              summary_tokens=self.plan.summary_tokens if top_k_values else 0,
                              free_bytes=free_bytes)

    def _with_values(self, store, index: IndexPlan, name: str) -> KeyStore:
        """``store.keys``, with each layer's values where the plan keeps them for top-k steps: decided once the
        book is encoded (or loaded), so that what they save is measured with the compiled sums a first run
        compiles meanwhile, and projected from the stored states as a cached book's are."""
        keys = store.keys
        if keys.values is not None or self._dense(store.n_tokens) or not self.plan.summary_tokens:
            return keys
        resident = store.nbytes + keys.nbytes  # held already: the plan's budget counts them
        plan = self._key_store_plan(store.n_tokens, index, top_k_values=True,
                                    free_bytes=free_memory(index.device) + resident)
        if not plan.values:
            return keys
        self.progress(ProgressEvent("keys", 0, store.n_tokens, name))
        return build_key_store(store.states(), key_weights(self.loaded.model, self.loaded.architecture),
                               value_weights=value_weights(self.loaded.model, self.loaded.architecture),
                               keys=keys.keys, on_rows=lambda done: self.progress(
                                   ProgressEvent("keys", done, store.n_tokens, name)))

    def _cached_keys(self, cached, store, plan: IndexPlan, name: str = ""):
        """The per-layer keys of a cached book when the plan wants them: the entry's own (memory-mapped) when it
        has them for this model's shape, else rebuilt from its states; the values, when the plan keeps them,
        always built from the states (the cache keeps keys only); None for the shared store."""
        keys_plan = self._key_store_plan(store.n_tokens, plan)
        if store.kind == "exact":  # a first run on this machine compiles its kernels while the keys are built
            compiled.warm(kernels.compiled_kernels_for(store.n_tokens, store.storage_dtype, store.states().device,
                                                       store.dim, per_layer=keys_plan.kind == "per-layer",
                                                       values=keys_plan.values), store.storage_dtype,
                          also=projections.compiled_kernels(self.loaded.model))
        if store.kind != "exact" or keys_plan.kind != "per-layer":
            return None
        weights = key_weights(self.loaded.model, self.loaded.architecture)
        values = value_weights(self.loaded.model, self.loaded.architecture) if keys_plan.values else None
        stored = cached.keys
        built = lambda done: self.progress(ProgressEvent("keys", done, store.n_tokens, name))  # noqa: E731
        if stored is not None and matches(stored, weights, store.n_tokens, store.storage_dtype):
            if values is None:
                return KeyStore(stored.to(store.states().device))  # no copy on the CPU
            built(0)
            return build_key_store(store.states(), weights, value_weights=values, keys=stored, on_rows=built)
        built(0)
        return build_key_store(store.states(), weights, value_weights=values, on_rows=built)

    def _dense(self, n_tokens: int) -> bool:
        """Whether every head attends to every one of ``n_tokens`` tokens (its values summed by the dense kernels)."""
        return self.plan.retrieval_k >= n_tokens

    def _index_plan(self, n_tokens: int) -> IndexPlan:
        return plan_index(n_tokens, self.loaded.model.config.d_model, self.plan.index, retrieval_k=self.plan.retrieval_k,
                          queries_per_step=self.plan.queries_per_step, model_device=self.loaded.device)

    # -- the cache ---------------------------------------------------------------------------------

    def _cache_key(self, text: str) -> CacheKey:
        return CacheKey(
            text_sha256=text_sha256(text), model=model_identity(self.loaded), tokenizer=tokenizer_identity(self.loaded),
            window=self.plan.window, overlap=self.encoding.overlap, storage_dtype=self.plan.index.storage_dtype,
            model_dtype=str(self.loaded.dtype).removeprefix("torch."), device_type=self.loaded.device.type,
            software=software_identity(self.loaded, int8=self.encoding.int8),
        )

    def _from_cache(self, document: Document, name: str, cached) -> EncodedDocument:
        """The cached states and tokens; the chapters are this document's own, mapped through the cached
        token offsets (the same text may come split into other chapters, with other titles)."""
        states, n_tokens = cached.states, cached.states.shape[0]
        plan = self._index_plan(n_tokens)
        if plan.kind == "exact" and plan.device == "cpu":
            store = TorchExactDatastore(states, "exact", "cpu", states.numel() * states.element_size())  # mapped
        else:  # a GPU store or an approximate index is built from the mapped states
            builder = DatastoreBuilder(n_tokens, states.shape[1], plan, self.plan.index)
            for start in range(0, n_tokens, 65_536):
                builder.add(states[start:start + 65_536])
            store = builder.finish()
        store.keys = self._cached_keys(cached, store, plan, name)
        if store.keys is not None:
            store.keys = self._with_values(store, plan, name)
        windows = tuple(tuple(w) for w in cached.meta["windows"])
        ends = cached.token_ends.tolist() if cached.token_ends is not None else None
        chapters = chapter_token_ranges(document, ends, n_tokens)
        return EncodedDocument(name, cached.token_ids, store, windows, chapters, {}, cached=True, token_ends=ends)


def model_identity(loaded: LoadedModel) -> str:
    """The model's name and revision: the hub commit or a local folder's fingerprint, else a hash of the
    weights (computed once per loaded model)."""
    if not loaded.fingerprint:
        digest = hashlib.sha256()
        for name, tensor in loaded.model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        loaded.fingerprint = f"weights:{digest.hexdigest()[:16]}"
    return f"{loaded.name}@{loaded.fingerprint}"


def software_identity(loaded: LoadedModel, int8: bool = False) -> str:
    """What else changes the tokens or the states' last bits: the transformers, tokenizers and torch releases,
    the attention kernel and the code path the encoder runs (the model's own, or unlimisum's blocked local
    attention for LED; the last layer on a window's kept rows alone, models/kept_rows.py; ``int8``: its linear
    layers in int8); the unlimisum release is in every key too (CacheKey.unlimisum)."""
    import tokenizers
    import transformers

    attention = getattr(loaded.model.config, "_attn_implementation", None) or "default"
    version = ".".join(transformers.__version__.split(".")[:2])
    fast = getattr(loaded.architecture, "fast_encoding", None)
    path = f"{fast.__module__}.{fast.__name__}" if fast is not None else "the model's own"
    if getattr(loaded.architecture, "kept_rows", None) is not None:
        path += ", the last layer on the kept rows"
    backend = ".".join(tokenizers.__version__.split(".")[:2])
    linears = "; linear layers int8" if int8 else ""
    return (f"transformers {version}; tokenizers {backend}; torch {torch.__version__.split('+')[0]}; "
            f"attention {attention}; encoder {path}{linears}")


def tokenizer_identity(loaded: LoadedModel) -> str:
    """The tokenizer's source and a hash of its vocabulary (computed once per loaded model)."""
    if not loaded.tokenizer_fingerprint:
        vocabulary = json.dumps(loaded.tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
        loaded.tokenizer_fingerprint = hashlib.sha256(vocabulary.encode()).hexdigest()[:16]
    return f"{loaded.tokenizer_name or loaded.name}#{loaded.tokenizer_fingerprint}"


def _key_bytes(store) -> int:
    """Bytes of a store's per-layer keys (0: it has none)."""
    return store.keys.nbytes if store.keys is not None else 0
