"""The Ray engine (``summarize --engine ray``): a batch of books spread over the workers of a Ray cluster.

One input is the exception: its windows are spread over the workers instead, and the driver makes
the summary (``unlimisum.runs.ray_windows``). What follows is the batch.

How it runs:

- The driver (the `unlimisum` process) plans and checks the inputs exactly as a local run
  does (``unlimisum.runs.jobs``): unusable inputs get their failure line and skipped ones
  their line before Ray starts, and Ray is not started at all when nothing is left to do.
- Ray itself: the cluster of ``--ray-address``, or a local instance started for the run that
  listens on 127.0.0.1 only, without a dashboard (``start_local_ray``). Either way ``ray.init``
  runs from an empty folder: Ray puts the driver's working directory first on every worker's
  ``sys.path``, where a folder named ``unlimisum`` (a clone beside the data) would shadow the
  installed package. Workers get the driver's working directory as an absolute path instead.
- The workers are planned from what each node has free (``unlimisum.runs.ray_plan``): how
  many fit, CPUs each (its torch threads: the node's CPUs shared out, or ``--cpus-per-worker``),
  GPUs each, and memory each (the node's free memory shared out; the worker's retrieval kernels
  budget that share). Fewer than ``--workers`` is said on stderr; none is an error naming the
  resource.
- Each worker is a Ray actor holding one loaded model. It is handed a book only once it is
  placed and its model is loaded; one that no node takes within ``PLACEMENT_SECONDS`` is given
  up (an error naming the resource when none is left). A start that fails the same way each
  time (damaged weights, a model folder missing on its node, an import error) is reported once,
  in the line a local run gives, and not retried; a worker lost while starting is replaced.
- A worker runs in the driver's working directory, reads its input from the path and writes
  its output itself, atomically (temporary file + rename), with the same names and markers as
  a local run: it calls the local engine's own ``BatchRunner.summarize_job``. Paths must
  therefore be on storage every node mounts at the same place. The notes and warnings it gives
  (cache, ingest, Python warnings) come back with the book and are printed before its line.
- The driver hands one book at a time to each idle worker (bounded scheduling: never more
  books in flight than workers), prints the done / failed line of each book as it ends, and
  what goes to stdout (``--json`` lines or Markdown, without ``-o``) in input order.
- A worker that dies mid-book (killed actor, lost node) or stops answering (Ray's
  ``ActorUnavailableError``: it may still be running) is killed, without a restart, and once Ray
  reports it ended the half-written temporary file it may leave is removed, so an output is whole
  or absent, and its book is handed to another worker, at most ``RaySettings.max_retries`` more
  times. One that is not seen to end within ``ACTOR_END_SECONDS`` (a node cut off) may still be
  writing: its book fails rather than run twice. Ctrl-C kills the workers, removes their temporary
  files and ends the run (exit 130); ``--skip-existing`` resumes. On the way out (Ctrl-C, an
  error) the summaries already finished that wait for an earlier book are printed, in input order.
- Ray's private APIs (the free resources per node, the loopback address of a local instance,
  the address ``auto`` stands for) are each used with a fallback: a Ray release without one
  still runs (pyproject.toml pins the range the tests run on).

Why Ray core actors rather than Ray Data: a book is one heavy item (minutes of CPU, seconds of
GPU), not a row of a dataset, and the run needs per-book control that Ray Data's streaming
``map_batches`` does not give: a book retried on another actor when its worker dies, with a
bound the user sees; one failure line per bad book while the batch goes on; summaries printed
in input order; outputs written as files by the worker that made them rather than a dataset to
materialize; Ctrl-C that kills the workers and cleans up. Ray core alone also keeps the extra
small (Ray Data brings pyarrow and pandas).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from unlimisum.runs import require_ray
from unlimisum.runs.report import SilentReporter
from unlimisum.runs.ray_plan import (
    GIB, WorkerPlacementError, WorkerPlan, describe_free, nodes_from_ray, plan_workers,
)
from unlimisum.errors import UnlimisumError

CRASH_HOOK_ENV = "UNLIMISUM_RAY_TEST_CRASH"  # tests only: "SOURCE::TOKEN_FILE", see CrashHook
WAIT_SECONDS = 0.5  # how often the driver wakes to redraw the progress while books run
KILL_WAIT_SECONDS = 10.0  # how long Ctrl-C waits for killed workers to be gone before cleaning up
ACTOR_END_SECONDS = 60.0  # how long a worker that died or stopped answering may take to be reported ended
PLACEMENT_SECONDS = 60.0  # how long a worker may wait for a node with room before it is given up
SETTLE_SECONDS = 3.0  # how long planning waits for resources to come back when fewer workers fit than wanted
ANY_NUMBER_OF_PARTS = 1 << 30  # one book spread over the workers: as many workers as fit
LOOPBACK = "127.0.0.1"  # where a local instance started for a run listens
INSTALL_HINT = "is unlimisum installed on every node, in the same environment as the driver?"


class SharedStorageError(UnlimisumError):
    """A worker cannot see the driver's working directory: inputs and outputs are not on shared storage."""


