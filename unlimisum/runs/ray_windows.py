"""One book across a Ray cluster: its windows encoded by the workers, the store assembled on the driver.

``summarize --engine ray`` on one input (an encoder-decoder model) loads the model on the driver
too. The driver tokenizes and plans the windows as a local run does; the Ray engine's workers
(``SummarizeWorker``, each with the model loaded) encode consecutive parts of the plan
(``WindowPlan.part``: whole encoder batches, so each window is encoded in the same company as in
a local run) and send back their kept states; the driver hands them to the store's builder in
order, exactly as a local encode hands its own, then searches and generates itself. In float32
the store is the local run's bit for bit when the workers run the same software on the same kind
of device (tests/test_engine_ray.py).

- Bounded memory on the driver: a part is handed out only while it is fewer than
  ``LOOKAHEAD_PER_WORKER`` parts per worker ahead of the next one the store needs, so parts that
  arrive early wait in a bounded set.
- What moves: each part's tokens out (int64, overlap included) and its kept states back in the
  encoder's dtype (bfloat16 as its bits): ``d_model x bytes`` per token, 1.5 KiB at bart-base in
  bfloat16, 3 KiB in float32 (bench/ray_windows.py measures it).
- A worker lost mid-part (a node gone, out of memory) is replaced and its part handed to another
  worker, at most ``RaySettings.max_retries`` more times; then the book fails with a line saying so.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Callable

import numpy as np
import torch

from unlimisum.errors import UnlimisumError
from unlimisum.unlimiformer.encoding import WindowPlan, shard_windows

PARTS_PER_WORKER = 4  # parts planned per worker: small enough to balance, large enough that a part is seconds
MOST_WINDOWS_PER_PART = 8  # bart-base on one core: 0.8 s a window, 6 s a part; Ray's per-call cost is milliseconds
LOOKAHEAD_PER_WORKER = 2  # parts handed out beyond the next one the store needs, per worker
SLOW_PART_ENV = "UNLIMISUM_RAY_TEST_PART_SECONDS"  # tests only: the least time a worker's part of a book takes


class WorkerDiedError(UnlimisumError):
    """The Ray workers encoding a part of the book died more times than the run retries."""


def to_wire(states: torch.Tensor) -> tuple[np.ndarray, str]:
    """[n, d] states as an array Ray moves without pickling, and their dtype (bfloat16 travels as its bits)."""
    states = states.detach().cpu().contiguous()
    dtype = str(states.dtype).removeprefix("torch.")
    return (states.view(torch.int16) if states.dtype == torch.bfloat16 else states).numpy(), dtype


def from_wire(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The states ``to_wire`` sent, in a tensor of their own (Ray's arrays are read-only views of its store)."""
    states = torch.from_numpy(np.array(array))
    return states.view(torch.bfloat16) if dtype == "bfloat16" else states


