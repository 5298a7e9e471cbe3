"""Progress, memory and per-document results on stderr, drawn with Rich.

``ProgressDisplay`` is the library's progress callback (it takes ``ProgressEvent``s) plus the
CLI's own stages (loading the model, reading a file). It draws a live display only when
stderr is a terminal; otherwise, and always with ``show=False`` (``--quiet``), it stays
silent except for errors. The console, the clock and the memory probe are passed in, so
tests can render it into a string with a fake clock.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable, Iterable

from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.markup import escape as _markup_escape
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

from unlimisum.cli.batch_progress import BatchProgress
from unlimisum.cli.live import DrawnOnLiveArea, LiveArea, format_seconds
from unlimisum.visible import visible

if TYPE_CHECKING:  # results imports torch; keep `unlimisum --help` and completion fast
    from unlimisum.events import ProgressEvent
    from unlimisum.results import Summary

# the stages' labels, each within LABEL_CELLS: whole beside the bar, the counts and "about 24.4 s left" in an
# 80-column terminal (the scrollback's lines say more)
COMPILE_STAGE = "compiling kernels (once per machine)"
EVIDENCE_STAGE = "finding evidence (summary read again)"
CACHE_STAGE = "looking for the book in the cache"
PREPARE_STAGE = "preparing retrieval"


def support_stage(sentences: int) -> str:
    """The support stage's label: ``sentences`` read again, each without its passages."""
    return f"measuring support of {sentences:,} sentence{'s' if sentences != 1 else ''}"


MEMORY_SAMPLE_SECONDS = 0.25  # how often the live display reads RSS/GPU memory (psutil is cheap, not free)
CHAPTER_TITLE_CELLS = 40  # chapter titles are cut to this many characters in the live display
# The live rows at the console's width: the bar is 30 cells when the label keeps LABEL_CELLS beside it,
# narrower (down to 10) before the label is cut; counts, rate and clock are never cut.
MAX_BAR_CELLS = 30
MIN_BAR_CELLS = 10
COVERAGE_BAR_CELLS = 48  # the widest the bar of where a summary looked is drawn (its terminal permitting)
LABEL_CELLS = 40
MIN_LABEL_CELLS = 12


def escape(text: str) -> str:
    """A string for a Rich markup line: its control characters shown as symbols (unlimisum/visible.py) and its
    own brackets escaped, so that a book's title or passage is never a terminal sequence nor Rich markup."""
    return _markup_escape(visible(text))


def make_stderr_console() -> Console:
    """The console for everything that is not a summary: stderr, colour off under NO_COLOR."""
    return Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")), highlight=False)


def format_bytes(count: int | None) -> str:
    """``1536`` -> ``1.5 KiB``; binary units, one decimal from KiB on."""
    if count is None:
        return "n/a"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def store_figure(store_bytes: int, packed_bytes: int = 0, key_store_bytes: int = 0,
                 key_store_values: bool = False) -> str:
    """``1.3 MiB``, or ``1.3 MiB + 3.5 MiB packed copies``, or ``1.3 MiB + 7.9 MiB per-layer keys`` (``... keys
    and values``): the encoded input's store, and beside it the packed retrieval kernel's copies of it or the key
    store per decoder layer."""
    figure = format_bytes(store_bytes)
    if packed_bytes:
        figure += f" + {format_bytes(packed_bytes)} packed copies"
    if key_store_bytes:
        figure += f" + {format_bytes(key_store_bytes)} per-layer keys" + (" and values" if key_store_values else "")
    return figure


class MemoryProbe:
    """Live memory of this process: resident set size (psutil) and CUDA memory when on CUDA."""

    def __init__(self, cuda_device=None):
        import psutil

        self._process = psutil.Process()
        self.cuda_device = cuda_device  # a torch.device of type cuda, or None

    def rss(self) -> int:
        return self._process.memory_info().rss

    def gpu(self) -> int | None:
        if self.cuda_device is None:
            return None
        import torch

        return torch.cuda.memory_allocated(self.cuda_device)


