"""The evidence pass: a returned summary read once more, teacher-forced, by the decoder that wrote it.

After generate(), each summary (the returned sequence up to its end token) is fed to the decoder at once,
every cross-attention retrieving from the same store with the same k and the same kernel as in generation
(and under the same Tensor Cache, when one bounded the decoder's self-attention). That gives, per summary
token, the input positions its attention went to (``EvidenceCollector``: the evidence of each sentence and
the coverage of the returned sequence alone).

Then **support**: each sentence that has passages is read twice more from the same state, the summary before it
as written (the decoder's self-attention state after the tokens before the sentence, kept from the first
reading): once with nothing hidden and once with its passages hidden from retrieval, the two readings the same
computation (the same forward, kernels, dtype and queries: only the mask differs, so hiding nothing gives exactly
0), the logits the model's own (``final_logits_bias`` included). The drop in the sentence's log-probability per
token is its support in nats. Each sentence's two rows are a forward of their own (a long sentence's, forwards of
READING_PIECE_TOKENS positions in turn), every linear layer taking each row in a product of its own
(``projections.rows_apart``: one product of both rows may round equal rows apart), but the output projection (the
model's largest matrix, streamed from memory for every product) is taken for several sentences' rows at once
(``_DeferredHead``: the pairs' first rows in one product, their second rows in another of the same shape).
Attention says where the model looked; support says how much the sentence depended on it (ContextCite measures a
source by what removing it does; AT2 found raw attention unreliable as attribution on its own). Two rows per
sentence, whose queries are the sentence's own positions.

The last returned token is never fed: it predicts nothing (and a summary that used every decoder position
would need one more). Where generation writes one row per document (greedy search, sampling) with the model's
own self-attention, its steps are this reading: ``GenerationRecorder`` keeps them as they are made, and only the
support is read again.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from unlimisum import evidence
from unlimisum.models import LoadedModel, compat
from unlimisum.search import projections
from unlimisum.search.datastore import Datastore
from unlimisum.unlimiformer.retrieval import EVIDENCE_TOP_POSITIONS, EvidenceCollector, RetrievalSession, retrieval


# The support readings' output projection, taken for several sentences' rows at once (two products: each pair's
# first rows, then its second): bart-base's (50,265 x 768, float32) took 31 ms for one sentence's 32 rows, 49 ms
# for 64 (EPYC Zen 2, two threads)
HEAD_ROWS = 128  # rows of readings whose output projection is taken at once, at least ...
HEAD_LOGIT_BYTES = 64 * 2**20  # ... unless their float32 logits reach this (a vocabulary of 250,000: 64 rows)
# A sentence's two readings go in forwards of at most this many positions, each after the state the last left:
# read whole, the scores of a 255-token sentence (2 rows x 12 heads x 16,384 keys a position) outgrew what the
# scores may hold at once (kernels.MAX_SCORE_BYTES), and bart-base's readings took 6.5 s; in pieces of 32, 64 and
# 128 positions 3.0, 2.9 and 3.0 s (EPYC Zen 2, two threads)
READING_PIECE_TOKENS = 64


@dataclass(frozen=True)
class Reading:
    """What reading one returned summary gave."""

    ids: tuple[int, ...]  # the returned sequence through its end token (the start token first)
    token_mass: evidence.TokenMass  # row j: the input positions behind token j (row 0, the start, has none)
    coverage: torch.Tensor  # [N] float32, CPU: attention mass per input token over the returned sequence
    prefixes: object  # the self-attention state after each prefix length the ablations start at (``_Prefixes``)


def returned_length(row: Sequence[int], eos: set[int]) -> int:
    """Tokens of a returned row through its first end token after the start (padding after it is not part)."""
    return next((t + 1 for t in range(1, len(row)) if row[t] in eos), len(row))


def end_tokens(loaded: LoadedModel) -> set[int]:
    """The ids that end a summary: the generation config's end tokens, else the tokenizer's."""
    eos = loaded.model.generation_config.eos_token_id
    eos = eos if isinstance(eos, (list, tuple)) else [eos if eos is not None else loaded.tokenizer.eos_token_id]
    return set(eos) - {None}


class SummaryReader:
    """Reads returned summaries with retrieval (and the Tensor Cache, when given): ``read`` then ``log_probs``
    with passages hidden. Use as a context manager: the wrappers stay installed for all the reads inside."""

    def __init__(self, loaded: LoadedModel, retrieval_k: int, tensor_cache=None):
        """``tensor_cache``: the TensorCacheSettings generation ran under, or None."""
        self.loaded, self.retrieval_k, self.tensor_cache = loaded, retrieval_k, tensor_cache
        self._stack: ExitStack | None = None
        self._memory = None  # the TensorCacheSession, inside the context
        self.session = RetrievalSession(stores=[], retrieval_k=retrieval_k)

    def __enter__(self) -> "SummaryReader":
        model, architecture = self.loaded.model, self.loaded.architecture
        self._stack = ExitStack()
        self._stack.enter_context(retrieval(model, architecture, self.session))
        self._stack.enter_context(projections.faster_projections(model))
        if self.tensor_cache is not None:
            from unlimisum.tensor_cache import tensor_cache

            self._memory = self._stack.enter_context(tensor_cache(model, architecture, self.tensor_cache))
        self._stack.enter_context(torch.inference_mode())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = self._memory = None

    def read(self, store: Datastore, ids: Sequence[int], starts: Sequence[int] = ()) -> Reading:
        """Read the returned sequence ``ids`` (through its end token) against ``store``. ``starts``: the prefix
        lengths (decoder positions) later ``log_probs`` calls start at; with a Tensor Cache the reading stops at
        each to keep the state there (its memory cannot be cut back), otherwise it is one forward."""
        ids = tuple(int(i) for i in ids)
        inputs = torch.tensor(ids[:-1], dtype=torch.long, device=self.loaded.device)  # position t predicts t + 1
        steps = inputs.shape[0]
        collector = EvidenceCollector([torch.ones(steps, dtype=torch.bool)], [store.n_tokens])
        self._use(store, collector, hidden=None)
        cache = self._new_cache()
        inputs = inputs.unsqueeze(0)  # [1, T - 1]
        bounds = sorted({0, steps, *(s for s in starts if 0 < s < steps)}) if self._memory is not None else [0, steps]
        snapshots = {}
        for first, last in zip(bounds, bounds[1:]):
            if self._memory is not None:
                snapshots[first] = _tensor_cache_of(cache).snapshot()
            collector.first_row = first
            output = self._forward(inputs[:, first:last], cache)
            cache = output.past_key_values if self._memory is None else cache
        positions, mass, coverage = collector.results(0)
        token_mass = evidence.TokenMass(torch.cat([torch.zeros_like(positions[:1]), positions]),
                                        torch.cat([torch.zeros_like(mass[:1]), mass]))
        prefixes = _Prefixes(self, cache if self._memory is None else None, snapshots)
        return Reading(ids, token_mass, coverage, prefixes)

    def log_probs(self, reading: Reading, store: Datastore, first: int, last: int, hidden: torch.Tensor) -> torch.Tensor:
        """log p(token j) for j in [first, last) of ``reading.ids`` with the input tokens ``hidden`` ([N] bool; all
        False: nothing hidden, by the same computation) out of retrieval: positions first-1 .. last-2 read again,
        after the state the first reading left at position first-1, the logits the model's own. [last - first]
        float32, CPU."""
        start = first - 1
        self._use(store, None, hidden=hidden)
        cache = reading.prefixes.at(start)
        inputs = torch.tensor(reading.ids[start:last - 1], dtype=torch.long, device=self.loaded.device)
        output = self._forward(inputs.unsqueeze(0), cache)
        return _token_log_probs(output.logits[0], inputs.new_tensor(reading.ids[first:last])).cpu()

    def log_probs_both(self, reading: Reading, store: Datastore, first: int, last: int,
                       hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``log_probs`` with nothing hidden and with ``hidden`` hidden, read together: one forward of two rows
        from the same state (each layer's retrieval one call for both, each row with its own mask: retrieval.py's
        ``_masked_rows``; every other computation row by row the same), or, under a Tensor Cache (whose state is
        one row), two forwards."""
        return self.log_probs_pairs(reading, store, [(first, last, hidden)])[0]

    def log_probs_pairs(self, reading: Reading, store: Datastore, spans: Sequence[tuple[int, int, torch.Tensor]],
                        on_read: Callable[[int], None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``log_probs_both`` of each (first, last, hidden) of ``spans``, in order: each pair a forward of its own
        (of READING_PIECE_TOKENS positions at most: more in turns), the two rows computed alike
        (``projections.rows_apart``), the output projection of several pairs' rows taken at once (up to HEAD_ROWS
        rows: every pair's first rows in one product, its second in another of the same shape);
        ``on_read(done)`` as the pairs' log-probabilities are ready."""
        if self._memory is not None:
            found: list[tuple[torch.Tensor, torch.Tensor]] = []
            for first, last, hidden in spans:
                nothing = torch.zeros_like(hidden)
                found.append((self.log_probs(reading, store, first, last, nothing),
                              self.log_probs(reading, store, first, last, hidden)))
                if on_read is not None:
                    on_read(len(found))
            return found
        device = store.states().device
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # each forward's pair of log-probabilities, in order
        # per span, the count of forwards read through its last
        ends = list(accumulate(-(-(last - first) // READING_PIECE_TOKENS) for first, last, _ in spans))

        def project() -> int:  # the kept forwards' projection: their pairs' log-probabilities found; rows left 0
            pieces.extend(head.log_probs())
            if on_read is not None:
                on_read(sum(end <= len(pieces) for end in ends))
            return 0

        with _deferred_head(self.loaded.model) as head, projections.rows_apart(self.loaded.model):
            rows = 0
            for first, last, hidden in spans:
                self.session.stores, self.session.evidence = [store, store], None
                self.session.hidden = [torch.zeros_like(hidden).to(device), hidden.to(device)]
                cache = reading.prefixes.at(first - 1, copies=2)
                for start in range(first - 1, last - 1, READING_PIECE_TOKENS):  # position start predicts start + 1
                    stop = min(start + READING_PIECE_TOKENS, last - 1)
                    inputs = torch.tensor(reading.ids[start:stop], dtype=torch.long, device=self.loaded.device)
                    output = self._forward(inputs.unsqueeze(0).repeat(2, 1), cache)
                    cache = output.past_key_values  # both rows' own, for the next piece
                    head.keep(output.logits, inputs.new_tensor(reading.ids[start + 1:stop + 1]))
                    rows += output.logits.shape[0] * output.logits.shape[1]
                    if rows >= HEAD_ROWS or rows * output.logits.shape[2] * 4 >= HEAD_LOGIT_BYTES:
                        rows = project()
            if rows:
                project()
        found, at = [], 0
        for end in ends:
            found.append(tuple(torch.cat([piece[row] for piece in pieces[at:end]]) for row in range(2)))
            at = end
        return found

    # -- the forward --------------------------------------------------------------------------

    def _use(self, store: Datastore, collector: EvidenceCollector | None, hidden: torch.Tensor | None) -> None:
        self.session.stores = [store]
        self.session.evidence = collector
        self.session.hidden = [hidden.to(store.states().device)] if hidden is not None else None

    def _new_cache(self):
        return self._memory.new_cache() if self._memory is not None else None

    def _forward(self, inputs: torch.Tensor, cache):
        """The decoder over ``inputs`` [rows, L] after ``cache``, every cross-attention retrieving."""
        model = self.loaded.model
        rows = inputs.shape[0]
        stand_in = torch.zeros(rows, 1, model.config.d_model, dtype=self.loaded.dtype, device=self.loaded.device)
        attention_mask = torch.ones(rows, 1, dtype=torch.long, device=self.loaded.device)
        return model(encoder_outputs=compat.encoder_outputs(stand_in), attention_mask=attention_mask,
                     decoder_input_ids=inputs, use_cache=True, **{compat.cache_argument(model): cache})


class GenerationRecorder:
    """The evidence pass's reading, recorded while generate() writes one row per document (greedy search,
    sampling): every step's retrieval is the teacher-forced reading of the returned sequence, so nothing needs
    reading again. Installed as the session's ``recorder`` (the retrieval wrapper hands it each layer's ids and
    weights) and as a stopping criterion that never stops (it sees which rows have ended)."""

    def __init__(self, sizes: Sequence[int], max_positions: int, layers: int, eos: set[int],
                 top: int = EVIDENCE_TOP_POSITIONS):
        self.sizes, self.layers, self.eos, self.top = list(sizes), layers, eos, top
        self.positions = [0] * len(sizes)  # decoder positions recorded per document
        self.finished = [False] * len(sizes)  # the row has written its end token: what follows is padding
        self.cache = None  # generate()'s self-attention cache at the end (set by the summarizer)
        self._max_positions = max_positions
        # per document, made on its store's device at the first step: the kept input positions and mass of every
        # decoder position [max_positions, top], the coverage [N] float64, and this forward's mass [n, N]
        self._kept: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sizes)
        self._coverage: list[torch.Tensor | None] = [None] * len(sizes)
        self._step: list[torch.Tensor | None] = [None] * len(sizes)

    def add(self, doc: int, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Layer ``layer``'s retrieval for document ``doc``'s newest positions: ids, weights [n, heads * k].

        The mass of this forward's positions is summed over layers and heads into a dense [n, N] vector (an
        index_add per layer), its ``top`` positions kept after the last layer: a step costs no sorting."""
        if self.finished[doc]:
            return
        n, device = ids.shape[0], ids.device
        if self._kept[doc] is None:
            self._kept[doc] = (torch.zeros(self._max_positions, self.top, dtype=torch.long, device=device),
                               torch.zeros(self._max_positions, self.top, device=device))
            self._coverage[doc] = torch.zeros(self.sizes[doc], dtype=torch.float64, device=device)
        weights = weights.float()
        step = self._step[doc]
        if step is None or step.shape[0] != n:
            step = self._step[doc] = torch.zeros(n, self.sizes[doc], device=device)
        step.scatter_add_(1, ids, weights)
        if layer == self.layers - 1:
            first = self.positions[doc]
            rows = slice(first, min(first + n, self._max_positions))
            top = min(self.top, self.sizes[doc])
            mass, positions = step.topk(top, dim=1)  # [n, top]
            positions_kept, mass_kept = self._kept[doc]
            positions_kept[rows, :top], mass_kept[rows, :top] = positions[:rows.stop - first], mass[:rows.stop - first]
            self._coverage[doc] += step.sum(dim=0, dtype=torch.float64)
            step.zero_()
            self.positions[doc] += n

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        newest = input_ids[:, -1]  # [rows]
        for doc, token in enumerate(newest.tolist()):
            if token in self.eos:
                self.finished[doc] = True
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def reading(self, doc: int, reader: SummaryReader, ids: Sequence[int]) -> Reading:
        """Document ``doc``'s Reading of its returned sequence ``ids`` (through its end token), as recorded."""
        ids = tuple(int(i) for i in ids)
        steps = len(ids) - 1
        if self._kept[doc] is None:  # nothing retrieved (no cross-attention layer was called)
            positions, mass = torch.zeros(steps, 0, dtype=torch.long), torch.zeros(steps, 0)
            coverage = torch.zeros(self.sizes[doc])
        else:
            positions, mass = (part[:steps].cpu() for part in self._kept[doc])
            coverage = self._coverage[doc].float().cpu()
        token_mass = evidence.TokenMass(torch.cat([torch.zeros_like(positions[:1]), positions]),
                                        torch.cat([torch.zeros_like(mass[:1]), mass]))
        return Reading(ids, token_mass, coverage, _Prefixes(reader, self.cache, {}, row=doc))


class _Prefixes:
    """The decoder's self-attention state after the summary's first P positions, as the first reading left it:
    the leading P keys and values of its cache (``row``: of that batch row), or (Tensor Cache) the layers'
    states kept at P."""

    def __init__(self, reader: SummaryReader, cache, snapshots: dict, row: int | None = None):
        self.reader, self.cache, self.snapshots, self.row = reader, cache, snapshots, row

    def at(self, length: int, copies: int = 1):
        """The state after ``length`` positions (``copies`` rows of it: a plain cache only)."""
        if self.cache is not None:
            return compat.self_attention_prefix(self.cache, length, self.row, copies)
        if length == 0:
            return self.reader._new_cache()
        if length not in self.snapshots:
            raise ValueError(f"the reading kept no Tensor Cache state at position {length}")
        fresh = self.reader._new_cache()
        _tensor_cache_of(fresh).restore(self.snapshots[length])
        return fresh


class _DeferredHead(nn.Module):
    """In the model's output projection's place for the support readings: keeps the hidden states it is given and
    returns zero logits, so that what the model adds after it (BART's final_logits_bias) is all its output holds;
    ``log_probs`` then takes the projection of every kept reading's rows at once and adds that back, as the model
    would (x + (0 + bias) is x + bias)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.__dict__["head"] = head  # not a child: the model's modules are unchanged but for this one's place
        self.vocabulary = head.weight.shape[0]
        self._hidden: list[torch.Tensor] = []  # [rows, L, d] per forward, in order
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the model's logits [rows, L, V], targets [L])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self._hidden.append(hidden)
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], self.vocabulary)

    def keep(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """The model's output of the last forward (zero logits plus what it added) and the tokens it predicts."""
        if len(self._hidden) != len(self._kept) + 1:
            raise RuntimeError("the output projection was not called once by the last forward")
        self._kept.append((logits, targets))

    def log_probs(self) -> list[tuple[torch.Tensor, ...]]:
        """Every kept reading's log p(target), one [L] float32 CPU tensor a row, in order; forgets them.

        Row r of every reading goes into a product of its own: [sum of L, d] for each r, so that the rows of a
        pair meet the BLAS at the same places of equal products (a BLAS computes a row in one place of a product
        and an equal row in another to different roundings: MKL here, for 6 and 10 rows)."""
        rows = self._hidden[0].shape[0]
        logits = [self.head(torch.cat([hidden[row] for hidden in self._hidden])) for row in range(rows)]  # [ΣL, V]
        found, at = [], 0
        for hidden, (added, targets) in zip(self._hidden, self._kept):
            length = hidden.shape[1]
            found.append(tuple(_token_log_probs(logits[row][at:at + length].add_(added[row]), targets).cpu()
                               for row in range(rows)))
            at += length
        self._hidden, self._kept = [], []
        return found


@contextmanager
def _deferred_head(model: nn.Module) -> Iterator[_DeferredHead]:
    """The model with a _DeferredHead in its output projection's place, the projection put back on exit."""
    head = model.get_output_embeddings()
    located = projections.locate(model, head)
    if located is None:
        raise RuntimeError("the model's output projection is not one of its modules")
    parent, attribute = located
    deferred = _DeferredHead(head)
    setattr(parent, attribute, deferred)
    try:
        yield deferred
    finally:
        setattr(parent, attribute, head)


def _tensor_cache_of(cache):
    from unlimisum.tensor_cache.cache import find_tensor_cache

    return find_tensor_cache(cache)


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [n, V], targets [n] -> log p(target) [n] float32."""
    logits = logits.float()
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)


def hidden_tokens(sources: Sequence[evidence.Source], n_tokens: int, offset: int = 0,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """[n_tokens] bool: the tokens of ``sources`` (document positions, less ``offset`` for a chapter's view)."""
    hidden = torch.zeros(n_tokens, dtype=torch.bool, device=device)
    for source in sources:
        a, b = max(0, source.start_token - offset), min(n_tokens, source.end_token - offset)
        if b > a:
            hidden[a:b] = True
    return hidden


def support_of(reader: SummaryReader, reading: Reading, store: Datastore, rows: list[int],
               sources: Sequence[evidence.Source], offset: int = 0, removal=None) -> float | None:
    """A sentence's support: the mean drop, in nats, of log p(token) over its summary tokens ``rows`` (indices
    into ``reading.ids``) when its passages ``sources`` are hidden, against the same reading with nothing hidden
    (``SummaryReader.log_probs`` twice, only the mask told apart); None when it has none (no passages, or a
    sentence of the start token alone). ``removal`` (a removal.StoreRemoval of the store): the passages also
    taken out of the input, the windows that held them encoded again, for the second reading."""
    return supports_of(reader, reading, store, [(rows, sources)], offset, removal)[0]


def supports_of(reader: SummaryReader, reading: Reading, store: Datastore,
                sentences: Sequence[tuple[list[int], Sequence[evidence.Source]]], offset: int = 0, removal=None,
                on_measured: Callable[[int], None] | None = None) -> list[float | None]:
    """``support_of`` of each (rows, sources) of ``sentences``, in order: hidden from retrieval, the output
    projection of several sentences' readings taken at once (``SummaryReader.log_probs_pairs``); by
    removal, one after the other. ``on_measured(done)`` as sentences that have passages are measured."""
    found: list[float | None] = [None] * len(sentences)
    spans = []  # (index, rows, hidden) of each sentence that has passages
    for index, (rows, sources) in enumerate(sentences):
        rows = [j for j in rows if j >= 1]
        if rows and sources:
            spans.append((index, rows, hidden_tokens(sources, store.n_tokens, offset)))
    if removal is not None:
        for done, (index, rows, hidden) in enumerate(spans, 1):
            found[index] = support_hiding(reader, reading, store, rows, hidden, removal)
            if on_measured is not None:
                on_measured(done)
        return found
    pairs = reader.log_probs_pairs(reading, store, [(min(rows), max(rows) + 1, hidden) for _, rows, hidden in spans],
                                   on_read=on_measured)
    for (index, rows, _), (kept, masked) in zip(spans, pairs):
        found[index] = _drop(rows, kept, masked)
    return found


def support_hiding(reader: SummaryReader, reading: Reading, store: Datastore, rows: list[int], hidden: torch.Tensor,
                   removal=None) -> float:
    """``support_of`` for the tokens ``hidden`` ([N] bool over the store) rather than a sentence's passages (a
    control hides random ones); ``rows`` nonempty, every one at least 1."""
    first, last = min(rows), max(rows) + 1
    if removal is None:
        kept, masked = reader.log_probs_both(reading, store, first, last, hidden)
    else:  # the second reading's store is changed for it: one after the other
        with store.unpacked():  # its packed copies would not follow the states
            kept = reader.log_probs(reading, store, first, last, torch.zeros_like(hidden))
            with removal.removed(hidden):
                masked = reader.log_probs(reading, store, first, last, hidden)
    return _drop(rows, kept, masked)


def _drop(rows: list[int], kept: torch.Tensor, masked: torch.Tensor) -> float:
    """The mean of kept - masked (log p of tokens min(rows) .. max(rows)) over ``rows``."""
    chosen = torch.tensor(rows) - min(rows)
    return float((kept[chosen] - masked[chosen]).mean())
