"""What a batch run tells whoever watches it: the ``Reporter`` protocol the runner calls, and a silent one.

The runner (``unlimisum.runs.runner``) reads, summarizes and writes; it says what happens through a
reporter: the library's ``ProgressEvent``s (it is the Summarizer's progress callback too), the
stages a batch adds (reading inputs, loading the model), each document's outcome, notes and logs.
The CLI's reporter draws all of it with Rich on stderr (``unlimisum.cli.progress.ProgressDisplay``);
``SilentReporter`` keeps the notes and drops the rest (Ray workers, tests, Python callers).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    from unlimisum.events import ProgressEvent
    from unlimisum.results import Summary


class Reporter(Protocol):
    """What the runner reports; every method returns at once (drawing is the reporter's business)."""

    verbose: int  # 0: outcomes and notes; 1: also log lines; 2: also tracebacks of unexpected errors

    def __call__(self, event: ProgressEvent) -> None:
        """A library progress event (the Summarizer's and the model loader's callback)."""

    def reading_stdin_hint(self) -> None:
        """Standard input is a terminal: it is being read, and how to end it should be said."""

    def reading_input(self, number: int, total: int, source: str) -> None:
        """The ``number``-th of ``total`` inputs is being read, before the model loads."""

    def loading_model(self, name: str) -> None:
        """The model ``name`` is being loaded."""

    def model_loaded(self, name: str, device: str, dtype: str, seconds: float) -> None:
        """It is loaded, on ``device`` ("cpu", "cuda:0"), in ``dtype`` (with why, for --dtype auto)."""

    def begin_document(self, number: int, total: int, source: str, *, read: bool = False) -> None:
        """The ``number``-th of ``total`` inputs to summarize begins (``read``: it was read ahead)."""

    def document_done(self, summary: Summary, source: str, seconds: float, output=None) -> None:
        """``source`` was summarized in ``seconds`` (written to ``output``, when not on stdout)."""

    def document_failed(self, source: str, problem: str) -> None:
        """``source`` could not be summarized: ``problem`` is one line."""

    def document_skipped(self, source: str, output) -> None:
        """``source``'s summary ``output`` exists and unlimisum wrote it (--skip-existing)."""

    def note(self, message: str) -> None:
        """A line for the user that is neither an error nor a log (a warning, a choice made)."""

    def log(self, message: str) -> None:
        """A log line (shown with -v)."""

    def traceback(self, text: str) -> None:
        """The traceback of an unexpected error (shown with -vv)."""

    def paused(self):
        """A context manager: within it nothing is drawn, so what goes to stdout is not drawn over."""

    def batch(self, total: int) -> "BatchReport":
        """A distributed batch of ``total`` documents begins (the Ray engine): its counts, as a context manager."""


class BatchReport(Protocol):
    """The counts of a distributed batch; ``update()`` after each change, ``paused()`` around stdout writes."""

    done: int
    failed: int
    running: int
    tokens: int  # input tokens of the documents done

    def update(self) -> None:
        """The counts changed."""

    def paused(self):
        """A context manager: nothing drawn within it."""


class SilentReporter:
    """A reporter that draws nothing: it keeps the notes (``notes``) for a caller to pass on, and drops the rest."""

    verbose = 0

    def __init__(self):
        self.notes: list[str] = []

    def __call__(self, event) -> None:
        pass

    def reading_stdin_hint(self) -> None:
        pass

    def reading_input(self, number, total, source) -> None:
        pass

    def loading_model(self, name) -> None:
        pass

    def model_loaded(self, name, device, dtype, seconds) -> None:
        pass

    def begin_document(self, number, total, source, *, read=False) -> None:
        pass

    def document_done(self, summary, source, seconds, output=None) -> None:
        pass

    def document_failed(self, source, problem) -> None:
        pass

    def document_skipped(self, source, output) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)

    def take(self) -> list[str]:
        """The notes kept since the last call (a Ray worker sends them to the driver with each book)."""
        notes, self.notes = self.notes, []
        return notes

    def log(self, message: str) -> None:
        pass

    def traceback(self, text: str) -> None:
        pass

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def batch(self, total: int) -> "SilentBatch":
        return SilentBatch()


class SilentBatch:
    """A distributed batch's counts, kept and never drawn."""

    def __init__(self):
        self.done = self.failed = self.running = self.tokens = 0

    def __enter__(self) -> "SilentBatch":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def update(self) -> None:
        pass

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield
