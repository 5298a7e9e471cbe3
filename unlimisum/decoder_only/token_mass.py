"""TokenMassRecorder: per token after the prompt, the prompt positions its attention went to, over all layers.

The cache's full layers hand it each query's attention per prompt position (RetrievalCache.set_evidence),
one call per layer and forward: while generate() writes one token per forward (greedy search or sampling,
one row), or while the reread pass reads the returned summary after beam search. Rows are the tokens after
the stored prompt: row t is the position that wrote summary token t. A forward's rows are summed densely
over its layers (``[C, N]`` float32, bounded by the reread's chunk), then only their top positions are kept.
"""

from __future__ import annotations

import torch

from unlimisum.evidence import TokenMass

TOP_POSITIONS = 64  # prompt positions kept per summary token (the rest of its mass counts in coverage only)
DENSE_BYTES = 64 * 2**20  # the bound on one forward's dense mass [C, N]: the reread reads that many rows at once


def rows_per_forward(n_prompt: int, most: int) -> int:
    """Rows one forward may bring so that its dense mass [rows, n_prompt] stays within DENSE_BYTES."""
    return max(1, min(most, DENSE_BYTES // (4 * max(1, n_prompt))))


class TokenMassRecorder:
    """The top prompt positions of every row, and the coverage of all of them (every recorded row counts)."""

    def __init__(self, n_prompt: int, top: int = TOP_POSITIONS):
        self.n_prompt = n_prompt  # stored prompt tokens: the positions mass may fall on
        self.top = min(top, n_prompt)
        self._open: tuple[int, torch.Tensor] | None = None  # (first row, [C, N] mass) of the forward under way
        self._rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (first row, positions, mass [C, top])
        self._coverage = torch.zeros(n_prompt, dtype=torch.float64)

    def add(self, first: int, positions: torch.Tensor, mass: torch.Tensor) -> None:
        """One full layer's attention for rows ``first`` .. ``first + C - 1``: positions and mass [C, M]."""
        if self._open is None or self._open[0] != first:
            self._close()
            self._open = (first, torch.zeros(positions.shape[0], self.n_prompt, device=positions.device))
        self._open[1].scatter_add_(1, positions, mass.float())  # repeated positions (KV heads) add up

    def _close(self) -> None:
        if self._open is None:
            return
        first, dense = self._open
        self._coverage += dense.sum(dim=0).double().cpu()
        mass, positions = dense.topk(self.top, dim=1)
        self._rows.append((first, positions.cpu(), mass.cpu()))
        self._open = None

    def results(self, rows: int) -> tuple[torch.Tensor, TokenMass]:
        """(coverage [n_prompt] float32, TokenMass [rows, top] of rows 0 .. rows - 1), on the CPU."""
        self._close()
        blocks = sorted(self._rows, key=lambda block: block[0])
        positions = torch.cat([block[1] for block in blocks]) if blocks else torch.zeros(0, self.top, dtype=torch.long)
        mass = torch.cat([block[2] for block in blocks]) if blocks else torch.zeros(0, self.top)
        # generate() runs one forward per summary token; rows past the summary would not be its, missing rows
        # (none are) would have no mass
        missing = max(0, rows - positions.shape[0])
        positions = torch.cat([positions[:rows], positions.new_zeros(missing, self.top)])
        mass = torch.cat([mass[:rows], mass.new_zeros(missing, self.top)])
        return self._coverage.float(), TokenMass(positions, mass)