class _CountColumn(ProgressColumn):
    """``completed/total`` for stages that count (windows, tokens); blank for the others."""

    def render(self, task: Task) -> Text:
        if not task.fields.get("counted"):
            return Text("")
        total = "?" if task.total is None else f"{int(task.total):,}"
        return Text(f"{int(task.completed):,}/{total}")


class _StatusProgress(Progress):
    """Rich Progress with a status line (document, memory, datastore) under the task rows, laid out for the
    console's width: the description is cut (with an ellipsis) before the bar narrows, and the bar before
    the counts, rate and clock, which are never cut. It never draws itself: a ``LiveArea`` draws it."""

    def __init__(self, *, status: Callable[[], RenderableType], console: Console, **options):
        self._status = status  # before super().__init__, which renders once
        self._width_of = console  # the console whose width the rows fit (super() keeps it on its own Live)
        self._bar = BarColumn(bar_width=MAX_BAR_CELLS)
        super().__init__(
            SpinnerColumn(),
            # descriptions name chapters and books: plain text, never markup (they are made ``visible`` first)
            TextColumn("{task.description}", markup=False, table_column=Column(no_wrap=True, overflow="ellipsis")),
            self._bar,
            _CountColumn(table_column=Column(no_wrap=True, justify="right")),
            TextColumn("{task.fields[rate]}", table_column=Column(no_wrap=True)),
            TimeElapsedColumn(table_column=Column(no_wrap=True)),
            console=console, disable=True, **options,
        )

    def make_tasks_table(self, tasks: Iterable[Task]) -> Table:
        tasks = [task for task in tasks if task.visible]
        width = self._width_of.width
        fixed = sum(max((cell_len(str(column.render(task))) for task in tasks), default=0)
                    for column in (self.columns[0], self.columns[3], self.columns[4], self.columns[5]))
        room = width - fixed - (len(self.columns) - 1)  # one cell between columns
        self._bar.bar_width = max(MIN_BAR_CELLS, min(MAX_BAR_CELLS, room - LABEL_CELLS))
        table = super().make_tasks_table(tasks)
        table.columns[1].max_width = max(MIN_LABEL_CELLS, room - self._bar.bar_width)
        return table

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        status = self._status()
        if isinstance(status, Text):
            status.no_wrap, status.overflow = True, "ellipsis"
        yield status


