"""The prompt's keys and values of one full-attention layer, stored once in 16 bits.

``[G, N, D]`` keys where the search runs and values where they fit (the CPU, when the GPU holds only
the keys): 2 x G x D x 2 bytes per token and layer in bfloat16, the same as the model's own KV
cache, but read by retrieval rather than by every query. Keys are post-rotary at their true
positions, or rotated back to position 0 in the fixed-distance regime (positions.py).
"""

from __future__ import annotations

import torch


class LayerStore:
    """Preallocated keys and values for ``capacity`` tokens; filled in order by ``append``."""

    def __init__(self, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 keys_device: torch.device, values_device: torch.device):
        self.keys = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=keys_device)  # [G, N, D]
        self.values = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=values_device)  # [G, N, D]
        self.n_tokens = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: keys and values of every token it has room for."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [G, n, D] (any dtype and device) -> the next n slots."""
        start, n = self.n_tokens, keys.shape[1]
        if start + n > self.capacity:
            raise RuntimeError(f"the store holds {self.capacity} tokens; {start + n} were given")
        self.keys[:, start:start + n] = keys.to(self.keys.device, self.keys.dtype)
        self.values[:, start:start + n] = values.to(self.values.device, self.values.dtype)
        self.n_tokens = start + n
