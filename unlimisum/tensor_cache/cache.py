"""The transformers Cache that carries the Tensor Cache state through generate().

``TensorCache`` holds one ``TensorCacheLayer`` per decoder layer. generate() sees an ordinary
Cache: ``get_seq_length`` is the number of tokens seen (T5's relative positions and BART's
learned positions are computed from it), ``get_mask_sizes`` describes the window that is
attended (the same as transformers' sliding-window layer, so the decoder builds a mask of the
right size), ``reorder_cache`` follows beam search. The maths is in streaming.py; the
self-attention wrapper (self_attention.py) calls ``TensorCacheLayer.extend``. An unwrapped attention
module calling ``update`` gets a clear error instead of silently wrong attention.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache

from unlimisum.tensor_cache.streaming import MemoryParams, MemoryState, extend, extend_parts


class TensorCacheLayer(CacheLayerMixin):
    """One decoder layer's ring buffer, memory A and normaliser z."""

    is_sliding = True  # it attends a bounded window
    is_compileable = False
    is_croppable = False  # evicted tokens are folded into A; there is no going back

    def __init__(self, params: MemoryParams, memory_dtype: torch.dtype | None = None):
        super().__init__()
        self.params = params
        self.memory_dtype = memory_dtype  # dtype of A and z (None: float32 for 16-bit models)
        self.state: MemoryState | None = None
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate an empty state shaped like ``key_states`` [B, H_kv, n, d_k] / ``value_states``."""
        batch, kv_heads, _, key_dim = key_states.shape
        self.device = key_states.device
        self.state = MemoryState.empty(
            batch, kv_heads, key_dim, value_states.shape[-1], self.params, key_states.dtype, key_states.device,
            memory_dtype=self.memory_dtype or self.params.decay.dtype,
        )
        self._sync()
        self.is_initialized = True

    def _sync(self) -> None:
        """Expose the ring as ``keys``/``values`` as transformers' layers do."""
        self.keys, self.values = self.state.keys, self.state.values
        self.seen = self.state.seen

    def _ready(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> MemoryParams:
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        if self.params.decay.device != q.device:
            self.params = _params_to(self.params, q.device)
        return self.params

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, score_bias=None,
               attend=None) -> torch.Tensor:
        """Process n new tokens of this layer: q [B, H, n, d_k], k/v [B, H_kv, n, d] -> local + γ r [B, H, n, d_v]."""
        params = self._ready(q, k, v)
        out, self.state = extend(self.state, q, k, v, params, scale, score_bias=score_bias, attend=attend)
        self._sync()
        return out

    def extend_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, score_bias=None,
                     attend=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``extend``, before the fusion: (local, read r or None when the gate is closed), each [B, H, n, d_v]."""
        params = self._ready(q, k, v)
        local, read, self.state = extend_parts(self.state, q, k, v, params, scale, score_bias=score_bias, attend=attend)
        self._sync()
        return local, read

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(
            "a TensorCache was passed to a decoder whose self-attention is not wrapped; "
            "use unlimisum.tensor_cache.tensor_cache(model, ...) to install the wrappers"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the wrapper attends: the last W-1 tokens plus the new ones."""
        window = self.params.window
        kv_offset = max(self.seen - window + 1, 0)
        kv_length = min(self.seen, window - 1) + query_length
        return kv_length, kv_offset

    def get_seq_length(self) -> int:
        """Tokens seen so far (not tokens retained)."""
        return self.seen

    def get_max_length(self) -> int:
        return self.params.window

    def reset(self) -> None:
        self.state = None
        self.keys = self.values = None
        self.seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.select_rows(beam_idx)
            self._sync()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.repeat_rows(repeats)
            self._sync()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.select_rows(torch.as_tensor(indices, device=self.state.keys.device))
            self._sync()

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("a TensorCache cannot be cropped: evicted tokens are already folded into its memory")

    def offload(self):
        pass  # the state is small and bounded; it stays where it is

    def prefetch(self):
        pass

    def nbytes(self) -> int:
        """Bytes of retained state of this layer."""
        return self.state.nbytes() if self.state is not None else 0


def _params_to(params: MemoryParams, device) -> MemoryParams:
    from dataclasses import replace

    return replace(
        params, decay=params.decay.to(device), write_rate=params.write_rate.to(device),
        gate=None if params.gate is None else params.gate.to(device),
        projection=None if params.projection is None else params.projection.to(device),
        query_map=None if params.query_map is None else params.query_map.to(device),
        write_gate=None if params.write_gate is None else params.write_gate.to(device),
    )


class TensorCache(Cache):
    """Self-attention cache of a whole decoder: one TensorCacheLayer per layer.

    For an encoder-decoder model pass ``for_generate()`` (an EncoderDecoderCache around it) to
    generate(); the self-attention wrappers find it there.
    """

    def __init__(self, layer_params: list[MemoryParams], memory_dtype: torch.dtype | None = None):
        super().__init__(layers=[TensorCacheLayer(params, memory_dtype) for params in layer_params])

    @property
    def window(self) -> int:
        return self.layers[0].params.window

    def for_generate(self) -> EncoderDecoderCache:
        """This cache for the self-attention, an empty DynamicCache for the cross-attention."""
        return EncoderDecoderCache(self, DynamicCache())

    def snapshot(self) -> list:
        """The state of every layer now, to ``restore`` later: a layer's ``extend`` makes a new state and never
        changes the one before, so a snapshot is the states themselves (no copy)."""
        return [(layer.state, getattr(layer, "device", None)) for layer in self.layers]

    def restore(self, snapshot: list) -> None:
        """Every layer back to the state of ``snapshot`` (from this cache or another of the same parameters)."""
        for layer, (state, device) in zip(self.layers, snapshot):
            if state is None:
                layer.reset()
                continue
            layer.state, layer.device, layer.is_initialized = state, device, True
            layer._sync()

    def nbytes(self) -> int:
        """Bytes of retained self-attention state, all layers."""
        return sum(layer.nbytes() for layer in self.layers)


def find_tensor_cache(cache) -> TensorCache | None:
    """The TensorCache inside ``cache`` (itself or an EncoderDecoderCache's self-attention part), else None."""
    if isinstance(cache, TensorCache):
        return cache
    if isinstance(cache, EncoderDecoderCache) and isinstance(cache.self_attention_cache, TensorCache):
        return cache.self_attention_cache
    return None


def retained_bytes(cache) -> int:
    """Bytes of decoder self-attention state a cache retains.

    Works for a TensorCache (ring + A + z), an EncoderDecoderCache around one, or any other
    transformers cache (its self-attention keys and values), so runs can be compared.
    """
    found = find_tensor_cache(cache)
    if found is not None:
        return found.nbytes()
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total
