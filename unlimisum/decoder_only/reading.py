"""Read a long prompt in chunks of the local window, then generate after it with the model's own generate().

    with session(model, architecture, plan) as cache:
        prefill(model, cache, prompt_ids[:-1])   # every prompt token but the last, chunk by chunk
        cache.finish_prefill()
        output = generate(model, cache, prompt_ids, max_new_tokens=256)

generate() sees a cache that already holds all but the prompt's last token, so it feeds that token
and then its own; greedy search, beams and sampling work as usual (beams share the stored prompt).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from unlimisum.decoder_only.attention import reading
from unlimisum.decoder_only.cache import RetrievalCache
from unlimisum.decoder_only.plan import RetrievalPlan
from unlimisum.decoder_only.positions import Rotation, pinned_length, pinned_rotary
from unlimisum.models import compat
from unlimisum.models.decoder_architectures import FULL


@contextmanager
def session(model: nn.Module, architecture, plan: RetrievalPlan, *, max_positions: int | None = None) -> Iterator[RetrievalCache]:
    """A fresh RetrievalCache for ``plan``, with the model reading through it within the block.

    Length-dependent rotary frequencies are pinned (positions.pinned_length): prefill in chunks computes
    them as one forward over the prompt (longrope: over the whole run) would.
    """
    config = model.config
    max_positions = max_positions or architecture.max_positions(config)
    device = next(model.parameters()).device
    with pinned_rotary(model, architecture, pinned_length(config, plan, max_positions)):
        rotation = None
        if not plan.true_positions:
            rotary = architecture.rotary(model)
            layer_type = FULL if compat.rotary_takes_layer_type(rotary) else None
            rotation = Rotation(rotary, device, layer_type)
        cache = RetrievalCache(plan, architecture.layer_windows(config), rotation)
        with reading(model, cache):
            yield cache


def prefill(model: nn.Module, cache: RetrievalCache, input_ids: torch.Tensor, *, logits: bool = False,
            on_chunk: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """Run ``input_ids`` [n] through the model in chunks of the plan's ``chunk``, filling ``cache``.

    Returns the logits [n, vocab] when ``logits`` (tests), else None (only the last position's are computed).
    ``on_chunk(tokens_done)`` is called after every chunk.
    """
    device = next(model.parameters()).device
    argument = compat.cache_argument(model)
    chunk = cache.plan.chunk
    pieces = []
    for start in range(0, input_ids.shape[0], chunk):
        ids = input_ids[start:start + chunk].unsqueeze(0).to(device)
        positions = torch.arange(start, start + ids.shape[1], device=device).unsqueeze(0)
        output = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=0 if logits else 1,
                       **{argument: cache})
        if logits:
            pieces.append(output.logits[0])
        if on_chunk is not None:
            on_chunk(start + ids.shape[1])
    return torch.cat(pieces) if logits else None


def generate(model: nn.Module, cache: RetrievalCache, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
    """The model's generate() after a prefilled ``cache``: input_ids [N] is the whole prompt -> [rows, N + new]."""
    device = next(model.parameters()).device
    ids = input_ids.unsqueeze(0).to(device)
    argument = compat.cache_argument(model)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{argument: cache}, **generate_kwargs)
