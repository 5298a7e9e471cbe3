"""The Ray engine (``summarize --engine ray``): a batch of books spread over the workers of a Ray cluster.

How it runs:

- The driver (the `unlimisum` process) plans and checks the inputs exactly as a local run
  does (``unlimisum.runs.jobs``): unusable inputs get their failure line and skipped ones
  their line before Ray starts, and Ray is not started at all when nothing is left to do.
- Each worker is a Ray actor holding one loaded model (a GPU each with ``--gpus-per-worker``,
  CPU otherwise). It runs in the driver's working directory, reads its input from the path
  and writes its output itself, atomically (temporary file + rename), with the same names and
  markers as a local run: it calls the local engine's own ``BatchRunner.summarize_job``.
  Paths must therefore be on storage every node mounts at the same place.
- The driver hands one book at a time to each idle worker (bounded scheduling: never more
  books in flight than workers), prints the done / failed line of each book as it ends, and
  what goes to stdout (``--json`` lines or Markdown, without ``-o``) in input order.
- A worker that dies mid-book (killed actor, lost node) is replaced and its book handed to
  another worker, at most ``RaySettings.max_retries`` more times; the half-written temporary
  file it may leave is removed, so an output is whole or absent. Ctrl-C kills the workers,
  removes their temporary files and ends the run (exit 130); ``--skip-existing`` resumes.

Why Ray core actors rather than Ray Data: a book is one heavy item (minutes of CPU, seconds of
GPU), not a row of a dataset, and the run needs per-book control that Ray Data's streaming
``map_batches`` does not give: a book retried on another actor when its worker dies, with a
bound the user sees; one failure line per bad book while the batch goes on; summaries printed
in input order; outputs written as files by the worker that made them rather than a dataset to
materialize; Ctrl-C that kills the workers and cleans up. Ray core alone also keeps the extra
small (Ray Data brings pyarrow and pandas).
"""

from __future__ import annotations

import io
import logging
import os
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from unlimisum.runs import require_ray
from unlimisum.engines.progress import BatchProgress
from unlimisum.errors import UnlimisumError

CRASH_HOOK_ENV = "UNLIMISUM_RAY_TEST_CRASH"  # tests only: "SOURCE::TOKEN_FILE", see CrashHook
WAIT_SECONDS = 0.5  # how often the driver wakes to redraw the progress while books run
KILL_WAIT_SECONDS = 10.0  # how long Ctrl-C waits for killed workers to be gone before cleaning up


class SharedStorageError(UnlimisumError):
    """A worker cannot see the driver's working directory: inputs and outputs are not on shared storage."""


@dataclass(frozen=True)
class RaySettings:
    """Where and how wide a Ray run goes."""

    address: str | None = None  # None: a local Ray instance for the run (or the one this process already has)
    workers: int | None = None  # None: as many as the cluster's CPUs (or GPUs / gpus_per_worker) allow, at most one per book
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs and --device allows them, else 0
    max_retries: int = 2  # how many more workers a book gets when the one summarizing it dies


@dataclass(frozen=True)
class CrashHook:
    """Tests only (env ``UNLIMISUM_RAY_TEST_CRASH=SOURCE::TOKEN``): the worker given ``source`` while the
    file ``token`` exists removes the token, leaves half a temporary output file, and dies at once
    (``os._exit``), like a worker lost mid-book. The token makes it happen once."""

    source: str  # the input, as the job names it
    token: str  # a file whose removal arms the crash once


