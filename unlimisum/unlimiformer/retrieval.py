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
from unlimisum.search import head_kernels, kernels
from unlimisum.search.placement import READING_QUERIES_PER_HEAD


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
    # the evidence pass (teacher-forced over returned summaries): per-token attention mass kept here
    evidence: "EvidenceCollector | None" = None
    # per document, [N] bool or None: input tokens hidden from retrieval (the ablation pass hides the passages a
    # sentence drew on); None: nothing hidden
    hidden: Sequence | None = None
    # generation that records the evidence pass's reading as it goes (reread.GenerationRecorder): one row per
    # document, each layer's ids and weights handed to ``recorder.add(doc, layer, ids, weights)``
    recorder: object | None = None


# input positions kept per summary token by the evidence pass (the rest of its mass counts in coverage only)
EVIDENCE_TOP_POSITIONS = 64


class EvidenceCollector:
    """Per document of a teacher-forced pass: each decoder position's top input positions by attention mass
    (over all layers and heads), and the coverage of the positions that produced the returned sequence.

    ``valid`` [T] bool per document: the decoder positions whose next token is part of the returned sequence
    (through its end token); the others (padding after it in a batch) count nowhere.
    """

    def __init__(self, valid: Sequence[torch.Tensor], sizes: Sequence[int], top: int = EVIDENCE_TOP_POSITIONS):
        self.valid = list(valid)
        self.sizes = list(sizes)
        self.top = top
        # made on the first layer's device (the store's): the merging stays there, one copy at the end
        self.positions: list[torch.Tensor | None] = [None] * len(self.valid)
        self.mass: list[torch.Tensor | None] = [None] * len(self.valid)
        self.coverage: list[torch.Tensor | None] = [None] * len(self.valid)
        self.first_row = 0  # the decoder position of the first row of the next ``add`` (positions read in chunks)

    def add(self, doc: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """One layer's retrieval of document ``doc``: ids and weights [n, heads * k] for the decoder positions
        ``first_row`` .. ``first_row + n`` (all of them, unless the positions are read in chunks)."""
        weights = weights.float()
        device = ids.device
        if self.positions[doc] is None:  # unused slots: position 0 with no mass
            rows = len(self.valid[doc])
            self.valid[doc] = self.valid[doc].to(device)
            self.positions[doc] = torch.zeros(rows, self.top, dtype=torch.long, device=device)
            self.mass[doc] = torch.zeros(rows, self.top, device=device)
            self.coverage[doc] = torch.zeros(self.sizes[doc], dtype=torch.float64, device=device)
        part = slice(self.first_row, self.first_row + ids.shape[0])
        valid = self.valid[doc][part]
        self.coverage[doc].index_add_(0, ids[valid].reshape(-1), weights[valid].reshape(-1).double())
        ids = torch.cat([self.positions[doc][part], ids], dim=1)
        weights = torch.cat([self.mass[doc][part], weights], dim=1)
        ids, order = ids.sort(dim=1)
        weights = weights.gather(1, order).double()
        # the mass of each run of equal ids, kept at the run's last column
        ends = torch.ones_like(ids, dtype=torch.bool)
        ends[:, :-1] = ids[:, 1:] != ids[:, :-1]
        running = weights.cumsum(dim=1)
        at_ends = torch.where(ends, running, torch.zeros_like(running))
        before = torch.cummax(at_ends, dim=1).values  # the running sum at the previous run's end
        before = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], dim=1)
        sums = torch.where(ends, running - before, torch.zeros_like(running))
        mass, columns = sums.float().topk(self.top, dim=1)
        self.positions[doc][part], self.mass[doc][part] = ids.gather(1, columns), mass

    def results(self, doc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [T, M], mass [T, M], coverage [N] float32) of document ``doc``, on the CPU."""
        if self.positions[doc] is None:  # no layer retrieved (a model without cross-attention layers)
            rows = len(self.valid[doc])
            return (torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, 0), torch.zeros(self.sizes[doc]))
        return self.positions[doc].cpu(), self.mass[doc].cpu(), self.coverage[doc].float().cpu()


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

        n_docs = len(session.stores)
        if rows % n_docs:
            raise RuntimeError(f"{rows} decoder rows cannot be split over {n_docs} documents")
        rows_per_doc = rows // n_docs  # generate() repeats each document's row for beams and samples
        w_v = value_proj.weight.view(heads, head_dim, d_model)  # [H, dh, d]
        masked_rows = _masked_rows(session)  # a support reading's rows: one store, each its own mask, read together
        values = (self._attend_masked_rows(q, w_v, session) if masked_rows
                  else torch.empty(rows, steps, heads, head_dim, dtype=w_v.dtype, device=hidden_states.device))
        for doc, store in enumerate(() if masked_rows else session.stores):
            block = slice(doc * rows_per_doc, (doc + 1) * rows_per_doc)
            if store.keys is not None:  # each head scores its own keys of this layer
                started = time.perf_counter()
                attended, projected = self._attend_keys(store, q[block], session, doc)
                session.stats.search_seconds += time.perf_counter() - started
                # [r, T, H, dh] the layer's own values summed, or [r, T, H, d] states to project
                values[block] = attended if projected else torch.einsum("rthd,hed->rthe", attended.to(w_v.dtype), w_v)
                continue
            # each document's rows a product of their own: a support reading's two rows (two documents of one
            # store) are computed alike, wherever they sit
            q_hidden = torch.einsum("rthe,hed->rthd", q[block], w_k).float()  # [r, T, H, d]
            queries = q_hidden.reshape(-1, d_model) * self.scaling  # [rows_per_doc * T * H, d]
            started = time.perf_counter()
            # one call per layer and document: every head, beam and step of it in one pass over the store
            hidden = session.hidden[doc] if session.hidden is not None else None
            if session.evidence is not None or hidden is not None or session.recorder is not None:
                # what each query attended to is wanted
                ids, weights, attended = store.retrieve(queries, session.retrieval_k, exclude=hidden)  # [T * H, k]
                per_position = (ids.reshape(rows_per_doc * steps, -1), weights.reshape(rows_per_doc * steps, -1))
                if session.evidence is not None:
                    session.evidence.add(doc, *per_position)
                if session.recorder is not None:
                    session.recorder.add(doc, self.layer_index, *per_position)
            else:
                coverage = session.coverage[doc] if session.coverage is not None else None
                attended = store.attend(queries, session.retrieval_k, coverage)
            session.stats.search_seconds += time.perf_counter() - started
            mixed = attended.view(rows_per_doc, steps, heads, d_model)  # softmax-weighted sums of retrieved states
            values[block] = torch.einsum("rthd,hed->rthe", mixed.to(w_v.dtype), w_v)  # [r, T, H, dh]

        if value_proj.bias is not None:
            values = values + value_proj.bias.view(heads, head_dim)
        return output_proj(values.reshape(rows, steps, heads * head_dim))

    def _head_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Rows' queries q [r, T, H, dh] as each head's, scaled: [H, r * T, dh] fp32, row-major."""
        rows, steps, heads, _ = q.shape
        return (q.float() * self.scaling).permute(2, 0, 1, 3).reshape(heads, rows * steps, -1)

    def _attend_masked_rows(self, q: torch.Tensor, w_v: torch.Tensor, session: RetrievalSession) -> torch.Tensor:
        """The value vectors [R, T, H, dh] of rows q [R, T, H, dh], row r (its document's one row) with the tokens
        ``session.hidden[r]`` out of its retrieval, every row from the same store's keys of this layer: one
        selection and one sum for all of them (``head_attend_masked``), each row as ``_attend_keys`` reads it."""
        rows, steps, heads, _ = q.shape
        store = session.stores[0]
        started = time.perf_counter()
        queries = self._head_queries(q)  # [H, R * T, dh]
        choice = store.keys.choice(store.dim, queries_per_head=READING_QUERIES_PER_HEAD, k=session.retrieval_k)
        values = store.keys.layer_values(self.layer_index)  # [H, N, dh] or None
        attended = head_kernels.head_attend_masked(store.keys.layer(self.layer_index), store.states(), queries,
                                                   session.retrieval_k, choice, store.kernel(), session.hidden,
                                                   values=values)
        session.stats.search_seconds += time.perf_counter() - started
        attended = attended.view(heads, rows, steps, -1).permute(1, 2, 0, 3)  # [R, T, H, d or dh]
        if values is not None:  # the layer's own values summed
            return attended.to(w_v.dtype)
        # row by row, products of one shape: the rows are computed alike wherever they sit
        return torch.stack([torch.einsum("thd,hed->the", row.to(w_v.dtype), w_v) for row in attended.unbind(0)])

    def _attend_keys(self, store, q: torch.Tensor, session: RetrievalSession, doc: int) -> tuple[torch.Tensor, bool]:
        """Retrieval attention of one document's queries q [r, T, H, dh] through its store's keys of this layer:
        ([r, T, H, d] float32 weighted sums of the shared states, False), or, where the store keeps this layer's
        values, ([r, T, H, dh] float32 weighted sums of each head's chosen values, True). The key bias is left out
        (it cancels in the softmax), the value bias is the caller's."""
        rows, steps, heads, _ = q.shape
        keys = store.keys.layer(self.layer_index)  # [H, N, dh]
        queries = self._head_queries(q)  # [H, r * T, dh]
        # a step's queries per head are its rows; a reading's (many positions at once) as the plan measured them
        queries_per_head = rows if steps == 1 else READING_QUERIES_PER_HEAD
        choice = store.keys.choice(store.dim, queries_per_head=queries_per_head, k=session.retrieval_k)
        k = min(session.retrieval_k, store.n_tokens)
        values = store.keys.layer_values(self.layer_index)  # [H, N, dh] or None
        hidden = session.hidden[doc] if session.hidden is not None else None
        if session.evidence is not None or session.recorder is not None:
            # what each query attended to is wanted
            ids, weights, attended = head_kernels.head_retrieve(keys, store.states(), queries, k, choice,
                                                                store.kernel(), exclude=hidden,
                                                                values=values)  # [H, r * T, k]
            ids, weights = ids.permute(1, 0, 2), weights.permute(1, 0, 2)  # [r * T, H, k]
            per_position = (ids.reshape(rows * steps, -1), weights.reshape(rows * steps, -1))
            if session.evidence is not None:
                session.evidence.add(doc, *per_position)
            if session.recorder is not None:
                session.recorder.add(doc, self.layer_index, *per_position)
        else:  # generation, or a support reading (``hidden``: only its output is wanted)
            coverage = session.coverage[doc] if session.coverage is not None else None
            attended = head_kernels.head_attend(keys, store.states(), queries, k, choice, store.kernel(), coverage,
                                                values=values, exclude=hidden)
        return attended.view(heads, rows, steps, -1).permute(1, 2, 0, 3), values is not None  # [r, T, H, d or dh]


def _masked_rows(session: RetrievalSession) -> bool:
    """Whether the session's rows are one document's, each with its own mask of hidden tokens, over per-layer
    keys at k < N, with only the output wanted (``SummaryReader.log_probs_both``): read together."""
    stores = session.stores
    return (session.hidden is not None and len(stores) > 1 and all(store is stores[0] for store in stores)
            and all(mask is not None for mask in session.hidden) and stores[0].keys is not None
            and session.retrieval_k < stores[0].n_tokens and session.evidence is None
            and session.recorder is None and session.coverage is None)


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
            kernels.release_scratch()  # the steps' buffers: not held while the process does something else
