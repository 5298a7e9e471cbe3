"""RetrievalCache: a transformers Cache whose full-attention layers keep the whole prompt in a store.

Every layer's attention calls ``cache.update(keys, values, layer_idx)`` with its post-rotary keys
and values, then the attention function (attention.py), which hands the layer's queries back to
the same layer here: the layer knows what it stored and decides what each query attends to.

- ``RetrievalLayer`` (full attention): the prompt's keys and values in a 16-bit store
  ``[G, N, D]`` (``store.py``), shared by every beam; the tokens generate() adds (the prompt's
  last token, then the summary) in a small per-row tail. A query attends to the sinks, the
  exact local window (the prompt's last W tokens and the tail; during prefill, the previous
  chunk and its own), and the top-k far tokens per KV head (selection.py), in one softmax
  (parts.py).
- ``WindowLayer`` (sliding.py, sliding-window attention): the last ``window - 1`` tokens,
  attended exactly, as the model does; nothing older is kept.

Beam search reorders only the tails and windows: the store is the same for every beam.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from unlimisum.decoder_only import flash, selection
from unlimisum.decoder_only.attention import check_updated
from unlimisum.decoder_only.parts import Part, attend, causal, grouped, ungrouped
from unlimisum.decoder_only.plan import RetrievalPlan
from unlimisum.decoder_only.positions import Rotation
from unlimisum.decoder_only.sliding import WindowLayer
from unlimisum.decoder_only.store import LayerStore
from unlimisum.search import kernels


def _gather(stored: torch.Tensor, ids: torch.Tensor, device) -> torch.Tensor:
    """stored [G, n, D], ids [..., G, m] (per KV head) -> [..., G, m, D] on ``device``, gathered where stored lives."""
    ids = ids.to(stored.device)
    heads = torch.arange(stored.shape[0], device=stored.device).view(-1, 1)
    return stored[heads, ids].to(device)


# a generation step's window is widened to float32 once where it holds at most this many prompt tokens (the
# default window's); a whole prompt read exactly stays as stored, each step widening it as it attends, so that
# the store is not held twice (a widened copy is twice a 16-bit store)
WIDENED_WINDOW_TOKENS = 4096


def leaving_keys(plan: RetrievalPlan, first_local: int) -> int:
    """How many keys of the local window that starts at ``first_local`` (its first ones) leave the window while
    the prompt is read: only those need the attention they draw, which chooses their block's representatives.
    The last chunk's window starts at the latest; no key at or after its start leaves."""
    last_first_local = max((plan.prompt_tokens - 1) // plan.chunk * plan.chunk - plan.window, 0)
    return max(0, last_first_local - first_local)


class RetrievalLayer(CacheLayerMixin):
    """One full-attention layer: the prompt in a store, generated tokens in a per-row tail."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, plan: RetrievalPlan, rotation: Rotation | None = None):
        super().__init__()
        self.plan, self.rotation = plan, rotation
        self.store: LayerStore | None = None
        self.prefilling = True
        self.blocks = selection.BlockIndex(plan.block_size, plan.block_representatives)
        self.received: torch.Tensor | None = None  # [G, N] fp32: attention drawn while local (block mode)
        self.tail_keys = self.tail_values = None  # [B, G, T, D] in the model's dtype
        self.prompt_window = None  # (keys, values) [G, W, D] of the prompt's window while generating, post-rotary
        self.coverage: torch.Tensor | None = None  # [N] fp32, set by the caller: attention mass while generating
        # evidence (set by the caller, one row only): every query selects its own far tokens, and
        # evidence(first, positions [C, M], mass [C, M]) gets each query's attention per prompt position;
        # ``first``: the call's first query, counted from the first token after the stored prompt
        self.evidence = None
        self.evidence_skipped = False  # a call of several rows came while evidence was set: not recorded
        self.search_seconds = 0.0
        self.choice: kernels.KernelChoice | None = None
        self.updated: torch.Tensor | None = None  # the keys of this call, set by update(), taken by attend()

    # -- the Cache layer interface --------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, kv_heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.compute_dtype = torch.promote_types(key_states.dtype, torch.float32)  # float32, or a float64 model's
        plan = self.plan
        self.store = LayerStore(plan.prompt_tokens, kv_heads, head_dim, plan.storage_dtype,
                                plan.keys_device, plan.values_device)
        if plan.prefill_selection == "blocks":
            self.received = torch.zeros(kv_heads, plan.prompt_tokens, device=self.device)
        self.choice = kernels.kernel_for(plan.keys_device, plan.storage_dtype, head_dim)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the prompt's keys (prefill) or append to the tail (generate); return them unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.updated = key_states
        if self.prefilling:
            if key_states.shape[0] != 1:
                raise RuntimeError("unlimisum reads one prompt at a time")
            keys = key_states[0]
            start = self.store.n_tokens
            if not self.plan.true_positions and start + keys.shape[1] > self.plan.sinks:
                canonical = self.rotation.derotate(keys, torch.arange(start, start + keys.shape[1]))
                first = max(0, self.plan.sinks - start)  # sinks keep their true positions
                keys = torch.cat([keys[:, :first].to(canonical.dtype), canonical[:, first:]], dim=1)
            self.store.append(keys, value_states[0])
            return key_states, value_states
        if self.tail_keys is None:
            self.tail_keys, self.tail_values = key_states, value_states
        else:
            self.tail_keys = torch.cat([self.tail_keys, key_states], dim=2)
            self.tail_values = torch.cat([self.tail_values, value_states], dim=2)
        return key_states, value_states

    def get_seq_length(self) -> int:
        stored = self.store.n_tokens if self.store is not None else 0
        return stored + (self.tail_keys.shape[2] if self.tail_keys is not None else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.tail_keys is not None:
            self.tail_keys = self.tail_keys.index_select(0, beam_idx.to(self.tail_keys.device))
            self.tail_values = self.tail_values.index_select(0, beam_idx.to(self.tail_values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.tail_keys is not None:
            self.tail_keys = self.tail_keys.repeat_interleave(repeats, dim=0)
            self.tail_values = self.tail_values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.tail_keys is not None:
            self.tail_keys, self.tail_values = self.tail_keys[indices], self.tail_values[indices]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("unlimisum's retrieval cache cannot be cropped (assisted decoding)")

    def reset(self) -> None:
        raise NotImplementedError("unlimisum's retrieval cache holds one prompt; make a new one")

    # -- attention --------------------------------------------------------------------------------

    def finish_prefill(self) -> None:
        """The prompt is stored: from now on update() appends to the tail. Frees what only prefill needs."""
        self.prefilling = False
        self.received = None
        self.blocks = None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               softcap: float | None) -> torch.Tensor:
        """query [B, H, C, D], this call's key/value [B, G, C, D] (already stored) -> [B, C, H, D]."""
        check_updated(self.updated, key)
        self.updated = None
        q = grouped(query, key.shape[1])
        out = self._prefill(q, key, value, scaling, softcap) if self.prefilling else \
            self._decode(q, scaling, softcap)
        return ungrouped(out, query)

    def _window_keys(self, start: int, end: int) -> torch.Tensor:
        """Post-rotary keys [G, n, D] of stored prompt tokens [start, end) (rotated back in the fixed regime)."""
        keys = self.store.keys[:, start:end].to(self.device)
        if self.plan.true_positions or end <= self.plan.sinks:
            return keys
        first = max(0, self.plan.sinks - start)
        rotated = self.rotation.rotate(keys[:, first:], torch.arange(start + first, end))
        return torch.cat([keys[:, :first].to(rotated.dtype), rotated], dim=1)

    def _far_queries(self, q: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries that score far keys, queries that score the sinks) [B, G, g, C, D]."""
        if self.plan.true_positions:
            return q, q
        distance = self.plan.fixed_distance
        return (self.rotation.turn(q, positions, distance),
                self.rotation.turn(q, positions, distance + self.plan.sinks))

    def _ranges(self, first_local: int) -> tuple[int, int, int]:
        """(sink end, far start, far end) for a query whose exact window starts at ``first_local``."""
        sinks = min(self.plan.sinks, first_local)
        return sinks, self.plan.sinks, max(self.plan.sinks, first_local)

    def _prefill(self, q, key, value, scaling, softcap) -> torch.Tensor:
        plan, store = self.plan, self.store
        n_queries = key.shape[2]
        end = store.n_tokens
        start = end - n_queries  # this chunk's positions
        first_local = max(start - plan.window, 0)
        sink_end, far_start, far_end = self._ranges(first_local)
        positions = torch.arange(start, end)
        q_far, q_sink = self._far_queries(q, positions)

        sink_part = Part(store.keys[:, :sink_end].to(self.device), store.values[:, :sink_end].to(self.device),
                         "shared", queries=q_sink)
        far_part = self._prefill_far(q_far, far_start, far_end)
        fast = flash.usable(q, [sink_part, far_part], softcap)
        dtype = q.dtype if fast else self.compute_dtype  # the flash kernel reads 16-bit keys as they are
        local_keys = torch.cat([self._window_keys(first_local, start).to(dtype), key[0].to(dtype)], dim=1)
        local_values = torch.cat([store.values[:, first_local:start].to(self.device, dtype), value[0].to(dtype)], dim=1)
        local_part = Part(local_keys, local_values, "shared", causal_tail=n_queries)  # the window, then the chunk
        parts = [sink_part, far_part, local_part]
        leaving = leaving_keys(plan, first_local) if self.received is not None else 0
        with_mass = leaving > 0
        if fast:  # the mass of the keys that leave (where the others would cost work of their own)
            out, local_mass = flash.attend(q, parts, scaling, 2 if with_mass else None, mass_keys=leaving)
        else:
            mass = [] if with_mass else None
            out = attend(q, parts, scaling, softcap, mass)
            local_mass = mass[2].sum(dim=0) if mass is not None else None
        if local_mass is not None:
            self.received[:, first_local:end] += local_mass
        return out

    def _prefill_far(self, q_far, far_start: int, far_end: int) -> Part:
        """The far tokens of a prefill chunk: all of them (no more than k), top-k per query (tokens), or blocks."""
        plan, store = self.plan, self.store
        n_far = far_end - far_start
        keys, values = store.keys[:, far_start:far_end], store.values[:, far_start:far_end]
        if n_far <= plan.retrieval_k:
            return Part(keys.to(self.device), values.to(self.device), "shared", queries=q_far)
        if plan.prefill_selection == "tokens":
            dtype = self.compute_dtype
            scores = torch.einsum("bghcd,gnd->bghcn", q_far.to(dtype), keys.to(self.device, dtype))
            ids = selection.token_ids(scores, plan.retrieval_k)[0]  # [G, C, k]
            heads = torch.arange(ids.shape[0], device=ids.device).view(-1, 1, 1)
            return Part(keys.to(self.device)[heads, ids].unsqueeze(0), values.to(self.device)[heads, ids].unsqueeze(0),
                        "per_query", queries=q_far)
        if self.blocks.end < far_end:  # tokens that left the window since the last chunk become blocks
            first = max(self.blocks.end, far_start)
            self.blocks.add(first, store.keys[:, first:far_end].to(self.device), self.received[:, first:far_end])
        ids, valid = self.blocks.select(q_far, plan.retrieval_k)
        return Part(_gather(keys, ids - far_start, self.device), _gather(values, ids - far_start, self.device),
                    "shared", mask=valid.view(1, valid.shape[0], 1, 1, -1), queries=q_far)

    def _decode(self, q, scaling, softcap) -> torch.Tensor:
        plan, store = self.plan, self.store
        prompt = store.n_tokens
        tail = self.tail_keys.shape[2]
        n_queries = q.shape[3]
        first_local = max(prompt - plan.window, 0)
        sink_end, far_start, far_end = self._ranges(first_local)
        positions = torch.arange(prompt + tail - n_queries, prompt + tail)
        q_far, q_sink = self._far_queries(q, positions)
        if self.prompt_window is None:  # the same for every step: widened once where that is a window's worth
            dtype = self.compute_dtype if prompt - first_local <= WIDENED_WINDOW_TOKENS else None
            self.prompt_window = (self._window_keys(first_local, prompt).to(dtype=dtype),
                                  store.values[:, first_local:prompt].to(self.device, dtype))

        started = time.perf_counter()
        per_query = self.evidence is not None
        if per_query and q.shape[0] != 1:  # several rows (beams, several sequences): the reread pass keeps it
            self.evidence_skipped, per_query = True, False
        far_part, far_ids = self._decode_far(q_far, far_start, far_end, per_query)
        self.search_seconds += time.perf_counter() - started
        parts = [
            Part(store.keys[:, :sink_end].to(self.device), store.values[:, :sink_end].to(self.device), "shared",
                 queries=q_sink),
            far_part,
            Part(*self.prompt_window, "shared"),
            Part(self.tail_keys, self.tail_values, "batched",
                 mask=causal(tail - n_queries, n_queries, 0, tail, self.device)),
        ]
        mass = [] if self.coverage is not None or per_query else None
        out = attend(q, parts, scaling, softcap, mass, per_query_mass=per_query)
        if per_query:
            if far_ids is not None and far_ids.dim() == 3:  # [B, G, k]: one query's
                far_ids = far_ids.unsqueeze(2)
            self._add_evidence(mass, tail - n_queries, sink_end, far_ids, far_start, first_local, prompt)
        elif mass is not None:
            self._add_coverage(mass, sink_end, far_ids, first_local, prompt)
        return out

    def _decode_far(self, q_far, far_start: int, far_end: int, per_query: bool = False):
        """(far part, its token ids [B, G, k] or None when every far token is in it) of a generation step;
        ``per_query``: each query selects its own (the evidence pass reads the summary's tokens at once, and
        each of them retrieves as it did while being generated): ids [B, G, C, k]."""
        plan, store = self.plan, self.store
        keys, values = store.keys[:, far_start:far_end], store.values[:, far_start:far_end]
        if far_end - far_start <= plan.retrieval_k:
            return Part(keys.to(self.device), values.to(self.device), "shared", queries=q_far), None
        b, heads, group, n_queries, dim = q_far.shape
        if per_query and n_queries > 1:  # one query selects as a generation step does: the path below
            rows = q_far.permute(0, 3, 1, 2, 4).reshape(b * n_queries, heads, group, dim).to(keys.device)
            ids = selection.decode_ids(keys, rows.float(), plan.retrieval_k, self.choice)  # [B*C, G, k]
            ids = ids.view(b, n_queries, heads, -1)  # [B, C, G, k]
            far_keys = _gather(keys, ids, self.device).permute(0, 2, 1, 3, 4)  # [B, G, C, k, D]
            far_values = _gather(values, ids, self.device).permute(0, 2, 1, 3, 4)
            return (Part(far_keys, far_values, "per_query", queries=q_far),
                    ids.permute(0, 2, 1, 3).to(self.device) + far_start)
        rows = q_far.reshape(b, heads, group * n_queries, dim).to(keys.device)  # every query of the step selects
        ids = selection.decode_ids(keys, rows.float(), plan.retrieval_k, self.choice)  # [B, G, k]
        far_keys, far_values = _gather(keys, ids, self.device), _gather(values, ids, self.device)  # [B, G, k, D]
        return Part(far_keys, far_values, "batched", queries=q_far), ids.to(self.device) + far_start

    def _add_coverage(self, mass, sink_end: int, far_ids, first_local: int, prompt: int) -> None:
        """Attention mass per prompt token, summed over rows, heads and queries."""
        sinks, far, local = mass[:3]  # [B, G, n]: summed over the query heads and queries already
        self.coverage[:sink_end] += sinks.sum(dim=(0, 1))
        if far_ids is None:
            far_start = self.plan.sinks
            self.coverage[far_start:far_start + far.shape[-1]] += far.sum(dim=(0, 1))
        else:
            self.coverage.index_add_(0, far_ids.reshape(-1), far.reshape(-1))
        self.coverage[first_local:prompt] += local.sum(dim=(0, 1))

    def _add_evidence(self, mass, first: int, sink_end: int, far_ids, far_start: int, first_local: int,
                      prompt: int) -> None:
        """Each query's attention per prompt position (sinks, far tokens, the prompt's window; not the
        generated tail), summed over heads, handed to ``evidence`` as positions and mass [C, M]."""
        sinks, far, local = (part[0] for part in mass[:3])  # [G, C, n]: summed over the query heads
        queries = sinks.shape[1]

        def span(start: int, end: int) -> torch.Tensor:
            return torch.arange(start, end, device=self.device).expand(queries, -1)

        if far_ids is None:  # every far token, in order
            far_positions, far_mass = span(far_start, far_start + far.shape[-1]), far.sum(dim=0)
        else:  # [G, C, k] ids and mass: each KV head's own
            far_positions = far_ids[0].permute(1, 0, 2).reshape(queries, -1)
            far_mass = far.permute(1, 0, 2).reshape(queries, -1)
        self.evidence(first, torch.cat([span(0, sink_end), far_positions, span(first_local, prompt)], dim=1),
                      torch.cat([sinks.sum(dim=0), far_mass, local.sum(dim=0)], dim=1))


class RetrievalCache(Cache):
    """The Cache of one prompt: a RetrievalLayer per full-attention layer, a WindowLayer per sliding one."""

    def __init__(self, plan: RetrievalPlan, layer_windows: list[int | None], rotation: Rotation | None = None):
        if not plan.true_positions and rotation is None:
            raise ValueError("the fixed-distance regime needs the model's rotation")
        layers = [RetrievalLayer(plan, rotation) if window is None else WindowLayer(window) for window in layer_windows]
        super().__init__(layers=layers)
        self.plan = plan

    def __bool__(self) -> bool:
        """False: transformers' Phi-3 drops a truthy cache when the sequence first passes its
        original_max_position_embeddings (to recompute it with longrope's long factors), which would lose the
        stored prompt; the prompt was read with the factors of the whole run (positions.pinned_length)."""
        return False

    @property
    def retrieval_layers(self) -> list[RetrievalLayer]:
        return [layer for layer in self.layers if isinstance(layer, RetrievalLayer)]

    def finish_prefill(self) -> None:
        """The prompt is read: generate() appends to the tails from here on."""
        for layer in self.layers:
            layer.finish_prefill()

    def set_coverage(self, coverage: torch.Tensor | None) -> None:
        """Accumulate every full layer's attention mass per prompt token into ``coverage`` [N] while generating."""
        for layer in self.retrieval_layers:
            layer.coverage = coverage

    def set_evidence(self, evidence) -> None:
        """Evidence, for one row (greedy search or sampling, or the reread pass): ``evidence(first, positions
        [C, M], mass [C, M])`` receives, for each full layer, each query's attention per prompt position, and
        every query selects its own far tokens; None: off."""
        for layer in self.retrieval_layers:
            layer.evidence, layer.evidence_skipped = evidence, False

    @property
    def evidence_skipped(self) -> bool:
        """Whether a forward of several rows ran while evidence was set (it was not recorded)."""
        return any(layer.evidence_skipped for layer in self.retrieval_layers)

    def mark(self) -> None:
        """Remember the state after the prompt was read, for ``rewind`` (the sliding layers' windows)."""
        self._marked = [(layer.keys, layer.values, layer.seen) if isinstance(layer, WindowLayer) and
                        layer.is_initialized else None for layer in self.layers]

    def rewind(self) -> None:
        """Back to the state ``mark`` remembered: what generate() appended is dropped, the stored prompt kept."""
        for layer, marked in zip(self.layers, self._marked):
            if isinstance(layer, RetrievalLayer):
                layer.tail_keys = layer.tail_values = None
            elif marked is not None:
                layer.keys, layer.values, layer.seen = marked

    @property
    def store_bytes(self) -> int:
        """Bytes of the prompt's stored keys and values (every full layer)."""
        return sum(layer.store.nbytes for layer in self.retrieval_layers if layer.store is not None)

    @property
    def search_seconds(self) -> float:
        """Seconds spent selecting and gathering far tokens while generating."""
        return sum(layer.search_seconds for layer in self.retrieval_layers)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("unlimisum's retrieval cache cannot be cropped (assisted decoding)")