class SummarizeWorker:
    """One Ray actor: one loaded model, summarizing the books it is given with the run's settings."""

    def __init__(self, settings, cwd: str, crash_hook: CrashHook | None = None):
        self.settings = settings
        self.cwd = cwd  # the driver's working directory: relative paths mean the same here
        self.crash_hook = crash_hook
        self.runner = None

    def summarize(self, job, several: bool):
        """The JobResult of ``job`` (the output file written, with -o); the model loads on the first call."""
        if self.runner is None:
            self._start()
        if self.crash_hook is not None and job.source == self.crash_hook.source:
            _crash_once(self.crash_hook, job)
        return self.runner.summarize_job(job, several=several)

    def _start(self) -> None:
        from rich.console import Console

        from unlimisum.cli.progress import ProgressDisplay
        from unlimisum.runs.runner import BatchRunner

        if not os.path.isdir(self.cwd):
            raise SharedStorageError(
                f"a Ray worker cannot see the folder {self.cwd}: with --engine ray, inputs and --output-dir must "
                "be on storage every node mounts at the same path"
            )
        os.chdir(self.cwd)
        display = ProgressDisplay(Console(file=io.StringIO()), show=False, live=False)  # the driver reports
        runner = BatchRunner(self.settings, display)
        runner.load_model()
        self.runner = runner


