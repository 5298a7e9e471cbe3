"""The datastore: every encoded input state h_e [N, d], stored once, searched by inner product.

One copy of the states in 16 bits serves both the search (which tokens each head attends
to) and the value lookup (the attention output in hidden space). How:

- exact (CPU and GPU): a 16-bit torch tensor; ``attend`` reads it once per call for every
  query of a decoder step (unlimisum/search/kernels.py: one scores matmul, then a gather of the
  top-k or a dense pass), with the kernel measured on the machine that runs.
- ivf: the exact buffer (a faiss code buffer) plus an ``IndexIVFScalarQuantizer`` trained at
  ``finish`` on a strided sample of it. Inverted lists keep their own codes and int64 ids, so
  IVF holds the states twice (~4 bytes per number + 8 per token); lists are sized exactly.
- hnsw: ``IndexHNSWSQ``; its storage is reserved once and is the only copy (values are a
  zero-copy view of it); the graph adds ~0.3 bytes per number at d=768 (M=32).

Approximate kinds find their candidates with faiss (which may round the query to bf16 on
CPUs with AVX512-BF16) and score the ids found in fp32, so scores do not depend on the CPU;
the exact kind's precision is documented in unlimisum/search/kernels.py. ``view(start, end)`` of
any store is a zero-copy exact store over that token range (a chapter of the book).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import faiss
import numpy as np
import torch

from unlimisum.search import kernels
from unlimisum.search.flat import SCALAR_QUANTIZER as _SCALAR_QUANTIZER
from unlimisum.search.flat import new_flat_index
from unlimisum.search import packed as packing
from unlimisum.config import IndexConfig
from unlimisum.errors import ConfigError
from unlimisum.search.placement import APPROXIMATE_KINDS, IndexPlan, plan_index, storage_dtype, validate_index_config

__all__ = ["IndexPlan", "plan_index", "DatastoreBuilder", "Datastore", "attention_mass_recall",
           "TorchExactDatastore", "FaissDatastore", "IVFDatastore", "HNSWDatastore"]

# Bound on the temporaries of one search step of the approximate kinds and of building a store (fp32 upcasts).
CHUNK_BYTES_CPU = 64 * 2**20
# IVF: nlist ~ 4 sqrt(N) (faiss' usual range), trained with faiss' minimum of 39 points per list on
# at most a quarter of the states, so the fp32 training sample stays under half the fp16 store.
IVF_LISTS_PER_SQRT_N = 4
IVF_TRAIN_POINTS_PER_LIST = 39
IVF_MAX_TRAIN_FRACTION = 0.25
# HNSW: M=32 links per node and efConstruction=80 (build time grows with both; recall saturates);
# efSearch = 2k, since fewer than k candidates in the beam cannot fill k results.
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_PER_K = 2



# fp32 states gathered at once to score a search's top-k exactly (an approximate index's candidates, the native
# kernel's winners)
RESCORE_BYTES = 256 * 2**20


class Datastore:
    """The encoded input, ready for search and value lookup. Build it with ``DatastoreBuilder``."""

    # the exact store's per-layer keys (unlimisum/search/keys.py), which its heads score instead of the
    # states when present (the states then serve the weighted sums); set by the encoder, shared by views
    keys = None

    def __init__(self, states: torch.Tensor, kind: str, device: str, nbytes: int):
        self._states = states  # [N, d] 16-bit (or fp32), the one copy of the encoded input
        self.n_tokens, self.dim = states.shape
        self.kind = kind
        self.device = device
        self.storage_dtype = states.dtype
        self.nbytes = nbytes  # states + index structures
        self.packed_nbytes = 0  # the packed kernel's copies of the states, once made (TorchExactDatastore.packed)
        self._owner = None  # the datastore a view was taken from, kept alive with it

    def __repr__(self) -> str:
        return (f"Datastore(kind={self.kind!r}, device={self.device!r}, n_tokens={self.n_tokens}, dim={self.dim}, "
                f"storage_dtype={self.storage_dtype}, nbytes={self.nbytes})")

    def states(self) -> torch.Tensor:
        """[N, d] zero-copy view of the stored states, valid while this datastore lives."""
        return self._states

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k stored states by inner product for each query.

        queries [nq, d] on any device -> (scores [nq, k'] float32, ids [nq, k'] int64) on that device,
        k' = min(k, N), sorted by score descending. Approximate kinds may find fewer than k': the
        missing tail is id 0 with score -inf (weight 0 after softmax).
        """
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [nq, {self.dim}], got {list(queries.shape)}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, self.n_tokens)
        scores, ids = self._search(queries.detach().float(), k)
        return scores.to(queries.device), ids.to(queries.device)

    def _search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def prepare(self, queries_per_head: int = 1, retrieval_k: int = 1024) -> None:
        """Make now what the first search would otherwise make inside the first decoding step (for the exact
        store: the measured kernel choice and the packed kernel's copies; with per-layer keys, the head kernel
        measured for ``queries_per_head`` (the beams) and ``retrieval_k``); nothing to make for faiss indexes."""

    def attend(self, queries: torch.Tensor, k: int, coverage: torch.Tensor | None = None) -> torch.Tensor:
        """Retrieval attention in hidden space: per query, softmax over its top-k scores times those states.

        queries [nq, d] (the model's scaling folded in) -> [nq, d] float32 on the queries' device.
        ``coverage`` [N] float32 (on the store's device), when given, gets every query's weights added.
        """
        scores, ids = self.search(queries, k)  # [nq, k]
        # an approximate index that found nothing for a query gives all -inf: attend to nothing
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        if coverage is not None:
            coverage.index_add_(0, ids.reshape(-1).to(coverage.device), weights.reshape(-1).to(coverage.device))
        return self.weighted_sum(ids, weights)

    def retrieve(self, queries: torch.Tensor, k: int, exclude: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attend`` that also says what each query attended to: (ids [nq, k'], weights [nq, k'] float32,
        attended [nq, d] float32), all on the queries' device, k' = min(k, N); weight 0 for padding.

        For the evidence pass (every position of a summary at once). ``exclude`` [N] bool (on any device): states
        hidden from every query, as if they were not stored (the ablation pass hides a sentence's passages).
        """
        hidden = exclude.to(self._states.device) if exclude is not None else None
        wanted = min(k, self.n_tokens)
        extra = int(hidden.sum()) if hidden is not None else 0  # found, then dropped: fetch as many more
        scores, ids = self.search(queries, min(self.n_tokens, wanted + extra))
        if hidden is not None:
            scores = scores.masked_fill(hidden[ids.to(hidden.device)].to(scores.device), float("-inf"))
            scores, order = scores.sort(dim=1, descending=True)
            scores, ids = scores[:, :wanted], ids.gather(1, order)[:, :wanted]
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return ids, weights, self.weighted_sum(ids, weights)

    def view(self, start: int, end: int) -> "Datastore":
        """The tokens [start, end) as a datastore of their own (ids 0..end-start), sharing this one's memory."""
        raise NotImplementedError

    def packed(self) -> "kernels.PackedStates | None":
        """The packed kernel's copies of the states, where this kind keeps them (the exact store); else None."""
        return None

    @contextmanager
    def unpacked(self):
        """Within the block, searches read the states, not copies of them (the exact store's packed copies)."""
        yield self

    def compiled_kernels(self, retrieval_k: int) -> tuple[str, ...]:
        """The compiled kernels (unlimisum/search/compiled.py) this store's search may run for steps retrieving
        ``retrieval_k`` tokens a head: ``prepare`` needs them compiled; none for faiss indexes."""
        return ()

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.n_tokens:
            raise ValueError(f"a view needs 0 <= start < end <= {self.n_tokens}, got [{start}, {end})")

    def weighted_sum(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[i, j] * state[ids[i, j]]: ids [nq, k] int64, weights [nq, k] -> [nq, d] float32.

        The result is on the weights' device. Gathers in bounded steps (kernels.gathered_attention), summed
        in fp32, never materialising [nq, k, d].
        """
        if ids.shape != weights.shape or ids.dim() != 2:
            raise ValueError(f"ids and weights must both be [nq, k], got {list(ids.shape)} and {list(weights.shape)}")
        out_device = weights.device
        ids = ids.to(self._states.device)
        weights = weights.to(self._states.device, torch.float32)
        return kernels.gathered_attention(self._states, ids, weights, widen=True).to(out_device)


class TorchExactDatastore(Datastore):
    """Exact search and attention by one streaming pass over a torch tensor (CPU or GPU)."""

    _packed = None  # the packed kernel's copies of the states (kernels.PackedStates), made on first use
    _packing_checked = False
    _source = None  # a view's (book's own store, first token there): whose packed copies it reads

    def kernel(self) -> kernels.KernelChoice:
        """The measured kernel choice for this store's device, dtype and width."""
        # the first calibration of the process times on this store's own rows where it has enough
        return kernels.kernel_for(self._states.device, self.storage_dtype, self.dim, sample=self._states,
                                  compiled_sums=kernels.uses_compiled(self.n_tokens, self._states.device))

    def prepare(self, queries_per_head: int = 1, retrieval_k: int = 1024) -> None:
        if self.keys is not None:  # the heads score the keys: the states serve sums only, never packed
            self.kernel()
            self.keys.choice(self.dim, queries_per_head=queries_per_head, k=retrieval_k)
            return
        self.packed()  # calibrates the kernels first (once per process), then packs when that kernel was chosen

    def compiled_kernels(self, retrieval_k: int) -> tuple[str, ...]:
        keys = self.keys
        return kernels.compiled_kernels_for(self.n_tokens, self.storage_dtype, self._states.device, self.dim,
                                            per_layer=keys is not None, values=keys is not None
                                            and keys.values is not None and retrieval_k >= self.n_tokens)

    def packed(self) -> "kernels.PackedStates | None":
        """The packed copies the packed kernel reads, made once when that kernel was chosen, the states are
        within fp16's range and the copies fit their memory budget (unlimisum/search/packed.py); else None.
        A view reads its book's copies (a window of them) when the book's store is packed, and never packs its
        own rows: a book is packed once for all its chapters."""
        if not self._packing_checked and self.kernel().scores == "packed":
            self._packing_checked = True
            if self._source is not None:
                root, start = self._source
                book = root.packed()
                if book is not None:
                    self._packed = book.window(start, start + self.n_tokens)
                    self.packed_nbytes = packing.packed_bytes(self._packed.covered_rows, self.dim)  # shared
            elif packing.memory_allows(self.n_tokens, self.dim) and packing.packable(self._states):
                self._packed = kernels.PackedStates(self._states)
                self.packed_nbytes = packing.packed_bytes(self.n_tokens, self.dim)  # reported beside the store
        return self._packed

    @contextmanager
    def unpacked(self):
        """Within the block, searches read the states themselves, not the packed kernel's copies (support by
        removal changes some states for one reading: its copies would not follow)."""
        packed, checked = self._packed, self._packing_checked
        self._packed, self._packing_checked = None, True
        try:
            yield self
        finally:
            self._packed, self._packing_checked = packed, checked

    def attend(self, queries, k, coverage=None):
        out = kernels.attend(self._states, queries.detach(), min(k, self.n_tokens), self.kernel(), coverage,
                             self.packed())
        return out.to(queries.device)

    def retrieve(self, queries, k, exclude=None):
        """By the kernel that generation ran (``kernels.retrieve``): the same scores, so the same weights."""
        hidden = exclude.to(self._states.device) if exclude is not None else None
        ids, weights, out = kernels.retrieve(self._states, queries.detach(), k, self.kernel(), self.packed(), hidden)
        return ids.to(queries.device), weights.to(queries.device), out.to(queries.device)

    def view(self, start, end):
        self._check_range(start, end)
        states = self._states[start:end]  # zero-copy
        view = TorchExactDatastore(states, self.kind, self.device, states.numel() * states.element_size())
        view._owner = self  # keeps the memory the view points into alive
        root, offset = self._source if self._source is not None else (self, 0)
        view._source = (root, offset + start)
        view.keys = self.keys.view(start, end) if self.keys is not None else None
        return view

    def _search(self, queries, k):
        """Top-k by the kernel's scores; scores returned in fp32: the float32 and packed kernels' own, the native
        kernel's (rounded to the storage dtype) recomputed in fp32 for the ids found (``_rescored``)."""
        queries = queries.to(self._states.device)  # [nq, d] fp32
        choice = self.kernel()
        packed = self.packed()
        scores, ids = kernels.select(self._states, queries, k, choice, packed)  # [nq, k]
        ran = choice if packed is not None and choice.scores == "packed" else choice.unpacked()
        if ran.scores == "native" and self.storage_dtype != torch.float32:
            scores = _rescored(self._states, queries, ids)
        scores, order = scores.float().sort(dim=1, descending=True)
        return scores, ids.gather(1, order)


def _rescored(states: torch.Tensor, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[nq, k] fp32 scores of ``queries`` [nq, d] against the states ``ids`` [nq, k] chose, reading each state
    chosen once: the distinct ids widened to fp32 in blocks (at most RESCORE_BYTES), scored against every query
    by one matmul, the pairs wanted picked out. Nothing is ever [nq, k, d]."""
    nq, k = ids.shape
    distinct, position = torch.unique(ids, return_inverse=True)  # [U], [nq, k] index into distinct
    out = torch.empty(nq, k, dtype=torch.float32, device=states.device)
    rows = max(1, RESCORE_BYTES // (4 * (nq + states.shape[1])))  # [u, d] widened + [nq, u] scores
    for first in range(0, distinct.shape[0], rows):
        block = states[distinct[first:first + rows]].float()  # [u, d] fp32
        scored = queries @ block.T  # [nq, u]
        inside = (position >= first) & (position < first + block.shape[0])  # [nq, k]
        picked = scored.gather(1, (position - first).clamp_(0, block.shape[0] - 1))
        out = torch.where(inside, picked, out)
    return out


class FaissDatastore(Datastore):
    """Search through a faiss index on the CPU (exact flat/SQ here; IVF and HNSW below)."""

    def __init__(self, states, kind, nbytes, index: faiss.Index, keep_alive: tuple = ()):
        super().__init__(states, kind, "cpu", nbytes)
        self._index = index
        self._keep_alive = keep_alive  # faiss objects the index or the states view point into

    def _search_params(self, k: int):
        return None

    def view(self, start, end):
        """A range is searched exactly: a chapter is a small share of a book, and its states are right here."""
        self._check_range(start, end)
        states = self._states[start:end]  # zero-copy, into faiss's buffer
        view = TorchExactDatastore(states, "exact", "cpu", states.numel() * states.element_size())
        view._owner = self  # keeps the index, and so the buffer the view points into, alive
        view._source = (self, start)  # a faiss index keeps no packed copies: its views are not packed either
        return view

    def _search(self, queries, k):
        """faiss finds the candidates, scored here in fp32 (faiss may round the query to bf16 on CPUs with
        AVX512-BF16: scores, and attention weights, do not depend on the CPU), in blocks of queries whose gathered
        states stay within RESCORE_BYTES (the evidence pass searches for every summary position at once)."""
        block = max(1, RESCORE_BYTES // (4 * k * self.dim))
        found = [self._search_block(queries[i:i + block], k) for i in range(0, queries.shape[0], block)]
        if not found:
            return queries.new_empty(0, k), torch.empty(0, k, dtype=torch.long)
        return torch.cat([scores for scores, _ in found]), torch.cat([ids for _, ids in found])

    def _search_block(self, queries, k):
        x = np.ascontiguousarray(queries.cpu().numpy())  # [nq, d] fp32
        _, ids = self._index.search(x, k, params=self._search_params(k))  # [nq, k], id -1: not found
        ids = torch.from_numpy(ids)
        missing = ids < 0
        ids = ids.masked_fill(missing, 0)
        scores = torch.einsum("qkd,qd->qk", self._states[ids].float(), queries)  # [nq, k], within RESCORE_BYTES
        scores = scores.masked_fill(missing, float("-inf"))
        scores, order = scores.sort(dim=1, descending=True)
        return scores, ids.gather(1, order)


class IVFDatastore(FaissDatastore):
    """IVF: probes enough lists to scan about ``scan_factor * k`` states per query."""

    def __init__(self, states, nbytes, index, keep_alive, scan_factor: float):
        super().__init__(states, "ivf", nbytes, index, keep_alive)
        self.nlist = index.nlist
        self.scan_factor = scan_factor  # tunable after building (the benchmark sweeps it)

    def nprobe(self, k: int) -> int:
        """Lists probed for a top-k search: enough for ~scan_factor*k states, at most all of them."""
        mean_list = self.n_tokens / self.nlist
        return min(self.nlist, max(1, math.ceil(self.scan_factor * k / mean_list)))

    def _search_params(self, k):
        return faiss.SearchParametersIVF(nprobe=self.nprobe(k))


class HNSWDatastore(FaissDatastore):
    """HNSW: searches with a beam of ``ef_per_k * k`` candidates."""

    def __init__(self, states, nbytes, index, keep_alive, ef_per_k: float = HNSW_EF_PER_K):
        super().__init__(states, "hnsw", nbytes, index, keep_alive)
        self.ef_per_k = ef_per_k  # tunable after building

    def _search_params(self, k):
        return faiss.SearchParametersHNSW(efSearch=max(16, math.ceil(self.ef_per_k * k)))


class DatastoreBuilder:
    """Collect the encoded states chunk by chunk, in input order, then ``finish()`` into a Datastore.

    An exact store is a torch tensor on the plan's device; IVF and HNSW are faiss indexes on the CPU.
    """

    def __init__(self, n_tokens: int, dim: int, plan: IndexPlan, config: IndexConfig = IndexConfig()):
        validate_index_config(config)
        if n_tokens <= 0 or dim <= 0:
            raise ValueError(f"a datastore needs at least one token and one dimension, got {n_tokens} x {dim}")
        if plan.kind not in ("exact", *APPROXIMATE_KINDS):
            raise ValueError(f"unknown index kind {plan.kind!r}")
        on_cpu = torch.device(plan.device).type == "cpu"
        if plan.kind != "exact" and not on_cpu:
            raise ValueError(f"index kind {plan.kind!r} runs on the CPU only, not on {plan.device}")
        self.n_tokens, self.dim, self.plan, self.config = n_tokens, dim, plan, config
        self.dtype = storage_dtype(config)
        self._filled = 0
        self._use_torch = plan.kind == "exact"
        nbytes = n_tokens * dim * self.dtype.itemsize
        if self._use_torch:
            self._index = None
            self._states = torch.empty(n_tokens, dim, dtype=self.dtype, device=plan.device)  # [N, d]
        elif plan.kind == "hnsw":
            self._index = _new_hnsw_index(dim, self.dtype)
            self._codes_owner = faiss.downcast_index(self._index.storage)
            _reserve(self._codes_owner.codes, nbytes)  # storage.add appends without ever reallocating
        else:  # ivf: a flat faiss buffer filled in place, the states the lists are built from
            self._index = new_flat_index(dim, self.dtype)
            self._codes_owner = self._index
            self._index.codes.resize(nbytes)
            self._states = _codes_view(self._index.codes, n_tokens, dim, self.dtype)  # [N, d]

    def add(self, states: torch.Tensor) -> None:
        """Append encoded states [n, d] (any float dtype, any device) after those added before."""
        if states.dim() != 2 or states.shape[1] != self.dim or not states.is_floating_point():
            raise ValueError(f"states must be a float tensor [n, {self.dim}], got {states.dtype} {list(states.shape)}")
        n = states.shape[0]
        if self._filled + n > self.n_tokens:
            raise ValueError(f"datastore announced {self.n_tokens} tokens but {self._filled + n} were added")
        states = states.detach()
        if self.plan.kind == "hnsw":
            rows = max(1, CHUNK_BYTES_CPU // (self.dim * 4))
            for start in range(0, n, rows):
                x = states[start:start + rows].to("cpu", torch.float32)  # [rows, d] fp32 temporary
                self._check_range(x)
                self._index.add(np.ascontiguousarray(x.numpy()))
        else:
            target = self._states[self._filled:self._filled + n]  # [n, d] view into the store
            target.copy_(states)
            self._check_range(target)
        self._filled += n

    def _check_range(self, x: torch.Tensor) -> None:
        """fp16 storage turns states beyond +-65504 into inf: say so instead of searching garbage."""
        if self.dtype != torch.float16:
            return
        if torch.isinf(x).any() if x.dtype == torch.float16 else x.abs().amax() > 65504:
            raise ConfigError("encoder states exceed the float16 range; store them as bfloat16 or float32 "
                              "(--storage-dtype, or IndexConfig.storage_dtype)")

    def finish(self) -> Datastore:
        """The built Datastore; every announced token must have been added."""
        if self._filled != self.n_tokens:
            raise ValueError(f"datastore announced {self.n_tokens} tokens but only {self._filled} were added")
        n, d, dtype = self.n_tokens, self.dim, self.dtype
        states_bytes = n * d * dtype.itemsize
        if self._use_torch:
            return TorchExactDatastore(self._states, "exact", self.plan.device, states_bytes)
        if self.plan.kind == "hnsw":
            hnsw = self._index.hnsw
            assert self._codes_owner.codes.size() == states_bytes, "HNSW storage does not hold every state"
            states = _codes_view(self._codes_owner.codes, n, d, dtype)  # the storage's own codes
            graph_bytes = hnsw.neighbors.size() * 4 + hnsw.levels.size() * 4 + hnsw.offsets.size() * 8
            return HNSWDatastore(states, states_bytes + graph_bytes, self._index, (self._codes_owner,))
        self._index.ntotal = n
        return self._finish_ivf()

    def _finish_ivf(self) -> Datastore:
        """Train an IVF on a strided sample of the filled buffer, then fill exactly sized lists from it."""
        n, d, dtype, states = self.n_tokens, self.dim, self.dtype, self._states
        nlist = max(1, min(round(IVF_LISTS_PER_SQRT_N * math.sqrt(n)),
                           int(n * IVF_MAX_TRAIN_FRACTION) // IVF_TRAIN_POINTS_PER_LIST))
        quantizer = faiss.IndexFlatIP(d)
        if dtype == torch.float32:
            ivf = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            ivf = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, _SCALAR_QUANTIZER[dtype],
                                                faiss.METRIC_INNER_PRODUCT, False)
        n_train = min(n, max(nlist * IVF_TRAIN_POINTS_PER_LIST, 1))
        sample = states[torch.linspace(0, n - 1, n_train).long()].float()  # [n_train, d] fp32
        ivf.train(np.ascontiguousarray(sample.numpy()))
        del sample

        rows = max(1, CHUNK_BYTES_CPU // (d * 4))
        assign = np.empty(n, dtype=np.int64)  # list of every state, computed once
        for start in range(0, n, rows):
            x = np.ascontiguousarray(states[start:start + rows].float().numpy())  # [rows, d] fp32 temporary
            assign[start:start + len(x)] = quantizer.search(x, 1)[1].ravel()
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        for list_no, size in enumerate(np.bincount(assign, minlength=nlist)):
            lists.resize(list_no, int(size))  # reserve exactly: adding later never reallocates
            lists.resize(list_no, 0)
        for start in range(0, n, rows):
            x = np.ascontiguousarray(states[start:start + rows].float().numpy())
            ivf.add_core(len(x), faiss.swig_ptr(x), None, faiss.swig_ptr(assign[start:start + len(x)]))
        del assign

        lists_bytes = n * (lists.code_size + 8) + nlist * d * 4  # codes + int64 ids + centroids
        nbytes = n * d * dtype.itemsize + lists_bytes
        return IVFDatastore(states, nbytes, ivf, (self._index, quantizer), self.config.ivf_scan_factor)


def attention_mass_recall(exact: Datastore, approx: Datastore, queries: torch.Tensor, k: int,
                          scaling: float = 1.0) -> float:
    """Mean over queries of the exact top-k attention mass (softmax of scores*scaling) that
    the approximate top-k also retrieved. 1.0 means the approximation loses nothing."""
    exact_scores, exact_ids = exact.search(queries, k)  # [nq, k]
    approx_scores, approx_ids = approx.search(queries, k)
    mass = torch.softmax(exact_scores * scaling, dim=1)  # [nq, k]
    found = approx_ids.masked_fill(approx_scores == float("-inf"), -1).sort(dim=1).values  # padding matches nothing
    pos = torch.searchsorted(found, exact_ids).clamp(max=found.shape[1] - 1)
    hit = found.gather(1, pos) == exact_ids  # [nq, k]
    return float((mass * hit).sum(1).mean())


# --- faiss plumbing -----------------------------------------------------------------------------


def _new_hnsw_index(dim: int, dtype: torch.dtype) -> faiss.Index:
    if dtype == torch.float32:
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexHNSWSQ(dim, _SCALAR_QUANTIZER[dtype], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    return index


def _reserve(codes, nbytes: int) -> None:
    """Give a faiss byte vector capacity for ``nbytes`` (resize up then down keeps the capacity)."""
    codes.resize(nbytes)
    codes.resize(0)


def _codes_view(codes, n: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, dim] torch view of a faiss code buffer holding ``dtype`` numbers; no copy."""
    raw = faiss.rev_swig_ptr(codes.data(), n * dim * dtype.itemsize)  # numpy uint8 over faiss memory
    return torch.from_numpy(raw).view(dtype).view(n, dim)
