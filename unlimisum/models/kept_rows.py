"""The encoder's last layer computed only for the rows a window keeps.

A window keeps the middle part of what it encodes (unlimiformer/encoding.py): at the paper's overlap of
0.5, half of it. Every layer but the last must run on the whole window, since the next layer's keys and
values read every row; the last layer's keys and values do too, but its queries, attention output,
feed-forward block and layer norms are needed only for the kept rows. Computing those for the kept rows
alone spares 5/12 of the last layer's linear work and half its attention: 6 % of bart-base's encoding
and 4 % of bart-large's on a CPU (float32, overlap 0.5, two windows a pass). The numbers are the same
computation on fewer rows (tests/test_kept_rows.py); the attention itself is the layer's own module,
asked as a cross-attention (queries from the kept rows, keys and values from the whole window).

``KeptRowsLayer`` wraps the original layer (the child ``original``), whose modules it calls; it is put in
place for one encoder call (``last_layer_rows``) and the original given back on exit.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class KeptRowsLayer(nn.Module):
    """A BART-like encoder layer that returns only rows ``[start, stop)`` of its output [B, stop - start, d]."""

    def __init__(self, original: nn.Module, start: int, stop: int, pre_norm: bool):
        super().__init__()
        self.original = original
        self.start, self.stop = start, stop
        self.pre_norm = pre_norm  # True: layer norm before each block (mBART, PEGASUS); False: after (BART)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs):
        """hidden_states [B, S, d] -> [B, stop - start, d], the original layer's output rows."""
        layer, rows = self.original, slice(self.start, self.stop)
        if layer.training:  # dropout draws per row: only the whole layer gives the original's numbers
            return layer(hidden_states, attention_mask, *args, **kwargs)[:, rows]
        if attention_mask is not None and attention_mask.dim() == 4:  # [B, 1, S, S]: the kept queries' rows
            attention_mask = attention_mask[:, :, rows]
        whole = layer.self_attn_layer_norm(hidden_states) if self.pre_norm else hidden_states  # [B, S, d]
        attended, _ = layer.self_attn(whole[:, rows], key_value_states=whole, attention_mask=attention_mask)
        if self.pre_norm:
            hidden = hidden_states[:, rows] + attended
            hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(hidden))))
        else:
            hidden = layer.self_attn_layer_norm(hidden_states[:, rows] + attended)
            hidden = layer.final_layer_norm(hidden + layer.fc2(layer.activation_fn(layer.fc1(hidden))))
        if hidden.dtype == torch.float16 and not torch.isfinite(hidden).all():  # as the original layer clamps
            clamp = torch.finfo(hidden.dtype).max - 1000
            hidden = torch.clamp(hidden, min=-clamp, max=clamp)
        return hidden


@contextmanager
def last_layer_rows(layers: nn.ModuleList, start: int, stop: int, pre_norm: bool) -> Iterator[None]:
    """Within: the last of ``layers`` computes only rows ``[start, stop)``, so the encoder's output is those
    rows of every sequence [B, stop - start, d]; the original layer is put back on exit."""
    original = layers[-1]
    layers[-1] = KeptRowsLayer(original, start, stop, pre_norm)
    try:
        yield
    finally:
        layers[-1] = original