class ProgressDisplay(DrawnOnLiveArea):
    """Renders a summarize run on a Rich console; call it with ``ProgressEvent``s. It is the CLI's
    ``unlimisum.runs.report.Reporter``: the batch runner reports through it.

    ``show``: False for --quiet (only errors are printed). ``live``: draw the animated
    display; None decides by ``console.is_terminal``. ``verbose``: also print a log line
    per stage. Use as a context manager around the run.
    """

    def __init__(
        self,
        console: Console,
        *,
        show: bool = True,
        live: bool | None = None,
        verbose: int = 0,
        clock: Callable[[], float] = time.monotonic,
        memory: MemoryProbe | None = None,
        auto_refresh: bool = True,
        evidence: bool = False,
    ):
        self.console = console
        self.show = show
        self.evidence = evidence  # --evidence: in a terminal, each sentence with its passages after the done line
        self.live = show and (console.is_terminal if live is None else live)
        self.verbose = verbose if show else 0
        self.clock = clock
        self.memory = memory
        self._started = clock()
        self._document = ""
        self._document_number = ""
        self._datastore_bytes: int | None = None
        self._packed_bytes = 0  # the packed kernel's copies beside the store, once made
        self._rss: int | None = None
        self._gpu: int | None = None
        self._memory_sampled_at = float("-inf")
        self._stage_started = self._started
        self._stage_units = ""
        self._stage_total: int | None = None
        self._stage_description = ""
        self._evidence_started = self._started
        self._tokens = 0
        self._progress = _StatusProgress(status=self._status_line, console=console, get_time=clock)
        self._area = LiveArea(console, self._progress.get_renderable, enabled=self.live, auto_refresh=auto_refresh)
        # --per-chapter: which chapter, and a bar over the book's chapters (above the stage, shown when needed)
        self._book_task = self._progress.add_task("", total=None, rate="", counted=True, visible=False)
        self._book = _ChapterProgress()
        self._task = self._progress.add_task("starting", total=None, rate="", counted=False)

    # -- context ---------------------------------------------------------------------------


    def refresh(self) -> None:
        """Redraw now (the display also redraws by itself when ``auto_refresh``)."""
        self._area.refresh()

    # -- stages the CLI drives ---------------------------------------------------------------

    def set_memory_probe(self, memory: MemoryProbe) -> None:
        """Use ``memory`` from now on (once the model's device is known)."""
        self.memory = memory

    def loading_model(self, name: str) -> None:
        self._stage(f"loading model {name}")
        self.log(f"loading model {name}")

    def model_loaded(self, name: str, device: str, dtype: str, seconds: float) -> None:
        if device.startswith("cuda"):
            import torch

            self.set_memory_probe(MemoryProbe(cuda_device=torch.device(device)))
        elif self.memory is None:
            self.set_memory_probe(MemoryProbe())
        self.log(f"model {name} on {device} ({dtype}) loaded in {format_seconds(seconds)}")

    def begin_document(self, number: int, total: int, source: str, *, read: bool = False) -> None:
        """A new input: show its name, and the reading stage unless it was ``read`` ahead."""
        self._end_chapters()
        self._document = _display_name(source)
        self._document_number = f"{number}/{total}" if total > 1 else ""
        self._datastore_bytes = None
        self._packed_bytes = 0
        self._stage("summarizing" if read else "reading")
        self.log(f"summarizing {self._document}" if read else f"reading {self._document}")

    def reading_input(self, number: int, total: int, source: str) -> None:
        """Inputs are read (and checked) before the model loads: the ``number``-th of ``total``."""
        self._document = _display_name(source)
        self._document_number = ""
        if number == 1:
            self._stage("reading inputs", total=total)
        self._progress.update(self._task, completed=number - 1)
        self.log(f"reading {self._document}")

    # -- the library's callback --------------------------------------------------------------

    def __call__(self, event: ProgressEvent) -> None:
        """Take one ``ProgressEvent`` from the Summarizer."""
        handler = getattr(self, f"_on_{event.stage}", None)
        if handler is not None:
            handler(event)
        self._sample_memory()

    def _on_download(self, event: ProgressEvent) -> None:
        """A model's files are fetched from the hub (first use): say so once per repository, then a bar
        over the bytes with the rate and the time left; once they are there, the stage shown before returns."""
        total, done = event.total or 0, event.completed
        state = self.__dict__.setdefault("_download", {"noted": set()})  # this handler's own state
        if "started" not in state:
            if total and done >= total:
                return  # the closing report of a download whose last file already said it was complete
            state.update(started=self.clock(), before=next(
                (task.description for task in self._progress.tasks if task.id == self._task), ""))
            if event.document not in state["noted"]:
                state["noted"].add(event.document)
                self.note(f"unlimisum: first use of {event.document}: downloading it into the Hugging Face cache "
                          "(HF_HOME); later runs read it from there")
            self._progress.reset(self._task, total=total or None, completed=0, description="downloading",
                                 rate="", counted=False)
        elapsed = self.clock() - state["started"]
        rate = done / elapsed if elapsed > 0 else 0.0
        figures = [f"{format_bytes(done)}/{format_bytes(total)}" if total else format_bytes(done)]
        if rate > 0:
            figures.append(f"{format_bytes(int(rate))}/s")
            if total > done:
                figures.append(f"{format_seconds((total - done) / rate)} left")
        self._progress.update(self._task, completed=done, rate=" · ".join(figures))
        if total and done >= total:
            self.log(f"downloaded {event.document}: {format_bytes(total)} in {format_seconds(elapsed)}")
            self._progress.reset(self._task, total=None, completed=0, description=state["before"], rate="",
                                 counted=False)
            del state["started"]

    def _on_cache(self, event: ProgressEvent) -> None:
        if event.completed == 0:
            self._stage(CACHE_STAGE)
        else:
            self._datastore_bytes = event.info.get("bytes")
            self.log(f"encoded book read from the cache: {event.info.get('tokens', 0):,} tokens, no encoding")

    def _on_tokenize(self, event: ProgressEvent) -> None:
        if event.completed == 0:
            self._stage("tokenizing")
            if self._book.active:
                self._show_chapter(self._book.next_chapter(event.document))
        else:
            self.log(f"tokenized: {event.info.get('tokens', 0):,} tokens")

    def _on_encode(self, event: ProgressEvent) -> None:
        self._tokens = int(event.info.get("tokens", 0))
        if event.completed == 0:
            self._stage("encoding windows", total=event.total, units="tokens/s")
            self.log(
                f"encoding {self._tokens:,} tokens in {event.total:,} windows; "
                f"index: {event.info.get('index')} on {event.info.get('index_device')}"
                + (f"; key store: {event.info['key_store_reason']}" if event.info.get("key_store_reason") else "")
            )
            return
        fraction = event.completed / event.total if event.total else 0.0
        self._advance(event.completed, rate_count=self._tokens * fraction)

    def _on_prefill(self, event: ProgressEvent) -> None:
        """A decoder-only model reads its prompt in chunks of its local window."""
        self._tokens = int(event.info.get("tokens", 0))
        if event.completed == 0:
            self._stage("reading the prompt", total=event.total, units="tokens/s")
            self.log(f"reading a prompt of {self._tokens:,} tokens in {event.total:,} chunks of "
                     f"{event.info.get('window', 0):,}")
            return
        fraction = event.completed / event.total if event.total else 0.0
        self._advance(event.completed, rate_count=self._tokens * fraction)

    def _on_index(self, event: ProgressEvent) -> None:
        if event.completed == 0:
            self._stage(f"building the index ({event.info.get('index')} on {event.info.get('index_device')})")
        else:
            self._datastore_bytes = event.info.get("bytes")
            keys = event.info.get("key_store_bytes") or 0
            self.log(f"index built: {store_figure(self._datastore_bytes, 0, keys, event.info.get('key_store_values', False))}")

    def overall(self, description: str, completed: int, total: int) -> None:
        """A row above the stages' (an evaluation's summaries): ``description``, ``completed`` of ``total``."""
        self._progress.update(self._book_task, description=visible(description), total=total, completed=completed,
                              visible=True)
        self.refresh()

    def _on_keys(self, event: ProgressEvent) -> None:
        """A cached book's per-layer keys (and values) projected from its states: tokens done, the time left."""
        if event.completed == 0:
            self._stage("building the per-layer keys", total=event.total, units="tokens/s")
            return
        self._advance(event.completed, rate_count=event.completed)

    def _on_chapter(self, event: ProgressEvent) -> None:
        """Per-chapter summaries: a batch of chapters starts (``completed`` done so far), or all are done."""
        if not self._book.active:  # the book's bar appears, its clock starting now
            self._progress.reset(self._book_task, total=event.total, completed=event.completed, visible=True)
        self._book.start_batch(event.completed, event.total, event.info.get("titles") or [event.document])
        self._progress.update(self._book_task, total=event.total, completed=event.completed)
        if event.completed >= (event.total or 0):
            self._progress.update(self._book_task, description=f"{event.total} chapters summarized")
            self.log(f"{event.total} chapter summaries done")

    def _on_compile(self, event: ProgressEvent) -> None:
        """A first run on this machine waits for the retrieval kernels to compile (most of them were compiled
        while the book was encoded): how many are left, and about how long."""
        left = event.info.get("seconds_left", 0.0)
        if event.completed == 0:
            self._stage(COMPILE_STAGE, total=event.total)
            self.log(f"compiling {event.total} retrieval kernel{'s' if event.total != 1 else ''} for this machine, "
                     f"about {format_seconds(left)} (once: later runs load them)")
        self._progress.update(self._task, completed=event.completed,
                              rate=f"about {format_seconds(left)} left" if left > 0 else "")

    def _on_prepare(self, event: ProgressEvent) -> None:
        if event.completed == 0:
            self._stage(PREPARE_STAGE)
            return
        if event.info.get("bytes"):
            self._datastore_bytes = event.info["bytes"]
        self._packed_bytes = event.info.get("packed_bytes") or 0
        packed = f": packed copies of the store made, {format_bytes(self._packed_bytes)}" if self._packed_bytes else ""
        self.log(f"retrieval prepared in {format_seconds(event.info.get('seconds', 0.0))}{packed}")

    def _on_evidence(self, event: ProgressEvent) -> None:
        """The evidence pass: each summary read again, then each sentence with its passages hidden (``support``
        events in between); a batch's summaries counted, with the time left."""
        if event.completed == 0:
            self._evidence_started = self.clock()
        if event.completed == 0 or self._stage_description != EVIDENCE_STAGE:  # back from the support stage
            self._stage(EVIDENCE_STAGE, total=event.total if (event.total or 0) > 1 else None)
            self._stage_started = self._evidence_started
        if event.completed:
            self._advance(event.completed, rate_count=event.completed)

    def _on_support(self, event: ProgressEvent) -> None:
        """A summary's sentences read again, each without its passages: how many, and the time left."""
        if event.completed == 0:
            self._stage(support_stage(event.total), total=event.total, units="sentences/s")
            return
        self._advance(event.completed, rate_count=event.completed)

    def _on_generate(self, event: ProgressEvent) -> None:
        if event.completed == 0 and self._book.active:
            self._progress.update(self._book_task, description=visible(self._book.generating()))
            self.refresh()
        if event.completed == 0:
            self._stage("generating tokens", total=event.total, units="tokens/s")
            limit = f"up to {event.total:,} tokens" if event.total else "tokens"
            self.log(f"generating {limit} for {event.document}" if event.document else f"generating {limit}")
            return
        self._advance(event.completed, rate_count=event.completed, bound=True)

    # -- results -------------------------------------------------------------------------------

    def document_done(self, summary: Summary, source: str, seconds: float, output=None) -> None:
        """The one-line summary of a finished document (not in quiet mode)."""
        self._end_chapters()
        if not self.show:
            return
        stats = summary.stats
        generate_seconds = stats.timings.get("generate", 0.0)
        rate = f" ({stats.generated_tokens / generate_seconds:,.1f} tokens/s)" if generate_seconds > 0 else ""
        parts = [
            f"{stats.input_tokens:,} tokens in {stats.windows:,} window{'s' if stats.windows != 1 else ''}"
            + (" (encoded book from the cache)" if stats.cached else ""),
            f"{stats.index_kind} index on {stats.index_device} ({store_figure(stats.datastore_bytes, stats.packed_bytes, stats.key_store_bytes, stats.key_store_values)})"
            f", k={stats.retrieval_k}",
            f"{stats.generated_tokens:,} summary tokens{rate}",
        ]
        if stats.tensor_cache_bytes is not None:
            parts.append(f"decoder memory {format_bytes(stats.tensor_cache_bytes)}")
        if summary.chapters:
            parts.append(f"{len(summary.chapters)} chapter summaries")
        parts.append(f"peak RSS {format_bytes(stats.peak_rss_bytes)}")
        if stats.peak_gpu_bytes is not None:
            parts.append(f"peak GPU {format_bytes(stats.peak_gpu_bytes)}")
        parts.append(format_seconds(seconds))
        line = f"[green]done[/] {escape(_display_name(source))}: " + escape(" · ".join(parts))
        if output is not None:
            line += f" -> {escape(str(output))}"
        terminal = self.console.is_terminal  # a terminal's lines broken at spaces, a log's kept whole
        self._area.print(line, soft_wrap=not terminal)
        if terminal and len(summary.coverage) > 1:
            self._area.print(coverage_line(summary, columns=self.console.width), highlight=False)
        if self.console.is_terminal and self.evidence:
            for part in (summary, *summary.chapters):
                for line in evidence_lines(part, heading=part.title if part is not summary else ""):
                    self._area.print(line, highlight=False)  # wrapped by the console at spaces

    def document_skipped(self, source: str, output) -> None:
        """An input whose output exists and was written by unlimisum (--skip-existing)."""
        if self.show:
            self._area.print(
                f"[yellow]skipped[/] {escape(_display_name(source))}: its summary {escape(str(output))} exists",
                soft_wrap=True,
            )

    def own_outputs_skipped(self, paths: list) -> None:
        """Summaries unlimisum wrote, found in folders and not read as inputs: one line."""
        if self.show and paths:
            count = len(paths)
            example = f" (e.g. {paths[0]})" if count > 1 else f": {paths[0]}"
            noun = "summary" if count == 1 else "summaries"
            self._area.print(
                escape(f"unlimisum: not reading {count} {noun} that unlimisum wrote{example}"), soft_wrap=True
            )

    def reading_stdin_hint(self) -> None:
        """Standard input is a terminal: say how to end it, or the run looks frozen."""
        if self.show:
            self._area.print("unlimisum: reading standard input; end with Ctrl-D", soft_wrap=True)

    def document_failed(self, source: str, problem: str) -> None:
        """An input that failed: always printed, even in quiet mode."""
        self._end_chapters()
        self._area.print(f"[red]unlimisum: error:[/] {escape(_display_name(source))}: {escape(problem)}", soft_wrap=True)

    def failure_report(self, failures: list[tuple[str, str]], total: int) -> None:
        """The closing list of failed inputs (always printed)."""
        heading = f"{len(failures)} of {total} inputs failed:"
        if self.console.is_terminal:
            table = Table(title=heading, title_justify="left", show_edge=False, header_style="bold")
            table.add_column("input", overflow="fold")
            table.add_column("problem", overflow="fold")
            for source, problem in failures:
                table.add_row(Text(visible(_display_name(source))), Text(visible(problem)))  # cells: no markup
            self._area.print(table)
            return
        self._area.print(heading, soft_wrap=True)
        for source, problem in failures:
            self._area.print(f"  {escape(_display_name(source))}: {escape(problem)}", soft_wrap=True)

    def log(self, message: str) -> None:
        """A log line (only with -v)."""
        if self.verbose:
            elapsed = self.clock() - self._started
            self._area.print(f"[dim]{elapsed:8.2f}s[/] {escape(message)}", soft_wrap=True)

    def batch(self, total: int):
        """The live row of a distributed batch of ``total`` documents (``--engine ray``)."""
        return BatchProgress(self, total)

    def traceback(self, text: str) -> None:
        """The traceback of an unexpected error (only with -vv)."""
        if self.verbose > 1:
            self._area.print(visible(text), markup=False, soft_wrap=True)

    def note(self, message: str) -> None:
        """A line for the user that is neither an error nor a log (not in quiet mode)."""
        if self.show:
            self._area.print(escape(message), soft_wrap=True)

    # -- internals -------------------------------------------------------------------------------

    def _show_chapter(self, description: str) -> None:
        """Name the chapter being read; redrawn at once, since a chapter may take less than a refresh."""
        self._progress.update(self._book_task, description=visible(description))
        self.log(description)
        self.refresh()

    def _end_chapters(self) -> None:
        """Hide the book's chapter bar (the document is done, failed, or the next one begins)."""
        if self._book.active:
            self._progress.reset(self._book_task, total=None, completed=0, description="", visible=False)
        self._book = _ChapterProgress()

    def _stage(self, description: str, *, total: int | None = None, units: str = "") -> None:
        description = visible(description)
        self._stage_description = description
        self._stage_started = self.clock()
        self._stage_units = units
        self._stage_total = total
        self._progress.reset(
            self._task, total=total, completed=0, description=description, rate="", counted=total is not None
        )

    def _advance(self, completed: int, *, rate_count: float, bound: bool = False) -> None:
        """``completed`` of the stage's total, its rate and the time left at that rate (``bound``: the total is
        a most, as a summary's tokens are: "at most ... left")."""
        elapsed = self.clock() - self._stage_started
        figures = [f"{rate_count / elapsed:,.0f} {self._stage_units}"] if elapsed > 0 and self._stage_units else []
        total = self._stage_total
        if total and 0 < completed < total and elapsed > 0:
            left = format_seconds(elapsed * (total - completed) / completed)
            figures.append(f"at most {left} left" if bound else f"{left} left")
        self._progress.update(self._task, completed=completed, rate=" · ".join(figures))

    def _sample_memory(self) -> None:
        if self.memory is None or not self.live:
            return
        now = self.clock()
        if now - self._memory_sampled_at < MEMORY_SAMPLE_SECONDS:
            return
        self._memory_sampled_at = now
        self._rss = self.memory.rss()
        self._gpu = self.memory.gpu()

    def _status_line(self) -> Text:
        parts = []
        if self._document:
            number = f" ({self._document_number})" if self._document_number else ""
            parts.append(f"{self._document}{number}")
        if self._rss is not None:
            parts.append(f"RSS {format_bytes(self._rss)}")
        if self._gpu is not None:
            parts.append(f"GPU {format_bytes(self._gpu)}")
        if self._datastore_bytes is not None:
            parts.append(f"datastore {store_figure(self._datastore_bytes, self._packed_bytes)}")
        return Text(visible("  " + " · ".join(parts)), style="dim")