class RayEngine:
    """Runs a `summarize` batch on Ray, reporting through the driver's ``BatchRunner`` (lines, stdout, counts)."""

    def __init__(self, runner, settings: RaySettings = RaySettings()):
        self.runner = runner  # unlimisum.runs.runner.BatchRunner: never loads a model on the driver
        self.settings = settings
        self.ray = require_ray()
        self._started_ray = False
        self._actors: list = []
        self._remote_class = None  # SummarizeWorker as a Ray actor class, made once per run

    def run(self, jobs: list) -> object:
        """Summarize ``jobs`` on Ray; returns the runner's BatchResult. Ctrl-C propagates after cleaning up."""
        from unlimisum.runs.runner import BatchResult

        runner = self.runner
        runner.result = BatchResult(total=len(jobs))
        try:
            todo = runner.report_unusable(jobs)
            if todo:
                self._connect()
                self._run_books(todo, several=len(jobs) > 1)
        except BrokenPipeError:
            runner.result.pipe_closed = True
        finally:
            self._stop()
        return runner.result

    # -- the cluster --------------------------------------------------------------------------

    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():  # library use, tests: the instance this process already has
            return
        options = dict(logging_level=logging.ERROR, log_to_driver=False)
        if self.settings.address:
            ray.init(address=self.settings.address, **options)
        else:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(address="local", num_cpus=self.settings.workers or os.cpu_count() or 1,
                     include_dashboard=False, **options)
        self._started_ray = True

    def _stop(self) -> None:
        for actor in self._actors:
            self._kill(actor)
        self._actors = []
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False

    def _kill(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001  (already gone)
            pass

    def _plan_workers(self, books: int) -> tuple[int, float]:
        """(workers, GPUs each), from the options or from the cluster's resources."""
        resources = self.ray.cluster_resources()
        gpus = self.settings.gpus_per_worker
        if gpus is None:
            device = self.runner.settings.model.device
            gpus = 1.0 if resources.get("GPU", 0) >= 1 and (device == "auto" or device.startswith("cuda")) else 0.0
        workers = self.settings.workers
        if workers is None:
            capacity = resources.get("GPU", 0) / gpus if gpus else resources.get("CPU", 1)
            workers = max(1, int(capacity))
        return max(1, min(workers, books)), gpus

    def _new_actor(self, gpus: float):
        if self._remote_class is None:
            self._remote_class = self.ray.remote(SummarizeWorker)
        options = dict(num_cpus=1, num_gpus=gpus, max_restarts=0, max_task_retries=0)
        actor = self._remote_class.options(**options).remote(self.runner.settings, os.getcwd(), _crash_hook_from_env())
        self._actors.append(actor)
        return actor

    # -- scheduling ---------------------------------------------------------------------------

    def _run_books(self, todo: list, several: bool) -> None:
        ray, runner = self.ray, self.runner
        workers, gpus = self._plan_workers(len(todo))
        idle = [self._new_actor(gpus) for _ in range(workers)]
        pending = deque((index, 1) for index in range(len(todo)))  # (book, attempt)
        running: dict = {}  # object ref -> (actor, book, attempt)
        finished: dict[int, object] = {}  # book -> JobResult, until it is its turn on stdout
        next_out = 0
        progress = BatchProgress(runner.display, len(todo))
        try:
            with progress:
                while pending or running:
                    while pending and idle:
                        index, attempt = pending.popleft()
                        actor = idle.pop()
                        ref = actor.summarize.remote(todo[index], several)
                        running[ref] = (actor, index, attempt)
                    progress.running = len(running)
                    progress.update()
                    ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_SECONDS)
                    for ref in ready:
                        actor, index, attempt = running.pop(ref)
                        job = todo[index]
                        result = self._result(ref, job)
                        if result is None:  # the worker died: replace it, hand the book on
                            self._actors.remove(actor)
                            idle.append(self._new_actor(gpus))
                            result = self._retry_or_fail(job, index, attempt, pending)
                            if result is None:
                                continue
                        else:
                            idle.append(actor)
                        if attempt > 1:
                            result = replace(result, outcome=replace(result.outcome, attempts=attempt))
                        if runner.result.model is None and result.model is not None:
                            runner.result.model = result.model
                        runner.report(job, result)
                        progress.done, progress.failed = runner.result.done, len(runner.result.failures)
                        progress.tokens += result.outcome.input_tokens or 0
                        finished[index] = result
                    while next_out in finished:
                        with progress.paused():
                            runner.emit(finished.pop(next_out))
                        next_out += 1
        except KeyboardInterrupt:
            self._interrupt([todo[index] for _, index, _ in running.values()], list(running))
            raise

    def _result(self, ref, job):
        """The worker's JobResult; None when the worker died; the model's error ends the run."""
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:
            _remove_partials(job)
            return None
        except ray.exceptions.RayTaskError as error:  # raised outside summarize_job: loading the model
            cause = getattr(error, "cause", None)
            if isinstance(cause, UnlimisumError):
                raise cause from None
            raise UnlimisumError(f"a Ray worker failed: {cause or error}") from None

    def _retry_or_fail(self, job, index: int, attempt: int, pending: deque):
        """Hand a book whose worker died to another one, or (retries spent) its failed JobResult."""
        display = self.runner.display
        if attempt <= self.settings.max_retries:
            display.note(f"unlimisum: the worker summarizing {job.source} died; retrying it on another worker "
                         f"(attempt {attempt + 1} of {self.settings.max_retries + 1})")
            pending.appendleft((index, attempt + 1))
            return None
        return self.runner.failed_result(job, f"its Ray worker died {attempt} times (a node lost, or out of memory?)",
                                         "WorkerDiedError")

    def _interrupt(self, running: list, refs: list) -> None:
        """Ctrl-C: kill every worker, wait until they are gone, remove the temporary files they left
        (``running``: the jobs being summarized)."""
        for actor in self._actors:
            self._kill(actor)
        if refs:
            try:
                self.ray.wait(refs, num_returns=len(refs), timeout=KILL_WAIT_SECONDS)
            except Exception:  # noqa: BLE001  (a second Ctrl-C, or Ray going away)
                pass
        for job in running:
            _remove_partials(job)


def _remove_partials(job) -> None:
    """Remove the temporary files of ``job``'s output (``.NAME.*.partial``) that a dead worker left."""
    if job.output is None:
        return
    output = Path(job.output)
    for partial in output.parent.glob(f".{output.name}.*.partial"):
        try:
            partial.unlink()
        except OSError:
            pass


def _crash_hook_from_env() -> CrashHook | None:
    value = os.environ.get(CRASH_HOOK_ENV, "")
    if "::" not in value:
        return None
    source, token = value.split("::", 1)
    return CrashHook(source=source, token=token)


def _crash_once(hook: CrashHook, job) -> None:
    try:
        os.unlink(hook.token)
    except FileNotFoundError:
        return
    if job.output is not None:
        output = Path(job.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        (output.parent / f".{output.name}.crash.partial").write_text("<!-- written by unlimisum -->\nhalf a summ")
    os._exit(1)
