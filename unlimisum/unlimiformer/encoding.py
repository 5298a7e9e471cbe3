"""Window plan and batched encoding: every input token encoded once, with context on both sides.

The token sequence is cut into windows of the model's own source length that overlap
by a fraction of a window. Each window keeps the middle part of what it encoded; the
first keeps its start and the last its end, so every token is kept exactly once.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol

import torch
from torch import nn

from unlimisum.errors import ConfigError


@dataclass(frozen=True)
class WindowPlan:
    """Windows ``[start, start + length)`` and the part ``[keep_start, keep_end)`` each keeps."""

    n_tokens: int
    window: int
    starts: tuple[int, ...]
    keep_bounds: tuple[int, ...]  # len(starts) + 1 boundaries: window i keeps [bounds[i], bounds[i+1])

    @property
    def n_windows(self) -> int:
        """How many windows the plan has."""
        return len(self.starts)

    def length(self, index: int) -> int:
        """Tokens in window ``index`` (all windows are full unless the input is shorter than one)."""
        return min(self.window, self.n_tokens - self.starts[index])

    def kept(self, index: int) -> tuple[int, int]:
        """The kept range of window ``index``, in absolute token positions."""
        return self.keep_bounds[index], self.keep_bounds[index + 1]

    def part(self, first: int, stop: int) -> tuple["WindowPlan", int]:
        """Windows ``[first, stop)`` as a plan of their own over the tokens they span, and the first of those
        tokens: encoding that plan over ``input_ids[offset : offset + part.n_tokens]`` keeps the same states
        as these windows of this plan (the Ray engine hands such parts to its workers)."""
        if not 0 <= first < stop <= self.n_windows:
            raise ConfigError(f"windows [{first}, {stop}) are not within the plan's {self.n_windows}")
        offset = self.starts[first]
        end = self.starts[stop - 1] + self.length(stop - 1)
        return WindowPlan(end - offset, self.window, tuple(start - offset for start in self.starts[first:stop]),
                          tuple(bound - offset for bound in self.keep_bounds[first:stop + 1])), offset


class WindowEncoder(Protocol):
    """What encodes a document's windows somewhere other than this process (the Ray engine's workers)."""

    def encode(self, input_ids: torch.Tensor, plan: WindowPlan, sink: Callable[[torch.Tensor], None], *,
               batch_size: int, on_batch: Callable[[int], None] | None = None) -> None:
        """As ``encode_windows``: every window of ``plan`` over ``input_ids`` [N] encoded in batches of
        ``batch_size`` and its kept states [n_kept, d] handed to ``sink`` in order, the states this process
        would compute; ``on_batch(windows_done)`` as they arrive."""


def plan_windows(n_tokens: int, window: int, overlap: float = 0.5) -> WindowPlan:
    """Plan windows of ``window`` tokens whose neighbours share ``overlap`` of a window.

    Consecutive windows start at most ``window - round(overlap * window)`` apart, spread
    evenly so that the last ends at the input's end and every window is full.
    """
    if n_tokens < 1:
        raise ConfigError("cannot plan windows for an empty input")
    if window < 2:
        raise ConfigError(f"window must be at least 2 tokens, got {window}")
    if not 0.0 <= overlap < 1.0:
        raise ConfigError(f"overlap must be in [0, 1), got {overlap}")
    if n_tokens <= window:
        return WindowPlan(n_tokens, window, (0,), (0, n_tokens))
    stride = max(1, window - round(overlap * window))
    n_windows = 1 + math.ceil((n_tokens - window) / stride)
    # spread the windows evenly, so no gap exceeds the stride and the last window ends at the input's end
    span = n_tokens - window
    starts = [round(i * span / (n_windows - 1)) for i in range(n_windows)]
    # neighbours split their shared part in the middle: both sides of a kept token have context
    bounds = [0] + [(starts[i - 1] + window + starts[i]) // 2 for i in range(1, n_windows)] + [n_tokens]
    return WindowPlan(n_tokens, window, tuple(starts), tuple(bounds))


def auto_batch_size(window: int, n_windows: int, device: torch.device) -> int:
    """Windows per encoder pass: about 2k tokens per pass on CPU, 32k on GPU.

    On CPU a single 1024-token window already fills the matmul units: bench/encoding.py measured
    the same tokens/s for 1, 2, 4 and 8 windows per pass (bart-base, 2 cores), while each extra
    window holds another 12 x 1024 x 1024 attention matrix per layer. A GPU needs big batches
    to be busy.
    """
    tokens_per_pass = 32_768 if device.type == "cuda" else 2_048
    return max(1, min(n_windows, tokens_per_pass // window))


def shard_windows(n_windows: int, batch_size: int, shards_wanted: int, most: int = 8) -> list[tuple[int, int]]:
    """Consecutive ranges ``[first, stop)`` of whole encoder batches: at most ``most`` windows each (rounded up to
    a whole batch), and at least about ``shards_wanted`` of them where there are batches enough. The batches are
    those one process encodes (``batch_size`` windows from window 0), so each window is encoded in the same
    company wherever its range goes: its states are the same bit for bit."""
    batches = math.ceil(n_windows / batch_size)
    per_shard = max(1, min(math.ceil(batches / max(1, shards_wanted)), math.ceil(most / batch_size)))
    return [(first * batch_size, min(n_windows, (first + per_shard) * batch_size))
            for first in range(0, batches, per_shard)]


def encode_windows(
    encoder: nn.Module,
    input_ids: torch.Tensor,
    plan: WindowPlan,
    sink: Callable[[torch.Tensor], None],
    *,
    batch_size: int,
    encoder_inputs: Callable[[torch.Tensor], dict] | None = None,
    kept_rows: Callable[[nn.Module, int, int], ContextManager] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> None:
    """Encode every window of ``input_ids`` [N] and hand the kept states to ``sink`` in order.

    ``sink`` receives [n_kept, d] tensors in the encoder's dtype on its device; the
    states are never gathered here, so no second full copy of the input's states exists.
    ``kept_rows``: the architecture's (``Architecture.kept_rows``), within which the encoder's
    last layer computes only the rows a batch's windows keep. ``on_batch(windows_done)`` is
    called after each encoder pass.
    """
    device = next(encoder.parameters()).device
    done = 0
    with torch.inference_mode():
        while done < plan.n_windows:
            batch = range(done, min(plan.n_windows, done + batch_size))
            length = plan.length(batch[0])
            # every window but a lone short one is full, so a batch never needs padding
            rows = torch.stack([input_ids[plan.starts[i] : plan.starts[i] + length] for i in batch]).to(device)
            extra = encoder_inputs(rows) if encoder_inputs is not None else {}
            # the rows any window of the batch keeps, relative to its start: [first, stop)
            first = min(plan.kept(i)[0] - plan.starts[i] for i in batch)
            stop = max(plan.kept(i)[1] - plan.starts[i] for i in batch)
            if kept_rows is None or (first, stop) == (0, length):
                first, rows_only = 0, nullcontext()
            else:
                rows_only = kept_rows(encoder, first, stop)
            with rows_only:
                hidden = encoder(input_ids=rows, attention_mask=torch.ones_like(rows), **extra).last_hidden_state
            for row, i in enumerate(batch):  # hidden: [batch, rows from `first`, d]
                keep_start, keep_end = plan.kept(i)
                offset = plan.starts[i] + first
                sink(hidden[row, keep_start - offset : keep_end - offset])
            done = batch[-1] + 1
            if on_batch is not None:
                on_batch(done)
