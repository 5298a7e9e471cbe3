"""RetrievalCrossAttention: a decoder cross-attention head that reads its top-k input tokens.

For one head with projections W_q, W_k, W_v (and biases),
    q · k_j = (h_d W_q + b_q) · (h_e,j W_k + b_k) = q_h · h_e,j + q · b_k,   q_h = q W_k^T
so searching the datastore of encoder states h_e with q_h finds the head's top-k keys;
q · b_k is the same for every key and cancels in the softmax. The values need no
per-token projection either: with softmax weights p_j summing to one,
    sum_j p_j (h_e,j W_v + b_v) = (sum_j p_j h_e,j) W_v + b_v.
With exact search and k >= N this equals ordinary cross-attention over all encoded tokens.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from unlimisum.models import wrapping
from unlimisum.models.architectures import Architecture


@dataclass
class RetrievalStats:
    """What retrieval cost during one generate() call."""

    search_seconds: float = 0.0  # retrieval attention: search and value lookup


@dataclass
class RetrievalSession:
    """The datastores of one summarize call: one per document of the generation batch."""

    stores: Sequence  # Datastore per document, in batch order
    retrieval_k: int  # input tokens each head attends to per step
    stats: RetrievalStats = field(default_factory=RetrievalStats)
    # per document, [N] float32 on its store's device: attention mass per input token, summed over
    # steps, layers, heads and beams (see unlimisum/coverage.py); None: not measured
    coverage: Sequence | None = None


class RetrievalCrossAttention(wrapping.CrossAttentionWrapper):
    """Wraps one decoder cross-attention module; the original stays as the child ``original``.

    Without an active ``RetrievalSession`` it is the original module, unchanged.
    """

    def attend(self, hidden_states: torch.Tensor, session: RetrievalSession) -> torch.Tensor:
        """Retrieval attention for decoder states [R, T, d_model]; rows are documents x beams."""
        rows, steps, _ = hidden_states.shape
        heads, head_dim = self.num_heads, self.head_dim
        query_proj, key_proj = self._projection("query"), self._projection("key")
        value_proj, output_proj = self._projection("value"), self._projection("output")
        d_model = key_proj.weight.shape[1]

        q = query_proj(hidden_states).view(rows, steps, heads, head_dim)  # [R, T, H, dh]
        w_k = key_proj.weight.view(heads, head_dim, d_model)  # [H, dh, d]
        q_hidden = torch.einsum("rthe,hed->rthd", q, w_k).float()  # [R, T, H, d]

        n_docs = len(session.stores)
        if rows % n_docs:
            raise RuntimeError(f"{rows} decoder rows cannot be split over {n_docs} documents")
        rows_per_doc = rows // n_docs  # generate() repeats each document's row for beams and samples
        mixed = torch.empty_like(q_hidden)  # [R, T, H, d]: softmax-weighted sums of retrieved states
        for doc, store in enumerate(session.stores):
            block = slice(doc * rows_per_doc, (doc + 1) * rows_per_doc)
            queries = q_hidden[block].reshape(-1, d_model) * self.scaling  # [rows_per_doc * T * H, d]
            started = time.perf_counter()
            # one call per layer and document: every head, beam and step of it in one pass over the store
            coverage = session.coverage[doc] if session.coverage is not None else None
            mixed[block] = store.attend(queries, session.retrieval_k, coverage).view(rows_per_doc, steps, heads, d_model)
            session.stats.search_seconds += time.perf_counter() - started

        w_v = value_proj.weight.view(heads, head_dim, d_model)  # [H, dh, d]
        values = torch.einsum("rthd,hed->rthe", mixed.to(w_v.dtype), w_v)  # [R, T, H, dh]
        if value_proj.bias is not None:
            values = values + value_proj.bias.view(heads, head_dim)
        return output_proj(values.reshape(rows, steps, heads * head_dim))


def _wrap(architecture: Architecture):
    return lambda original, index: RetrievalCrossAttention(original, architecture, index)


def install(model: nn.Module, architecture: Architecture) -> list[RetrievalCrossAttention]:
    """Wrap every decoder cross-attention of ``model``; refuse to wrap twice."""
    return wrapping.install(model, architecture, architecture.cross_attention, RetrievalCrossAttention,
                            _wrap(architecture))


def uninstall(model: nn.Module, architecture: Architecture) -> None:
    """Put every original cross-attention module back."""
    wrapping.uninstall(model, architecture, architecture.cross_attention, RetrievalCrossAttention)


@contextmanager
def retrieval(model: nn.Module, architecture: Architecture, session: RetrievalSession) -> Iterator[RetrievalSession]:
    """Within the block, every cross-attention of ``model`` reads ``session``'s datastores.

    Installs the wrappers if they are not there yet, and leaves the model as it found it.
    """
    site = architecture.cross_attention
    with wrapping.wrapped(model, architecture, site, RetrievalCrossAttention, _wrap(architecture)) as wrappers:
        for wrapper in wrappers:
            wrapper.session = session
        try:
            yield session
        finally:
            for wrapper in wrappers:
                wrapper.session = None
