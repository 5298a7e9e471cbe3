"""Training-time Unlimiformer attention (paper section 3.2), differentiable end to end.

The whole example is encoded in windows *with* gradients (``encode_long``), and every decoder
cross-attention is wrapped by ``TrainingCrossAttention``, which lets each head attend to k of the
N encoded states only:

- ``random``: per example, layer and head, k states drawn uniformly (the same for every decoder
  position). Their hidden states [k, d] are gathered and projected with that head's W_k, W_v.
- ``retrieval``: per example, head and decoder position, the top-k states by exact search, as at
  test time: q · (h_e,j W_k + b_k) ranks the states as q_h · h_e,j does (q · b_k is the same for
  every j). Keys and values of all N states are projected once and the softmax is masked to the
  top-k. That equals gathering the k states per position and projecting them (the masked scores
  get zero weight and zero gradient) and holds B·H·T·N numbers, as ordinary cross-attention does,
  where gathering would hold B·H·T·k·d_head.

Keys and values always come from the layer's own projections of the encoded states, so the loss
reaches the encoder, the decoder and the cross-attention projections. With k >= N both modes are
ordinary cross-attention over the concatenated encoded states (tests/test_train_attention.py).

The wrapper follows unlimisum/unlimiformer/retrieval.py: the original module is the child
``original``, installed with setattr (unlimisum/models/wrapping.py), and without a session it is
the original module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from unlimisum.models import wrapping
from unlimisum.models.architectures import Architecture
from unlimisum.unlimiformer.encoding import plan_windows

MODES = ("random", "retrieval")


@dataclass
class TrainingSession:
    """The encoded batch that every wrapped cross-attention reads during one forward and backward pass."""

    states: torch.Tensor  # [B, N, d] encoder states of the whole examples, with gradients
    mask: torch.Tensor  # [B, N] bool, True where a state belongs to the example (not padding)
    mode: str  # "random" | "retrieval"
    top_k: int  # states each head attends to
    generator: torch.Generator | None = None  # draws of the random mode; None: torch's global one
    # layer index -> [B, H, k] random picks: drawn once, so a recomputation (gradient checkpointing) sees the same
    picks: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown attention mode '{self.mode}'; use one of {', '.join(MODES)}")

    def random_picks(self, layer_index: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, H, k] indices into N, [B, H, k] bool: the pick is a real state) for one layer."""
        if layer_index not in self.picks:
            batch, n = self.mask.shape
            k = min(self.top_k, n)
            noise = torch.rand(batch, heads, n, generator=self.generator, device=self.generator.device
                               if self.generator is not None else None).to(self.mask.device)  # [B, H, N]
            noise = noise.masked_fill(~self.mask[:, None, :], 2.0)  # padding sorts last
            indices = noise.argsort(dim=-1)[..., :k]  # [B, H, k]: a uniform sample of the real states
            real = self.mask.gather(1, indices.reshape(batch, -1)).view(batch, heads, k)  # [B, H, k]
            self.picks[layer_index] = (indices, real)
        return self.picks[layer_index]