class RayWindows:
    """Encodes a document's windows on the Ray engine's workers (``unlimisum.unlimiformer.encoding.WindowEncoder``).

    ``engine``: the ``RayEngine`` whose workers (started, or starting) do the work; it places,
    replaces and reports them."""

    def __init__(self, engine):
        self.engine = engine
        self.idle: list = []  # actors started and free
        self.parts_encoded = 0  # parts the workers returned (bench/ray_windows.py)
        self.workers_used: set[int] = set()  # id() of each actor that returned a part
        self.bytes_in = 0  # bytes of states the workers sent back
        self.bytes_out = 0  # bytes of tokens sent to them

    def encode(self, input_ids: torch.Tensor, plan: WindowPlan, sink: Callable[[torch.Tensor], None], *,
               batch_size: int, on_batch: Callable[[int], None] | None = None) -> None:
        """Every window of ``plan`` over ``input_ids`` [N] encoded by the workers; the kept states handed to
        ``sink`` in order (``encoding.encode_windows``'s contract)."""
        engine, ray = self.engine, self.engine.ray
        least_seconds = float(os.environ.get(SLOW_PART_ENV, "0") or 0)  # tests only: a real model's slow parts
        workers = max(1, engine.worker_count())
        parts = shard_windows(plan.n_windows, batch_size, PARTS_PER_WORKER * workers, MOST_WINDOWS_PER_PART)
        part_plans = [plan.part(first, stop) for first, stop in parts]  # (the part's own plan, its first token)
        pending = deque((index, 1) for index in range(len(parts)))  # (part, attempt), in order
        running: dict = {}  # object ref -> (actor, part, attempt)
        arrived: dict[int, torch.Tensor] = {}  # parts back before the store needs them
        next_part = 0
        while True:
            lookahead = LOOKAHEAD_PER_WORKER * max(1, len(self.idle) + len(running))
            while pending and self.idle and pending[0][0] < next_part + lookahead:  # first: no worker waits
                index, attempt = pending.popleft()
                part, offset = part_plans[index]
                ids = input_ids[offset:offset + part.n_tokens].numpy()
                actor = self.idle.pop()
                running[actor.encode_windows.remote(ids, part, batch_size, least_seconds)] = (actor, index, attempt)
                self.bytes_out += ids.nbytes
            while next_part in arrived:  # then the store, while the workers encode
                states = arrived.pop(next_part)
                part, _ = part_plans[next_part]
                for window in range(part.n_windows):  # the sink takes one window's kept states at a time
                    start, end = part.kept(window)
                    sink(states[start - part.keep_bounds[0]:end - part.keep_bounds[0]])
                next_part += 1
                if on_batch is not None:
                    on_batch(parts[next_part - 1][1])
            if next_part == len(parts):
                break
            engine._settle(working=bool(self.idle or running))
            if pending and not self.idle and not running and not engine._starting:
                raise UnlimisumError("no Ray worker is left to encode the book")
            ready, _ = ray.wait(list(running) + list(engine._starting), num_returns=1, timeout=engine.wait_seconds)
            for ref in ready:
                if ref in engine._starting:
                    engine._on_start(ref, self.idle)
                    continue
                actor, index, attempt = running.pop(ref)
                states = self._states(ref)
                if states is None:  # the worker died or stopped answering: replace it, hand its part on
                    self._lost(actor, index, attempt, pending)
                    continue
                self.idle.append(actor)
                self.workers_used.add(id(actor))
                arrived[index] = states
            engine._check_placement(self.idle, running)
        self.idle = []
        engine.release_workers()  # the summary is made here: their memory and CPUs go back to the cluster
        workers = len(self.workers_used)
        engine.runner.reporter.log(f"Ray: {plan.n_windows:,} windows encoded in {len(parts)} parts by {workers} "
                                   f"worker{'s' if workers != 1 else ''}; {self.bytes_in / 2**20:,.1f} MiB of states "
                                   f"came back, {self.bytes_out / 2**20:,.1f} MiB of tokens went out")

    def _states(self, ref) -> torch.Tensor | None:
        """A part's states, the worker's lines printed; None when the worker died or stopped answering."""
        ray = self.engine.ray
        try:
            (array, dtype), lines = ray.get(ref)
        except ray.exceptions.RayActorError:
            return None
        except ray.exceptions.RayTaskError as error:
            raise self.engine.task_error(error) from None
        for line in lines:
            self.engine.note_once(line)
        self.parts_encoded += 1
        self.bytes_in += array.nbytes
        return from_wire(array, dtype)

    def _lost(self, actor, index: int, attempt: int, pending: deque) -> None:
        engine = self.engine
        engine._end_actor(actor)  # nothing of a part is written anywhere: whether it ended changes nothing
        engine._actors.remove(actor)
        retries = engine.settings.max_retries
        if attempt > retries:
            raise WorkerDiedError(f"the Ray workers encoding a part of the book died {attempt} times "
                                  "(a node lost, or out of memory?)")
        engine.runner.reporter.note(f"unlimisum: a Ray worker died while encoding part {index + 1} of the book; "
                                    f"handing it to another (attempt {attempt + 1} of {retries + 1})")
        engine._start_worker()
        pending.appendleft((index, attempt + 1))
