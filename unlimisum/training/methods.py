"""Which attention a training batch of each method uses.

- ``truncated`` and ``chunked`` train the unmodified model (their difference is in the data,
  unlimisum/training/data.py): no training-time attention, None here;
- ``random-encoded``: every batch attends to random states; ``retrieval``: to the top-k;
- ``alternating``: batches alternate, random-encoded first (paper section 3.2).
"""

from __future__ import annotations

from unlimisum.training.config import METHODS


def attention_mode(method: str, batch_index: int) -> str | None:
    """"random", "retrieval" or None (the model's own attention) for batch ``batch_index`` (from 0)."""
    if method not in METHODS:
        raise ValueError(f"unknown training method '{method}'")
    if method == "random-encoded":
        return "random"
    if method == "retrieval":
        return "retrieval"
    if method == "alternating":
        return "random" if batch_index % 2 == 0 else "retrieval"
    return None