class WorkerStartError(UnlimisumError):
    """A Ray worker cannot start: its code does not import there, or starting it raised an unexpected error."""


@dataclass(frozen=True)
class RaySettings:
    """Where and how wide a Ray run goes."""

    address: str | None = None  # None: a local Ray instance for the run (or the one this process already has)
    workers: int | None = None  # None: one per free CPU (or GPUs / gpus_per_worker), at most one per book
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs and --device allows them, else 0
    cpus_per_worker: int | None = None  # None: the free CPUs shared out (free CPUs // workers), see ray_plan
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

    def __init__(self, settings, cwd: str, cpus: int, memory: int | None, crash_hook: CrashHook | None = None,
                 reads_files: bool = True):
        self.settings = settings
        self.cwd = cwd  # the driver's working directory, absolute: relative paths mean the same here
        self.reads_files = reads_files  # False: it encodes parts of a book the driver read (no shared storage)
        self.cpus = cpus  # CPUs reserved: torch's threads
        self.memory = memory  # bytes reserved: the share the retrieval kernels budget (None: the machine's)
        self.crash_hook = crash_hook
        self.runner = None
        self.display = SilentReporter()  # draws nothing; its notes go back to the driver
        self._warned: set = set()

    def ready(self) -> str:
        """Placed and imported: the address of its node."""
        import ray

        return ray.util.get_node_ip_address()

    def start(self) -> dict:
        """Load the model: ``node``, torch ``threads``, ``memory`` budget, and the ``lines`` said while loading."""
        import torch

        from unlimisum.runs.runner import BatchRunner
        from unlimisum.search.packed import MEMORY_LIMIT_ENV

        if os.path.isdir(self.cwd):
            os.chdir(self.cwd)
        elif self.reads_files:
            raise SharedStorageError(
                f"a Ray worker cannot see the folder {self.cwd}: with --engine ray, inputs and --output-dir must "
                "be on storage every node mounts at the same path"
            )
        torch.set_num_threads(self.cpus)
        if self.memory is not None:
            os.environ[MEMORY_LIMIT_ENV] = str(self.memory)
        runner = BatchRunner(self.settings, self.display)
        with self._python_warnings():
            runner.load_model()
        self.runner = runner
        return dict(node=self.ready(), threads=torch.get_num_threads(), memory=self.memory, lines=self.display.take())

    def summarize(self, job, several: bool):
        """(the JobResult of ``job``, the lines said meanwhile); with -o the output file is written."""
        if self.crash_hook is not None and job.source == self.crash_hook.source:
            _crash_once(self.crash_hook, job)
        with self._python_warnings():
            result = self.runner.summarize_job(job, several=several)
        return result, self.display.take()

    def encode_windows(self, input_ids, plan, batch_size: int, least_seconds: float = 0.0):
        """(the kept states of ``plan``'s windows over ``input_ids``, as ``ray_windows.to_wire`` sends them, the
        lines said meanwhile): a part of one book (``WindowPlan.part``), encoded in batches of ``batch_size``;
        ``least_seconds``: tests only (ray_windows.SLOW_PART_ENV), the least time it takes."""
        import torch

        from unlimisum.runs.ray_windows import to_wire

        started = time.monotonic()
        with self._python_warnings():
            states = self.runner.summarizer.window_states(torch.tensor(input_ids), plan, batch_size=batch_size)
        time.sleep(max(0.0, least_seconds - (time.monotonic() - started)))
        return to_wire(states), self.display.take()

    @contextlib.contextmanager
    def _python_warnings(self):
        """Python warnings raised within, as lines for the driver: each place and message once, as Python's
        default filter shows them in a local run."""
        with warnings.catch_warnings(record=True) as caught:
            yield
        for warning in caught:
            key = (warning.category, str(warning.message), warning.filename, warning.lineno)
            if key not in self._warned:
                self._warned.add(key)
                message = " ".join(str(warning.message).split())
                self.display.note(f"{warning.filename}:{warning.lineno}: {warning.category.__name__}: {message}")


