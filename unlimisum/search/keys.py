"""The key store per decoder layer: ``K_l = h_e W_k^l`` for every layer, 16-bit, head-major ``[H, N, d_head]``;
and, where every head attends to every token (k >= N), the values ``V_l = h_e W_v^l`` beside them.

The shared store (unlimisum/search/datastore.py) serves every layer with one copy of the states: each
head's query is projected into hidden space (``q W_k^T``, d_model numbers), so every stored number meets one
query per head. With the keys of each layer stored, each head scores its own d_head-dim query against its own
contiguous block: the same bytes read per layer, H times fewer multiply-adds. The key bias is left out: it adds
``q . b_k`` to every score of a head and cancels in the softmax. A top-k step needs no values of its own: the
attention output stays ``(sum_i a_i h_i) W_v``, a weighted sum over k shared states per head; with the layer's
values stored, each head gathers its k tokens' ``d_head`` values instead of their d-wide states (H times fewer
bytes, kept where the plan measures that this pays for projecting them: placement.py). A dense step (k >= N)
weighs every state for every head: ``H x N x d`` multiply-adds a layer, bound by arithmetic; with the layer's
values stored, each head sums its own ``d_head`` numbers per token instead, H times fewer (the value bias is
added after the sum as before: the weights sum to one).

The keys are projected from the states as the store holds them (rounded to its dtype), their sums in fp32, then
rounded to that dtype: the same numbers whether they were built while encoding, rebuilt from the states of a
cached book, or loaded with it. Where the weights already hold the store's 16-bit dtype (a model loaded in 16
bits) and a 16-bit matmul pays on the CPU, the matmul takes the 16-bit numbers as they are (its sums fp32 all the
same: the keys differ from an fp32 matmul's only in the last bit of that one rounding, about one in 7,000).
Scores from them differ from the shared store's by that one rounding of the key (bfloat16: at most 2^-9 of each
product, so a score moves by at most 2^-9 sum_i |q_i k_i|); the values are projected and rounded the same way,
so a dense step's output moves by at most 2^-9 of sum_i a_i |v_i| per number.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from unlimisum.models import precision
from unlimisum.models.architectures import Architecture
from unlimisum.search import head_kernels, kernels

BUILD_ROWS = 65_536  # states projected at a time when the keys are built from a whole store (a cache hit)


def key_weights(model: nn.Module, architecture: Architecture) -> list[torch.Tensor]:
    """Every decoder layer's cross-attention key projection, per head: [H, d_head, d_model] each, in order."""
    return _projection_weights(model, architecture, "key")


def value_weights(model: nn.Module, architecture: Architecture) -> list[torch.Tensor]:
    """Every decoder layer's cross-attention value projection, per head: [H, d_head, d_model] each, in order."""
    return _projection_weights(model, architecture, "value")