class TrainingCrossAttention(wrapping.CrossAttentionWrapper):
    """Wraps one decoder cross-attention; with a ``TrainingSession`` each head attends to k encoded states."""

    def __init__(self, original: nn.Module, architecture: Architecture, layer_index: int):
        super().__init__(original, architecture, layer_index)
        dropout = getattr(original, "dropout", 0.0)  # BART-like: a float; T5: a float too (its rate)
        self.dropout = float(dropout) if isinstance(dropout, (int, float)) else 0.0

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, L, dh]

    def attend(self, hidden_states: torch.Tensor, session: TrainingSession) -> torch.Tensor:
        """Attention of decoder states [B, T, d_model] over k of the session's states per head."""
        batch, steps, _ = hidden_states.shape
        heads, head_dim = self.num_heads, self.head_dim
        query_proj, key_proj = self._projection("query"), self._projection("key")
        value_proj, output_proj = self._projection("value"), self._projection("output")
        states = session.states.to(hidden_states.dtype)  # [B, N, d]
        q = self._heads(query_proj(hidden_states))  # [B, H, T, dh]
        if session.mode == "retrieval":
            keys, values = self._heads(key_proj(states)), self._heads(value_proj(states))  # [B, H, N, dh]
            scores = (q @ keys.transpose(-1, -2)) * self.scaling  # [B, H, T, N]
            scores = scores.masked_fill(~session.mask[:, None, None, :], float("-inf"))
            k = min(session.top_k, scores.shape[-1])
            with torch.no_grad():
                top = scores.topk(k, dim=-1).indices  # [B, H, T, k]: the exact search of test time
                chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)  # [B, H, T, N]
            scores = scores.masked_fill(~chosen, float("-inf"))
        else:
            indices, real = session.random_picks(self.layer_index, heads)  # [B, H, k] each
            d_model = states.shape[-1]
            picked = states[:, None].expand(batch, heads, -1, -1)  # [B, H, N, d], a view
            picked = picked.gather(2, indices[..., None].expand(-1, -1, -1, d_model))  # [B, H, k, d]
            keys = self._project_per_head(picked, key_proj)  # [B, H, k, dh]
            values = self._project_per_head(picked, value_proj)  # [B, H, k, dh]
            scores = (q @ keys.transpose(-1, -2)) * self.scaling  # [B, H, T, k]
            scores = scores.masked_fill(~real[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)  # [B, H, T, N or k]
        probs = F.dropout(probs, p=self.dropout, training=self.original.training)  # follows the model's mode
        out = (probs @ values).transpose(1, 2).reshape(batch, steps, heads * head_dim)  # [B, T, H*dh]
        return output_proj(out)

    def _project_per_head(self, picked: torch.Tensor, projection: nn.Linear) -> torch.Tensor:
        """[B, H, k, d] states -> [B, H, k, dh]: each head's slice of ``projection``."""
        heads, head_dim = self.num_heads, self.head_dim
        weight = projection.weight.view(heads, head_dim, -1)  # [H, dh, d]
        out = torch.einsum("bhkd,hed->bhke", picked, weight)  # [B, H, k, dh]
        if projection.bias is not None:
            out = out + projection.bias.view(1, heads, 1, head_dim)
        return out


def _make(architecture: Architecture):
    return lambda original, index: TrainingCrossAttention(original, architecture, index)


def training_attention(model: nn.Module, architecture: Architecture):
    """Context manager: within it every decoder cross-attention is a ``TrainingCrossAttention``.

    Yields the wrappers (set their ``session``); the original modules are back afterwards, so
    checkpoints never hold a wrapper's parameter names.
    """
    site = architecture.cross_attention
    return wrapping.wrapped(model, architecture, site, TrainingCrossAttention, _make(architecture))


def encode_long(model: nn.Module, architecture: Architecture, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, window: int, overlap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode right-padded examples [B, L] in overlapping windows, keeping gradients.

    The windows are those of test time (``plan_windows``: each keeps the middle of what it
    encoded), all in one encoder pass. Returns (states [B, N, d], mask [B, N] bool), N the longest
    example's length.
    """
    lengths = attention_mask.sum(dim=1).tolist()  # [B]
    rows, kept = [], []  # one window per row; (example, row, keep start, keep end) relative to the row
    for example, n in enumerate(lengths):
        plan = plan_windows(int(n), window, overlap)
        for i, start in enumerate(plan.starts):
            rows.append(input_ids[example, start : start + plan.length(i)])
            keep_start, keep_end = plan.kept(i)
            kept.append((example, len(rows) - 1, keep_start - start, keep_end - start))
    width = max(len(row) for row in rows)
    pad = torch.zeros(len(rows), width, dtype=input_ids.dtype, device=input_ids.device)  # [W, window]
    row_mask = torch.zeros_like(pad)
    for i, row in enumerate(rows):
        pad[i, : len(row)] = row
        row_mask[i, : len(row)] = 1
    extra = architecture.encoder_inputs(pad) if architecture.encoder_inputs is not None else {}
    hidden = model.get_encoder()(input_ids=pad, attention_mask=row_mask, **extra).last_hidden_state  # [W, window, d]
    pieces: list[list[torch.Tensor]] = [[] for _ in lengths]
    for example, row, start, end in kept:
        pieces[example].append(hidden[row, start:end])
    per_example = [torch.cat(parts) for parts in pieces]  # each [n_b, d]
    states = nn.utils.rnn.pad_sequence(per_example, batch_first=True)  # [B, N, d]
    mask = torch.arange(states.shape[1], device=states.device)[None, :] < torch.tensor(lengths, device=states.device)[:, None]
    return states, mask  # [B, N, d], [B, N]