@dataclass(eq=False)
class _Worker:
    """An actor as the driver sees it, from creation until it is lost or the run ends."""

    actor: object
    ready_ref: object  # done once a node took it and it imported
    start_ref: object  # done once its model is loaded
    deadline: float  # time.monotonic() by which it must be placed
    attempt: int = 1  # 2, 3...: it replaces workers that died while starting
    placed: bool = False


class RayEngine:
    """Runs a `summarize` batch on Ray, reporting through the driver's ``BatchRunner`` (lines, stdout, counts)."""

    def __init__(self, runner, settings: RaySettings = RaySettings()):
        self.runner = runner  # unlimisum.runs.runner.BatchRunner: loads a model on the driver for one input only
        self.settings = settings
        self.ray = require_ray()
        self._started_ray = False
        self._init_folder: Path | None = None  # the empty folder ray.init ran from
        self._actors: list = []
        self._remote_class = None  # SummarizeWorker as a Ray actor class, made once per run
        self._plan: WorkerPlan | None = None
        self._starting: dict = {}  # ready or start ref -> _Worker, until its model is loaded
        self._start_failures: list[UnlimisumError] = []  # deterministic start failures not reported yet
        self._said: set[str] = set()  # lines given once per run (start notes, start failures)
        self._workers_read_files = True  # False: one book spread over the workers, read and written here

    def run(self, jobs: list) -> object:
        """Summarize ``jobs`` on Ray; returns the runner's BatchResult. Ctrl-C propagates after cleaning up."""
        from unlimisum.runs.runner import BatchResult

        runner = self.runner
        runner.result = BatchResult(total=len(jobs))
        try:
            todo = runner.report_unusable(jobs)
            if len(todo) == 1:
                self._run_one(todo[0], several=len(jobs) > 1)
            elif todo:
                self._connect()
                self._run_books(todo, several=len(jobs) > 1)
        except BrokenPipeError:
            runner.result.pipe_closed = True
        finally:
            self._stop()
        return runner.result

    def _run_one(self, job, several: bool) -> None:
        """One input: an encoder-decoder model's windows are encoded by the workers and the summary is made
        here (unlimisum.runs.ray_windows); a decoder-only model's prompt, read in order, goes to one worker."""
        from unlimisum.runs.ray_windows import RayWindows

        runner = self.runner
        with runner.reporter:
            if not runner.read_ahead([job]):  # unreadable: its line is given, and Ray never starts
                return
            runner.load_model()
            if not runner.summarizer.loaded.is_decoder_only:
                self._workers_read_files = False
                self._connect()
                self._plan = self._plan_workers(ANY_NUMBER_OF_PARTS)
                for _ in range(self._plan.workers):
                    self._start_worker()
                runner.summarizer.family.window_encoder = RayWindows(self)
                runner.reporter.begin_document(1, 1, job.source, read=job.document is not None)
                runner.finish(job, runner.summarize_job(job, several=several))  # in a local run's order
                return
        runner.summarizer = None  # the worker loads its own
        self._connect()
        self._run_books([job], several)

    # -- what RayWindows uses -------------------------------------------------------------------

    wait_seconds = WAIT_SECONDS

    def worker_count(self) -> int:
        """The workers the plan placed (started or starting)."""
        return self._plan.workers if self._plan is not None else 0

    def release_workers(self) -> None:
        """End every worker now (their work is done; the cluster gets its resources back)."""
        for actor in self._actors:
            self._kill(actor)
        self._actors = []
        self._starting = {}

    def note_once(self, line: str) -> None:
        """Say a worker's line on the driver, once per run."""
        if line not in self._said:
            self._said.add(line)
            self.runner.reporter.note(line)

    @staticmethod
    def task_error(error) -> UnlimisumError:
        """The error a worker's call raised (Ray's RayTaskError around it), as the run reports it."""
        cause = getattr(error, "cause", None)
        if isinstance(cause, UnlimisumError):
            return cause
        return UnlimisumError(f"a Ray worker failed: {_exception_line(cause or error)}")

    # -- the cluster --------------------------------------------------------------------------

    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():  # library use, tests: the instance this process already has
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        options = dict(logging_level=logging.ERROR, log_to_driver=False)
        if self.settings.address:
            self._init_folder = join_ray(ray, self.settings.address, **options)
        else:
            self._init_folder = start_local_ray(ray, **options)
        self._started_ray = True

    def _stop(self) -> None:
        self.release_workers()
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False
        if self._init_folder is not None:
            shutil.rmtree(self._init_folder, ignore_errors=True)
            self._init_folder = None

    def _kill(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001  (already gone)
            pass

    def _free_nodes(self) -> list:
        """What each live node has free now (Ray's private developer API; without it, each node's totals)."""
        totals = {node["NodeID"]: node["Resources"] for node in self.ray.nodes() if node["Alive"]}
        try:
            from ray._private.state import available_resources_per_node

            free = available_resources_per_node()
        except Exception:  # noqa: BLE001  (another Ray: moved, renamed or failing)
            return nodes_from_ray(totals)
        if not isinstance(free, dict) or not all(isinstance(resources, dict) for resources in free.values()):
            return nodes_from_ray(totals)
        return nodes_from_ray(free, totals)

    def _plan_workers(self, books: int) -> WorkerPlan:
        """The run's workers from what the cluster has free; fewer than --workers is said on stderr."""
        gpus = self.settings.gpus_per_worker
        if gpus is None:
            device = self.runner.settings.model.device
            has_gpus = self.ray.cluster_resources().get("GPU", 0) >= 1
            gpus = 1.0 if has_gpus and (device == "auto" or device.startswith("cuda")) else 0.0
        options = dict(workers=self.settings.workers, cpus_per_worker=self.settings.cpus_per_worker,
                       gpus_per_worker=gpus)
        settle = time.monotonic() + SETTLE_SECONDS
        while True:  # resources just given back (workers of a run before, other work ending) show up in a moment
            try:
                plan = plan_workers(self._free_nodes(), books, **options)
            except WorkerPlacementError:
                if time.monotonic() > settle:
                    raise
                plan = None
            if plan is not None and (not plan.short_of or time.monotonic() > settle):
                break
            time.sleep(WAIT_SECONDS / 2)
        display = self.runner.reporter
        if plan.short_of and plan.asked is not None:
            display.note(f"unlimisum: note: --workers {plan.asked}: the Ray cluster has room for {plan.workers} now, "
                         f"short of {plan.short_of}; using {plan.workers}")
        display.log(f"Ray: {plan.workers} worker{'s' if plan.workers != 1 else ''}, each with {plan.shape()}, "
                    f"on {len(plan.per_node)} node{'s' if len(plan.per_node) != 1 else ''}")
        return plan

    # -- workers ------------------------------------------------------------------------------

    def _start_worker(self, attempt: int = 1) -> None:
        """Create an actor of the plan's shape; it is handed books once ``start`` returns."""
        ray, plan = self.ray, self._plan
        if self._remote_class is None:
            self._remote_class = ray.remote(SummarizeWorker)
        options = dict(num_cpus=plan.cpus, num_gpus=plan.gpus, max_restarts=0, max_task_retries=0)
        if plan.memory is not None:
            options["memory"] = plan.memory
        actor = self._remote_class.options(**options).remote(
            self.runner.settings, os.path.abspath(os.getcwd()), plan.cpus, plan.memory, _crash_hook_from_env(),
            self._workers_read_files)
        self._actors.append(actor)
        worker = _Worker(actor, actor.ready.remote(), actor.start.remote(), time.monotonic() + PLACEMENT_SECONDS,
                         attempt)
        self._starting[worker.ready_ref] = worker
        self._starting[worker.start_ref] = worker

    def _forget(self, worker: _Worker, *, kill: bool) -> None:
        for ref in (worker.ready_ref, worker.start_ref):
            self._starting.pop(ref, None)
        if worker.actor in self._actors:
            self._actors.remove(worker.actor)
        if kill:
            self._kill(worker.actor)

    def _starting_workers(self) -> list:
        return list({id(worker): worker for worker in self._starting.values()}.values())

    def _on_start(self, ref, idle: list) -> None:
        """One of a starting worker's calls ended: placed, started (then idle), or failed."""
        ray = self.ray
        worker = self._starting.pop(ref)
        try:
            value = ray.get(ref)
        except Exception as error:  # noqa: BLE001  (sorted below: deterministic, or a lost worker)
            self._forget(worker, kill=True)
            self._start_failed(worker, error)
            return
        if ref == worker.ready_ref:
            worker.placed = True
            return
        self._starting.pop(worker.ready_ref, None)
        worker.placed = True
        idle.append(worker.actor)
        display = self.runner.reporter
        for line in value["lines"]:
            self.note_once(line)
        memory = f"{value['memory'] / GIB:.1f} GiB" if value["memory"] is not None else "the machine's"
        display.log(f"Ray worker on {value['node']} ready: {value['threads']} torch threads, {memory} memory budget")

    def _start_failed(self, worker: _Worker, error: Exception) -> None:
        """Sort a start failure: the same each time (kept, reported once), or a worker lost (replaced)."""
        exceptions = self.ray.exceptions
        if isinstance(error, exceptions.RayTaskError):  # start() raised: it would raise again
            cause = getattr(error, "cause", None)
            self._start_failures.append(cause if isinstance(cause, UnlimisumError) else WorkerStartError(
                f"a Ray worker could not start: {_exception_line(cause or error)}"))
        elif isinstance(error, exceptions.RayActorError) and getattr(error, "actor_init_failed", False):
            self._start_failures.append(WorkerStartError(
                f"a Ray worker could not start: {_last_line(str(error))} ({INSTALL_HINT})"))
        elif isinstance(error, getattr(exceptions, "RuntimeEnvSetupError", ())):
            self._start_failures.append(WorkerStartError(f"a Ray worker could not start: {_last_line(str(error))}"))
        elif worker.attempt <= self.settings.max_retries:  # lost: out of memory while loading, a node gone
            self.runner.reporter.note(f"unlimisum: a Ray worker died while loading the model; starting another "
                                     f"(attempt {worker.attempt + 1} of {self.settings.max_retries + 1})")
            self._start_worker(worker.attempt + 1)
        else:
            self._start_failures.append(WorkerStartError(
                f"Ray workers died {worker.attempt} times while loading the model (out of memory?)"))

    def _settle(self, working: bool) -> None:
        """Report start failures once: warnings when other workers started (``working``), the error when none
        is left."""
        if not self._start_failures:
            return
        if working:
            for failure in self._start_failures:
                line = f"unlimisum: warning: {failure}; going on with the other workers"
                if str(failure) not in self._said:
                    self._said.add(str(failure))
                    self.runner.reporter.note(line)
            self._start_failures = []
        elif not self._starting:
            raise self._start_failures[0]

    def _check_placement(self, idle: list, running: dict) -> None:
        """Give up the workers no node took within PLACEMENT_SECONDS; an error when none is left."""
        now = time.monotonic()
        late = [worker for worker in self._starting_workers() if not worker.placed and now > worker.deadline]
        if not late:
            return
        for worker in late:
            self._forget(worker, kill=True)
        left = len(idle) + len(running) + len(self._starting_workers())
        needs = f"each needs {self._plan.shape()}, and {describe_free(self._free_nodes())}"
        if not left and not self._start_failures:
            raise WorkerPlacementError(f"no Ray worker could be placed within {PLACEMENT_SECONDS:g} s: {needs}")
        self.runner.reporter.note(f"unlimisum: note: {len(late)} Ray worker{'s' if len(late) != 1 else ''} could not "
                                 f"be placed within {PLACEMENT_SECONDS:g} s ({needs}); going on with {left}")

    # -- scheduling ---------------------------------------------------------------------------

    def _run_books(self, todo: list, several: bool) -> None:
        ray, runner = self.ray, self.runner
        self._plan = self._plan_workers(len(todo))
        for _ in range(self._plan.workers):
            self._start_worker()
        idle: list = []  # actors started and free
        pending = deque((index, 1) for index in range(len(todo)))  # (book, attempt)
        running: dict = {}  # object ref -> (actor, book, attempt)
        finished: dict[int, object] = {}  # book -> JobResult, until it is its turn on stdout
        next_out = 0
        progress = runner.reporter.batch(len(todo))
        try:
            with progress:
                while pending or running:
                    while pending and idle:
                        index, attempt = pending.popleft()
                        actor = idle.pop()
                        ref = actor.summarize.remote(todo[index], several)
                        running[ref] = (actor, index, attempt)
                    self._settle(working=bool(idle or running))
                    if pending and not idle and not running and not self._starting:
                        raise WorkerStartError("no Ray worker is left to summarize the remaining books")
                    progress.running = len(running)
                    progress.update()
                    ready, _ = ray.wait(list(running) + list(self._starting), num_returns=1, timeout=WAIT_SECONDS)
                    for ref in ready:
                        if ref in self._starting:
                            self._on_start(ref, idle)
                            continue
                        actor, index, attempt = running[ref]  # kept there until it is settled (Ctrl-C cleans up)
                        job = todo[index]
                        result = self._result(ref, job)
                        if result is None:  # the worker died or stopped answering: end it, hand the book on
                            ended = self._end_actor(actor)
                            if ended:
                                _remove_partials(job)
                            del running[ref]
                            self._actors.remove(actor)
                            self._start_worker()
                            result = self._retry_or_fail(job, index, attempt, pending, ended)
                            if result is None:
                                continue
                        else:
                            del running[ref]
                            idle.append(actor)
                        if attempt > 1:
                            result = replace(result, outcome=replace(result.outcome, attempts=attempt))
                        if runner.result.model is None and result.model is not None:
                            runner.result.model = result.model
                        runner.report(job, result)
                        progress.done, progress.failed = runner.result.done, len(runner.result.failures)
                        progress.tokens += result.outcome.input_tokens or 0
                        finished[index] = result
                    self._check_placement(idle, running)
                    while next_out in finished:
                        with progress.paused():
                            runner.emit(finished.pop(next_out))
                        next_out += 1
                self._settle(working=True)  # every book ended: failures of other workers are warnings
        except BrokenPipeError:
            raise
        except BaseException as error:  # Ctrl-C, or an error that ends the run: what is finished is printed
            self._emit_finished(finished)
            if isinstance(error, KeyboardInterrupt):
                self._interrupt([todo[index] for _, index, _ in running.values()], list(running))
            raise

    def _emit_finished(self, finished: dict) -> None:
        """Print the results that waited for an earlier book, in input order (the run is ending)."""
        try:
            for index in sorted(finished):
                self.runner.emit(finished.pop(index))
        except BrokenPipeError:  # the reader is gone: nothing more to print
            self.runner.result.pipe_closed = True

    def _result(self, ref, job):
        """The worker's JobResult, its lines printed; None when the worker died or stopped answering (Ray's
        RayActorError covers both: ActorDiedError, ActorUnavailableError); the model's error ends the run."""
        ray = self.ray
        try:
            result, lines = ray.get(ref)
        except ray.exceptions.RayActorError:
            return None
        except ray.exceptions.RayTaskError as error:  # raised outside summarize_job
            raise self.task_error(error) from None
        for line in lines:
            self.runner.reporter.note(line)
        return result

    def _end_actor(self, actor) -> bool:
        """Kill ``actor`` (no restart) and wait until Ray reports it ended (a call to it fails as dead), at most
        ACTOR_END_SECONDS: whether it did. One that stopped answering may still be running and writing."""
        exceptions = self.ray.exceptions
        unavailable = getattr(exceptions, "ActorUnavailableError", ())  # () matches nothing (a Ray without it)
        timeout = getattr(exceptions, "GetTimeoutError", TimeoutError)
        self._kill(actor)
        deadline = time.monotonic() + ACTOR_END_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.ray.get(actor.ready.remote(), timeout=left)
            except unavailable:  # not known to have ended yet: the node may be cut off
                pass
            except exceptions.RayActorError:
                return True
            except timeout:
                return False
            time.sleep(min(WAIT_SECONDS, max(left, 0)))  # it answered or was unreachable: the kill is under way
        return False

    def _retry_or_fail(self, job, index: int, attempt: int, pending: deque, ended: bool = True):
        """Hand a book whose worker died to another one, or (retries spent, or the worker not seen to end)
        its failed JobResult."""
        display = self.runner.reporter
        if not ended:
            return self.runner.failed_result(
                job, f"its Ray worker stopped answering and was not seen to end within {ACTOR_END_SECONDS:g} s; "
                     "not retried, since it may still be writing (--skip-existing resumes)", "WorkerLostError")
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


def init_outside_cwd(ray, **options) -> Path:
    """``ray.init(**options)`` run from a new empty folder, returned (remove it after ``ray.shutdown()``).

    Ray puts the driver's working directory first on the ``sys.path`` of every worker (and starts
    them there): a folder named ``unlimisum`` in it would be imported instead of the installed
    package. From an empty folder nothing can shadow anything; workers get the real working
    directory as an absolute path.
    """
    folder = Path(tempfile.mkdtemp(prefix="unlimisum-ray-"))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        ray.init(**options)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.chdir(cwd)
    return folder


def start_local_ray(ray=None, **options) -> Path:
    """Start a Ray instance for this machine alone: its servers on 127.0.0.1, no dashboard (``init_outside_cwd``)."""
    ray = ray or require_ray()
    return _init_on_loopback(ray, address="local", include_dashboard=False, **options)


def join_ray(ray, address: str, **options) -> Path:
    """Connect to the Ray cluster at ``address`` (``init_outside_cwd``); one on this machine's loopback
    (such as an instance another run started) is joined from 127.0.0.1."""
    if not _is_loopback(address):
        return init_outside_cwd(ray, address=address, **options)
    return _init_on_loopback(ray, address=address, **options)


def _init_on_loopback(ray, **options) -> Path:
    """``init_outside_cwd`` with this node's address 127.0.0.1 (``ray.init``'s private ``_node_ip_address``; a
    Ray without it is started without, and ``_loopback_only`` alone keeps it on the loopback)."""
    with _loopback_only():
        try:
            return init_outside_cwd(ray, _node_ip_address=LOOPBACK, **options)
        except (RuntimeError, TypeError, ValueError) as error:
            if "_node_ip_address" not in str(error):  # "Unknown keyword argument(s): _node_ip_address"
                raise
        return init_outside_cwd(ray, **options)


@contextlib.contextmanager
def _loopback_only():
    """Ray turns an explicit 127.0.0.1 into the machine's network address unless it believes clusters are
    off (as on macOS and Windows): that belief (a private constant) is held while it starts or joins."""
    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray: nothing to hold
        yield
        return
    clusters = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if clusters is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if clusters is not None:
            ray_constants.ENABLE_RAY_CLUSTER = clusters


def _is_loopback(address: str) -> bool:
    """``127.0.0.1:6379``, ``localhost:6379``, or ``auto`` naming a loopback instance (not a ``ray://`` client)."""
    if address == "auto":
        try:
            from ray._private.services import get_ray_address_from_environment

            address = get_ray_address_from_environment("auto", None) or ""
        except Exception:  # noqa: BLE001  (another Ray, or none found: the address Ray documents first)
            address = os.environ.get("RAY_ADDRESS", "")
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _exception_line(error: BaseException) -> str:
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _last_line(text: str) -> str:
    """The last line of a Ray error's text: the exception that ended the worker's traceback."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _remove_partials(job) -> None:
    """Remove the temporary files of ``job``'s output (``.NAME.*.partial``) that a dead worker left."""
    if job.output is None:
        return
    output = Path(job.output)
    for partial in output.parent.glob(f".{glob.escape(output.name)}.*.partial"):  # "Book [1].md" is no pattern
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
