"""WindowLayer: a sliding-window layer's cache, which keeps and attends to its window only, as the model does."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from unlimisum.decoder_only.attention import check_updated
from unlimisum.decoder_only.parts import Part, attend, causal, grouped, ungrouped


class WindowLayer(CacheLayerMixin):
    """One sliding-window layer: the last ``window - 1`` tokens, attended exactly as the model does."""

    is_sliding = True
    is_compileable = False
    is_croppable = False

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.seen = 0
        self._visible = None  # (keys, values) [B, G, n, D] this call attends to, and the call's own keys

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = key_states.shape[0]
        if self.keys.shape[0] != rows:  # generate() starts beams from the one prompt row
            self.keys, self.values = (t.expand(rows, -1, -1, -1) for t in (self.keys, self.values))
        keys = torch.cat([self.keys, key_states], dim=2)
        values = torch.cat([self.values, value_states], dim=2)
        self._visible = (keys, values, key_states)
        keep = self.window - 1
        self.keys, self.values = (keys[:, :, -keep:], values[:, :, -keep:]) if keep else (keys[:, :, :0], values[:, :, :0])
        self.seen += key_states.shape[2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return min(self.seen, self.window - 1) + query_length, max(0, self.seen - self.window + 1)

    def get_max_length(self) -> int:
        return self.window

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized and self.keys.shape[0] > 1:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("unlimisum's retrieval cache cannot be cropped (assisted decoding)")

    def finish_prefill(self) -> None:
        """Nothing to free: the window is all a sliding layer keeps."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               softcap: float | None) -> torch.Tensor:
        check_updated(self._visible[2] if self._visible is not None else None, key)
        keys, values, _ = self._visible
        self._visible = None
        n_queries, n_keys = key.shape[2], keys.shape[2]
        first_key, first_query = self.seen - n_keys, self.seen - n_queries
        mask = causal(first_query, n_queries, first_key, n_keys, query.device)
        distance = torch.arange(first_query, self.seen, device=query.device).unsqueeze(1) - \
            torch.arange(first_key, self.seen, device=query.device).unsqueeze(0)
        mask &= distance < self.window
        out = attend(grouped(query, key.shape[1]), [Part(keys, values, "batched", mask=mask)], scaling, softcap)
        return ungrouped(out, query)
