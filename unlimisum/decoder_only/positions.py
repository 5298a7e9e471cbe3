"""Positions of retrieved tokens, and rotary frequencies that do not drift while the prompt is read in chunks.

Two regimes (``RetrievalPlan.fixed_distance``):

- **true positions** (the prompt plus the summary fit the model's positions): every token keeps
  its position; keys are stored as the model rotated them, so attending to all of them is the
  model's own attention, exactly.
- **fixed distance** (they do not fit): the exact local window keeps true positions (its
  distances stay below the window, which the model knows), while every retrieved far token is
  scored as if it sat ``fixed_distance`` positions before the query, and the sinks just before
  those. Far keys are stored rotated back to position 0 (``Rotation.derotate``) and the query is
  turned to the fixed distance instead (``Rotation.turn``): since q_m . R(p) k depends on m - p
  only, that is the score of a key at distance ``fixed_distance``, one rotation per query.

Rotary variants that recompute their frequencies from the longest position in the batch
(``dynamic`` NTK, ``longrope``) would give every prefill chunk other frequencies; ``PinnedRotary``
wraps the model's rotary embedding so that every call sees the same longest position
(``pinned_length``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from unlimisum.models import compat

# Rotary types whose frequencies depend on the longest position of the call (transformers' dynamic_rope_update).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class PinnedRotary(nn.Module):
    """The model's rotary embedding (the child ``original``) computed as if every call reached ``length``.

    One extra position, ``length - 1``, is appended to each call's positions and its cos/sin dropped, so a
    rotary that picks its frequencies from the longest position picks the same ones for every chunk.
    """

    def __init__(self, original: nn.Module, length: int):
        super().__init__()
        self.original = original
        self.length = length

    def forward(self, x, position_ids, *args, **kwargs):
        pin = torch.full_like(position_ids[..., :1], self.length - 1)
        cos, sin = self.original(x, torch.cat([position_ids, pin], dim=-1), *args, **kwargs)
        return cos[..., :-1, :], sin[..., :-1, :]


def pinned_length(config, plan, max_positions: int) -> int:
    """The longest position + 1 that length-dependent frequencies are computed for while ``plan`` is read.

    True positions: the prompt, as one forward over it computes them (generation then moves ``dynamic`` on as
    the model does); ``longrope``: the longest input of the whole run, prompt and summary. transformers' Phi-3
    drops its cache when a sequence first passes ``original_max_position_embeddings``, to recompute it with
    the long factors (unlimisum keeps its cache: RetrievalCache.__bool__); read with the factors of the whole
    run, the prompt's keys already have them. Fixed distance: the model's positions.
    """
    if not plan.true_positions:
        return max_positions
    prompt = plan.prompt_tokens + 1
    if "longrope" in compat.rope_types(config):
        return max(prompt, plan.prompt_tokens + plan.max_new_tokens)  # generate() feeds all but its last token
    return prompt


def needs_pinning(config) -> bool:
    """The model's rotary frequencies depend on the longest position of each call."""
    return bool(set(compat.rope_types(config)) & set(LENGTH_DEPENDENT_ROPE))


@contextmanager
def pinned_rotary(model: nn.Module, architecture, length: int) -> Iterator[None]:
    """Within the block the rotary embedding of a dynamic or longrope model is pinned to ``length``."""
    if not needs_pinning(model.config):
        yield
        return
    decoder, name = architecture.decoder(model), architecture.rotary_attribute
    original = getattr(decoder, name)
    if isinstance(original, PinnedRotary):
        raise RuntimeError("the rotary embedding is already pinned")
    setattr(decoder, name, PinnedRotary(original, length))
    try:
        yield
    finally:
        setattr(decoder, name, original)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotation:
    """The model's rotary embedding, used to move keys and queries between positions (fixed-distance regime).

    Rotations act on the first ``cos.shape[-1]`` dimensions (all of them but for partial rotary, as Phi-3
    can have); the rotary embedding may scale cos and sin by an attention factor ``a`` (yarn, longrope),
    which ``derotate`` keeps in the key (a canonical key is ``a * k``) so that ``rotate`` gives back what the
    model computes.
    """

    def __init__(self, rotary: nn.Module, device: torch.device, layer_type: str | None = None):
        self.rotary, self.device, self.layer_type = rotary, torch.device(device), layer_type
        self.scale = float(self._cos_sin(torch.zeros(1, dtype=torch.long))[0][0, 0])  # cos(0) * a

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] positions -> cos, sin [n, r] float32, as the model computes them (attention factor included)."""
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)  # the rotary reads only dtype and device
        extra = {"layer_type": self.layer_type} if self.layer_type is not None else {}
        cos, sin = self.rotary(probe, positions.to(self.device).view(1, -1), **extra)
        return cos[0].float(), sin[0].float()

    def _unit(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(torch.as_tensor(positions, dtype=torch.long).view(-1))
        return cos / self.scale, sin / self.scale

    @staticmethod
    def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
        """x [..., n, D] rotated by +-angle on its first r dims, in float32 (or wider); cos, sin [n, r]."""
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        r = cos.shape[-1]
        rotated = x[..., :r] * cos + sign * rotate_half(x[..., :r]) * sin
        return torch.cat([rotated, x[..., r:]], dim=-1) if r < x.shape[-1] else rotated

    def derotate(self, keys: torch.Tensor, positions) -> torch.Tensor:
        """Post-rotary keys [..., n, D] at ``positions`` [n] -> canonical keys (position 0), float32 or wider."""
        cos, sin = self._unit(positions)
        return self._apply(keys, cos, sin, -1.0)

    def rotate(self, keys: torch.Tensor, positions) -> torch.Tensor:
        """Canonical keys [..., n, D] -> the model's post-rotary keys at ``positions`` [n], float32 or wider."""
        cos, sin = self._unit(positions)
        return self._apply(keys, cos, sin, 1.0)

    def turn(self, queries: torch.Tensor, positions, to_position: int) -> torch.Tensor:
        """Post-rotary queries [..., n, D] at ``positions`` [n] -> the same queries rotated as if at ``to_position``."""
        cos, sin = self._unit(positions)
        back = self._apply(queries, cos, sin, -1.0)
        cos, sin = self._unit([to_position])
        return self._apply(back, cos, sin, 1.0)