def projection_dtype(weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the states are projected into keys (or values) in: the store's 16-bit ``dtype`` where every one
    of ``weights`` already holds it and a 16-bit matmul pays on this CPU (measured once per machine, as for
    ``--dtype auto``: 2.2x the fp32 projection on an EPYC Zen 4 with AVX512-BF16), float32 otherwise (a GPU
    included, whose 16-bit matmul may round its sums)."""
    if (dtype == torch.float32 or torch.device(device).type != "cpu" or not weights
            or any(weight.dtype != dtype for weight in weights)):
        return torch.float32
    return dtype if precision.cpu_speedup(dtype) >= precision.CPU_BF16_MIN_SPEEDUP else torch.float32


def project(states: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """states [n, d] (as stored) @ weights [H * dh, d] (one layer's), in ``dtype`` (``projection_dtype``):
    [n, H * dh] in ``dtype``, summed in fp32."""
    return states.to(dtype) @ weights.to(states.device, dtype).T


def _projection_weights(model: nn.Module, architecture: Architecture, which: str) -> list[torch.Tensor]:
    site = architecture.cross_attention
    weights = []
    for layer in architecture.decoder_layers(model):
        parent, attribute = site.locate(layer)
        attention = getattr(parent, attribute)
        attention = getattr(attention, "original", attention)  # a retrieval wrapper holds the original
        heads, head_dim = getattr(attention, site.heads_attribute), getattr(attention, site.head_dim_attribute)
        weight = getattr(attention, getattr(site, which)).weight  # [H * d_head, d_model]
        weights.append(weight.detach().view(heads, head_dim, weight.shape[1]))
    return weights


def key_store_bytes(n_tokens: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                    values: bool = False) -> int:
    """Bytes of the keys (and, with ``values``, the values) of ``layers`` layers for ``n_tokens`` tokens."""
    return n_tokens * layers * heads * head_dim * dtype.itemsize * (2 if values else 1)


class KeyStore:
    """The keys of every decoder layer: ``keys`` [L, H, N, d_head] in the store's dtype, on its device; and
    ``values`` of the same shape, or None (the steps then sum the shared states)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor | None = None):
        if values is not None and (values.shape != keys.shape or values.dtype != keys.dtype):
            raise ValueError(f"values must be {keys.dtype} {list(keys.shape)}, got {values.dtype} {list(values.shape)}")
        self.keys = keys  # [L, H, N, dh]
        self.values = values  # [L, H, N, dh] or None
        self.layers, self.heads, self.n_tokens, self.head_dim = keys.shape
        self.dtype = keys.dtype
        self.device = keys.device
        self.nbytes = keys.numel() * keys.element_size() * (1 if values is None else 2)
        self._owner = None  # the key store a view was taken from, kept alive with it

    def __repr__(self) -> str:
        return (f"KeyStore(layers={self.layers}, heads={self.heads}, n_tokens={self.n_tokens}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, values={self.values is not None}, "
                f"nbytes={self.nbytes})")

    def layer(self, index: int) -> torch.Tensor:
        """[H, N, dh] keys of decoder layer ``index`` (each head's rows contiguous)."""
        return self.keys[index]

    def layer_values(self, index: int) -> torch.Tensor | None:
        """[H, N, dh] values of decoder layer ``index`` (each head's rows contiguous), or None."""
        return None if self.values is None else self.values[index]

    def view(self, start: int, end: int) -> "KeyStore":
        """A zero-copy key store over the tokens [start, end) (a chapter of the book)."""
        if not 0 <= start < end <= self.n_tokens:
            raise ValueError(f"a view needs 0 <= start < end <= {self.n_tokens}, got [{start}, {end})")
        view = KeyStore(self.keys[:, :, start:end],
                        None if self.values is None else self.values[:, :, start:end])
        view._owner = self
        return view

    def choice(self, dim: int, queries_per_head: int = 1, k: int = 1024) -> head_kernels.HeadKernelChoice:
        """The measured per-head kernel for this store's device and dtype (the shared states are ``dim`` wide),
        the compiled kernels among the candidates where the store is long enough (``kernels.uses_compiled``)."""
        return head_kernels.kernel_for(self.device, self.dtype, dim, self.heads, self.head_dim,
                                       queries_per_head=queries_per_head, k=k,
                                       compiled_kernels=kernels.uses_compiled(self.n_tokens, self.device))


class KeyStoreBuilder:
    """Fill the keys (and values) of every layer chunk by chunk, in input order, as the states are encoded."""

    def __init__(self, n_tokens: int, weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device | str,
                 value_weights: list[torch.Tensor] | None = None, keys: torch.Tensor | None = None):
        """``weights``: [H, dh, d] per layer (``key_weights``); the keys are stored in ``dtype`` on ``device``;
        ``value_weights``: [H, dh, d] per layer, the values are built beside them. ``keys``: keys [L, H, N, dh]
        already built (a cached book's): only the values are projected."""
        if not weights:
            raise ValueError("a key store needs at least one decoder layer")
        heads, head_dim, self.dim = weights[0].shape
        self.dtype = dtype
        self.device = torch.device(device)
        projections = [] if keys is not None else [weights]
        projections += [value_weights] if value_weights is not None else []
        self._matmul_dtype = projection_dtype([w for ws in projections for w in ws], dtype, self.device)
        # per projection: [L, H * dh, d] in the matmul's dtype on the keys' device, once
        self._weights = [torch.stack([w.reshape(heads * head_dim, self.dim) for w in ws]).to(self.device,
                                                                                              self._matmul_dtype)
                         for ws in projections]
        shape = (len(weights), heads, n_tokens, head_dim)
        self._keys = keys if keys is not None else torch.empty(shape, dtype=dtype, device=self.device)
        self._values = torch.empty(shape, dtype=dtype, device=self.device) if value_weights is not None else None
        self._outputs = ([] if keys is not None else [self._keys]) + ([self._values] if self._values is not None else [])
        self._filled = 0

    def add(self, states: torch.Tensor) -> None:
        """Project encoded states [n, d] (as they are stored: rounded to the store's dtype) into every layer's keys
        (and values)."""
        n = states.shape[0]
        if self._filled + n > self._keys.shape[2]:
            raise ValueError(f"key store announced {self._keys.shape[2]} tokens but {self._filled + n} were added")
        rows = states.detach().to(self.device).to(self.dtype)  # [n, d]: the stored numbers
        layers, heads, _, head_dim = self._keys.shape
        for weights, output in zip(self._weights, self._outputs):
            for index in range(layers):
                projected = project(rows, weights[index], self._matmul_dtype)  # [n, H * dh]
                output[index, :, self._filled:self._filled + n] = projected.view(n, heads, head_dim).transpose(0, 1)
        self._filled += n

    def finish(self) -> KeyStore:
        """The built key store; every announced token must have been added."""
        if self._filled != self._keys.shape[2]:
            raise ValueError(f"key store announced {self._keys.shape[2]} tokens but only {self._filled} were added")
        return KeyStore(self._keys, self._values)


def build_key_store(states: torch.Tensor, weights: list[torch.Tensor], device: torch.device | str | None = None,
                    rows: int = BUILD_ROWS, value_weights: list[torch.Tensor] | None = None,
                    keys: torch.Tensor | None = None, on_rows: Callable[[int], None] | None = None) -> KeyStore:
    """The keys (and, given ``value_weights``, the values) of stored states [N, d] (a cached book's), ``rows``
    states at a time, in the states' dtype; ``keys``: the book's keys as cached, only the values built.
    ``on_rows(done)``: after each part, how many states are projected so far."""
    device = device if device is not None else states.device
    builder = KeyStoreBuilder(states.shape[0], weights, states.dtype, device, value_weights,
                              keys.to(device) if keys is not None else None)
    for start in range(0, states.shape[0], rows):
        builder.add(states[start:start + rows])
        if on_rows is not None:
            on_rows(min(start + rows, states.shape[0]))
    return builder.finish()


def matches(keys: torch.Tensor, weights: list[torch.Tensor], n_tokens: int, dtype: torch.dtype) -> bool:
    """Whether stored keys [L, H, N, dh] have the shape and dtype this model's keys of ``n_tokens`` tokens have."""
    heads, head_dim, _ = weights[0].shape
    return tuple(keys.shape) == (len(weights), heads, n_tokens, head_dim) and keys.dtype == dtype