class _ChapterProgress:
    """Where a --per-chapter run is: the chapters of the current batch and the next one to be read."""

    def __init__(self):
        self.active = False  # a "chapter" event came for the current document
        self.total = 0
        self.batch_start = 0
        self.titles: list[str] = []
        self.next = 0  # index (in the book) of the next chapter to be read

    def start_batch(self, completed: int, total: int | None, titles: list[str]) -> None:
        self.active = True
        self.total = total or 0
        self.batch_start = self.next = completed
        self.titles = list(titles)

    def next_chapter(self, fallback: str) -> str:
        """``chapter 12/31: Title`` for the chapter whose reading begins, and move on."""
        offset = self.next - self.batch_start
        title = self.titles[offset] if offset < len(self.titles) else fallback
        self.next += 1
        return _chapter_label(self.next, self.total, title)

    def generating(self) -> str:
        """``chapter 12/31: Title``, or ``chapters 9-16/31`` while a batch of chapters (views of the one
        encoded book) is generated together."""
        last = self.batch_start + max(1, len(self.titles))
        if last - self.batch_start == 1:
            return _chapter_label(last, self.total, self.titles[0] if self.titles else "")
        return f"chapters {self.batch_start + 1}-{last}/{self.total}"


def coverage_line(summary: Summary, width: int = COVERAGE_BAR_CELLS, columns: int | None = None) -> Text:
    """``  looked at ▕░▒█▓ ░ ▏ most at "Chapter 5" (62%)``: the summary's attention across the book,
    darker where it looked more, with chapter boundaries ticked underneath in the bar's order. In a terminal
    of ``columns``, the bar (at most ``width`` cells, at least MIN_BAR_CELLS) leaves room for the rest of the
    line where it can; what still does not fit goes on the next line, broken at a space."""
    from unlimisum.coverage import bar

    top = max(summary.coverage, key=lambda span: span.share)
    name = " ".join(top.title.split()) or f"tokens {top.start_token:,}-{top.end_token:,}"
    if len(name) > CHAPTER_TITLE_CELLS:
        name = name[: CHAPTER_TITLE_CELLS - 1] + "\u2026"
    most = visible(f" most at \"{name}\" ({top.share:.0%})")
    label = "  looked at "
    if columns is not None:  # the label and the bar's two ends, then the bar, then what it says
        width = max(MIN_BAR_CELLS, min(width, columns - cell_len(label) - 2 - cell_len(most)))
        width = min(width, max(1, columns - cell_len(label) - 2))
    line = Text(label, style="dim")
    line.append("\u2595" + bar(summary.coverage, width) + "\u258f", style="cyan")
    line.append(most, style="dim")
    return line


