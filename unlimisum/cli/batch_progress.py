"""The driver's progress display for a distributed batch (``--engine ray``).

When stderr is a terminal, one live row: documents finished of those to summarize, how many
workers are busy, how many inputs failed, input tokens per second across all workers, and the
ETA (the average time per finished document so far, spread over the workers). Otherwise
nothing live: the per-document lines of ``ProgressDisplay`` (done / failed / skipped) are the
record, one per document, as in a local run.
"""

from __future__ import annotations

import time
from typing import Callable

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from unlimisum.cli.live import DrawnOnLiveArea, LiveArea, format_seconds


class BatchProgress(DrawnOnLiveArea):
    """Counts of a batch and their live row; ``update`` after every change, ``paused`` around stdout writes."""

    def __init__(self, display, total: int, *, clock: Callable[[], float] = time.monotonic):
        self.display = display  # the run's ProgressDisplay: its console, and whether it draws live
        self.total = total  # documents to summarize (the skipped and those failed before reading aside)
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.failed = 0
        self.running = 0
        self.tokens = 0  # input tokens of the documents done
        self._progress = Progress(
            SpinnerColumn(), TextColumn("documents"), BarColumn(bar_width=30), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
            console=display.console, disable=True,  # drawn by the LiveArea
        )
        self._area = LiveArea(display.console, self._progress.get_renderable, enabled=display.live)
        self._task = self._progress.add_task("documents", total=total, status="starting workers")

    def status(self) -> str:
        """``2 running · 1 failed · 1,234 tokens/s · ETA 2m05s`` (parts shown when they mean something)."""
        elapsed = self.clock() - self.started
        finished = self.done + self.failed
        parts = [f"{self.running} running"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.tokens and elapsed > 0:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        if finished and finished < self.total:
            parts.append(f"ETA {format_seconds(elapsed / finished * (self.total - finished))}")
        return " · ".join(parts)

    def update(self) -> None:
        """Redraw the row from the counts."""
        self._progress.update(self._task, completed=self.done + self.failed, status=self.status())
