"""Support by removal: a sentence's passages taken out of the input itself, and every window that held them
encoded again without them, for one reading of the sentence.

Support by hiding (unlimisum/unlimiformer/reread.py) keeps the passages' tokens out of retrieval, but the states
of the tokens around them were encoded with the passages in their window, and may carry what they said (an
encoder mixes a window's tokens; ContextCite's ablation removes a source from the context the model reads).
Here, for the reading of one sentence: each window whose encoded span holds a passage token is encoded again
with those tokens taken out, the states it keeps (and, with per-layer keys, their keys and values) are put in
the store in place of the originals, and the passage tokens themselves are hidden; after the reading everything
is put back. Nothing removed leaves the store as it is, so the two readings are then the same computation.

What it costs: one encoder pass per window that held a passage token (with the default overlap a passage of a
few dozen tokens lies in two or three windows), for each sentence, against none for hiding.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from unlimisum.search.keys import project, projection_dtype
from unlimisum.unlimiformer.encoding import WindowPlan


class StoreRemoval:
    """``removed(hidden)``: within the block, the store holds what the input without the ``hidden`` tokens would
    have given in every window that held one. ``encode(ids [n]) -> states [n, d]`` encodes one window as the
    document was encoded; ``token_ids`` [N] and ``plan`` are the document's; the store is the document's own
    (a chapter's view shares its memory: ``offset`` is the view's first token in the document). ``projections``:
    the decoder layers' key (and value) projection weights, [H, dh, d] per layer (keys.key_weights and
    value_weights), for a store with per-layer keys (and values)."""

    def __init__(self, store, token_ids: torch.Tensor, plan: WindowPlan,
                 encode: Callable[[torch.Tensor], torch.Tensor], offset: int = 0,
                 projections: dict[str, list[torch.Tensor]] | None = None):
        if plan.n_tokens != len(token_ids):
            raise ValueError(f"the window plan covers {plan.n_tokens:,} tokens, the document has {len(token_ids):,}")
        if store.keys is not None and not (projections or {}).get("keys"):
            raise ValueError("a store with per-layer keys needs their projections to have them made again")
        self.store, self.token_ids, self.plan, self.encode, self.offset = store, token_ids, plan, encode, offset
        self.projections = projections or {}

    def windows_holding(self, hidden: torch.Tensor) -> list[int]:
        """The windows whose encoded span holds a token of ``hidden`` ([n] bool over the store's tokens)."""
        positions = hidden.nonzero().squeeze(1) + self.offset  # in the document
        if positions.numel() == 0:
            return []
        first, last = int(positions.min()), int(positions.max())
        found = []
        for index, start in enumerate(self.plan.starts):
            end = start + self.plan.length(index)
            if end <= first or start > last:
                continue
            if bool(((positions >= start) & (positions < end)).any()):
                found.append(index)
        return found

    @contextmanager
    def removed(self, hidden: torch.Tensor) -> Iterator[int]:
        """Within the block, the store as the input without the ``hidden`` tokens gives it (see the class); yields
        how many windows were encoded again. The hidden tokens stay in the store: the reading hides them."""
        states = self.store.states()  # [n, d] (a view's rows of the document's store)
        keys = self.store.keys
        n = states.shape[0]
        kept_positions, new_states = [], []
        hidden_document = torch.zeros(len(self.token_ids), dtype=torch.bool)
        hidden_document[self.offset:self.offset + n] = hidden.cpu()
        windows = self.windows_holding(hidden.cpu())
        for index in windows:
            start, length = self.plan.starts[index], self.plan.length(index)
            keep = ~hidden_document[start:start + length]  # [length]
            if not bool(keep.any()):  # every token of the window removed: none of its states is read
                continue
            states_of_window = self.encode(self.token_ids[start:start + length][keep])  # [kept, d]
            kept_from, kept_to = self.plan.kept(index)
            positions = torch.arange(start, start + length)[keep]  # document positions of the encoded tokens
            mine = (positions >= max(kept_from, self.offset)) & (positions < min(kept_to, self.offset + n))
            kept_positions.append(positions[mine] - self.offset)
            new_states.append(states_of_window[mine.to(states_of_window.device)])
        if not kept_positions:
            yield 0
            return
        rows = torch.cat(kept_positions).to(states.device)  # [m] store positions whose states change
        replaced = torch.cat(new_states).to(states.device, states.dtype)  # [m, d]
        saved_states = states[rows].clone()
        saved_keys = saved_values = None
        if keys is not None:
            saved_keys = keys.keys[:, :, rows].clone()  # [L, H, m, dh]
            saved_values = keys.values[:, :, rows].clone() if keys.values is not None else None
        try:
            states[rows] = replaced
            if keys is not None:
                _project_into(keys, rows, replaced, self.projections)
            yield len(kept_positions)
        finally:
            states[rows] = saved_states
            if keys is not None:
                keys.keys[:, :, rows] = saved_keys
                if saved_values is not None:
                    keys.values[:, :, rows] = saved_values


def _project_into(keys, rows: torch.Tensor, states: torch.Tensor, projections: dict) -> None:
    """The per-layer keys (and values) of ``states`` [m, d] (as stored), written at ``rows`` of ``keys``: the same
    projection KeyStoreBuilder makes while encoding (keys.project, in keys.projection_dtype, rounded to the keys'
    dtype)."""
    for output, weights in ((keys.keys, projections.get("keys")), (keys.values, projections.get("values"))):
        if output is None or weights is None:
            continue
        layers, heads, _, head_dim = output.shape
        dtype = projection_dtype(weights, output.dtype, output.device)
        for layer in range(layers):
            projected = project(states, weights[layer].reshape(heads * head_dim, -1), dtype)
            output[layer, :, rows] = projected.view(-1, heads, head_dim).transpose(0, 1).to(output.dtype)