EVIDENCE_QUOTE_CELLS = 100  # a passage's quote in the terminal is cut here (the JSON and Markdown keep ~300)
SHARE_CELLS = 12  # a passage's row: its share right-aligned in these cells, then its chapter and quote


def evidence_lines(summary: Summary, heading: str = "") -> list[RenderableType]:
    """``  evidence (Chapter 2)`` then per sentence ``  [1] The sentence.`` (its support when measured,
    ``check first`` when its passages barely carried it) and under it one row per passage shown (at least 1 %
    of the sentence's attention), ``       62%  Loomings  "the quoted passage…"``, strongest first. Each
    wraps at spaces to the console's width, its later lines under its text."""
    from unlimisum.evidence import weakly_supported
    from unlimisum.runs.output import shown_sources, support_note

    if not summary.evidence:
        return []
    title = " ".join(heading.split())
    lines: list[RenderableType] = [Text(visible(f"  evidence ({title})") if title else "  evidence", style="dim")]
    for number, sentence in enumerate(summary.evidence, start=1):
        said = Text(visible(" ".join(sentence.sentence.split())))
        support = support_note(sentence)
        if support:
            said.append(f"  {support}", style="bold yellow" if weakly_supported(sentence) else "dim")
        lines.append(_hanging(Text(f"  [{number}] ", style="dim"), said))
        for source in shown_sources(sentence):
            passage = " ".join(source.quote.split())
            if len(passage) > EVIDENCE_QUOTE_CELLS:  # cut at a space, as the quote itself was
                cut = passage[: EVIDENCE_QUOTE_CELLS - 1]
                space = cut.rfind(" ")
                passage = (cut[:space] if space > EVIDENCE_QUOTE_CELLS // 2 else cut).rstrip() + "\u2026"
            chapter = " ".join(source.chapter.split()) or f"Part {source.chapter_index + 1}"
            if len(chapter) > CHAPTER_TITLE_CELLS:
                chapter = chapter[: CHAPTER_TITLE_CELLS - 1] + "\u2026"
            line = Text(visible(chapter), style="bold")
            line.append(visible(f"  \u201c{passage}\u201d"), style="dim")
            lines.append(_hanging(Text(f"{source.share:.0%}  ".rjust(SHARE_CELLS), style="cyan"), line))
    return lines


def _hanging(label: Text, body: Text) -> Table:
    """``label`` then ``body``, wrapped at spaces to the console's width with its later lines under its first
    character (a grid of two columns: Rich wraps a cell's text at word boundaries)."""
    grid = Table.grid()
    grid.add_column(width=cell_len(label.plain), no_wrap=True)
    grid.add_column(overflow="fold")  # a word wider than the whole line is folded: nothing else is
    grid.add_row(label, body)
    return grid


def _chapter_label(number: int, total: int, title: str) -> str:
    title = " ".join(title.split())
    if len(title) > CHAPTER_TITLE_CELLS:
        title = title[: CHAPTER_TITLE_CELLS - 1] + "\u2026"
    return f"chapter {number}/{total}: {title}" if title else f"chapter {number}/{total}"


def _display_name(source: str) -> str:
    return "standard input" if source == "-" else source
