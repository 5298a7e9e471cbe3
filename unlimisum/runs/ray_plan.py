"""How many Ray workers a run gets, and what each reserves: planned from what each node has free.

Every worker has the same shape: ``cpus`` CPUs (its torch threads), ``gpus`` GPUs and ``memory``
bytes. A node holds ``min(CPU // cpus, GPU // gpus, memory // MIN_WORKER_MEMORY)`` of them, and
the run uses at most the number asked (``--workers``, by default one per CPU the cluster has free)
and at most one per book. Without ``--cpus-per-worker`` the CPUs are shared out: ``cpus`` starts
at the cluster's free CPUs divided by the workers wanted and goes down until that many fit. Each
worker then reserves its node's free memory divided by the workers placed there (the smallest
such share over the nodes used), and its retrieval kernels budget that share, not the machine's
(``unlimisum.search.packed.MEMORY_LIMIT_ENV``).

Pure functions of the nodes' free resources (``ray._private.state.available_resources_per_node``
gives them): tested without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from unlimisum.errors import UnlimisumError

MIN_WORKER_MEMORY = 2 * 1024**3  # bytes a worker is planned with at least: a BART-base model and a long book's store
GIB = 1024**3


class WorkerPlacementError(UnlimisumError):
    """The Ray cluster has no room for a worker of the run's shape (CPUs, GPUs, memory)."""


@dataclass(frozen=True)
class NodeFree:
    """What one node of the cluster has free now."""

    node_id: str
    cpus: float  # free CPUs (Ray's logical "CPU" resource)
    gpus: float = 0.0  # free GPUs
    memory: float | None = None  # free bytes of Ray's "memory" resource; None: the node reports none


@dataclass(frozen=True)
class WorkerPlan:
    """The workers of a run: how many, what each reserves, and why fewer than asked when they are."""

    workers: int  # how many actors to start
    cpus: int  # CPUs each reserves: its torch threads
    gpus: float  # GPUs each reserves
    memory: int | None  # bytes each reserves and budgets its kernels with; None: unknown (no memory resource)
    per_node: dict  # node id -> workers planned there
    asked: int | None = None  # --workers, when given
    short_of: str = ""  # when fewer than wanted fit: the resources short ("CPU (1 free, 1 per worker)")

    def shape(self) -> str:
        """``2 CPUs, 1 GPU and 7.5 GiB memory``: what each worker reserves."""
        parts = [_count(self.cpus, "CPU")]
        if self.gpus:
            parts.append(_count(self.gpus, "GPU"))
        if self.memory is not None:
            parts.append(f"{self.memory / GIB:.1f} GiB memory")
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def plan_workers(nodes: list[NodeFree], books: int, *, workers: int | None = None, cpus_per_worker: int | None = None,
                 gpus_per_worker: float = 0.0, min_memory: int = MIN_WORKER_MEMORY) -> WorkerPlan:
    """The plan for ``books`` books on ``nodes``; WorkerPlacementError, naming the resource, when none fits."""
    fit_one = _fits(nodes, cpus_per_worker or 1, gpus_per_worker, min_memory)
    wanted = min(workers if workers is not None else max(fit_one, 1), max(books, 1))
    cpus = cpus_per_worker or _share(nodes, wanted, gpus_per_worker, min_memory)
    count = min(wanted, _fits(nodes, cpus, gpus_per_worker, min_memory))
    short = _short(nodes, wanted, cpus, gpus_per_worker, min_memory) if count < wanted else ""
    if cpus_per_worker is None and 0 < count < wanted:  # fewer workers fit (GPUs, memory): more CPUs each
        cpus = _share(nodes, count, gpus_per_worker, min_memory)
    if count == 0:
        raise WorkerPlacementError(
            f"the Ray cluster has no room for a worker: each needs {_needs(cpus, gpus_per_worker, min_memory)}, "
            f"and {describe_free(nodes)}" + (f"; short of {short}" if short else ""))
    per_node = _spread(nodes, count, cpus, gpus_per_worker, min_memory)
    by_id = {node.node_id: node for node in nodes}
    memory = None
    if all(by_id[node_id].memory is not None for node_id in per_node):
        memory = int(min(by_id[node_id].memory // placed for node_id, placed in per_node.items()))
    return WorkerPlan(workers=count, cpus=cpus, gpus=gpus_per_worker, memory=memory, per_node=per_node,
                      asked=workers, short_of=short)


def nodes_from_ray(available: dict, totals: dict | None = None) -> list[NodeFree]:
    """NodeFree of each node in Ray's ``{node id: {"CPU": 2.0, "memory": ..., ...}}``. Ray leaves out what
    is all taken: with the nodes' ``totals``, a resource a node has but not in ``available`` is 0 free."""
    nodes = []
    for node_id, free in sorted(available.items()):
        has_memory = "memory" in (totals or {}).get(node_id, free)
        nodes.append(NodeFree(node_id=node_id, cpus=float(free.get("CPU", 0.0)), gpus=float(free.get("GPU", 0.0)),
                              memory=float(free.get("memory", 0.0)) if has_memory else None))
    return nodes


def _share(nodes: list[NodeFree], workers: int, gpus: float, min_memory: int) -> int:
    """The most CPUs each of ``workers`` workers can have: the free CPUs divided by them, less until they fit."""
    cpus = max(1, sum(int(node.cpus) for node in nodes) // max(workers, 1))
    while cpus > 1 and _fits(nodes, cpus, gpus, min_memory) < workers:
        cpus -= 1
    return cpus


def _node_fits(node: NodeFree, cpus: int, gpus: float, min_memory: int) -> int:
    limits = [int(node.cpus // cpus)]
    if gpus:
        limits.append(int(node.gpus // gpus))
    if node.memory is not None:
        limits.append(int(node.memory // min_memory))
    return max(0, min(limits))


def _fits(nodes: list[NodeFree], cpus: int, gpus: float, min_memory: int) -> int:
    return sum(_node_fits(node, cpus, gpus, min_memory) for node in nodes)


def _spread(nodes: list[NodeFree], count: int, cpus: int, gpus: float, min_memory: int) -> dict:
    """``count`` workers over the nodes, one at a time to the node with the most room left."""
    room = {node.node_id: _node_fits(node, cpus, gpus, min_memory) for node in nodes}
    placed: dict = {}
    for _ in range(count):
        node_id = max(room, key=lambda key: (room[key], key))
        room[node_id] -= 1
        placed[node_id] = placed.get(node_id, 0) + 1
    return placed


def _short(nodes: list[NodeFree], wanted: int, cpus: int, gpus: float, min_memory: int) -> str:
    """Which resources keep the plan under ``wanted`` workers: ``CPU (1 free, 2 per worker)``."""
    totals = {"CPU": (sum(node.cpus for node in nodes), cpus), "GPU": (sum(node.gpus for node in nodes), gpus)}
    if any(node.memory is not None for node in nodes):
        totals["memory"] = (sum(node.memory or 0 for node in nodes), min_memory)
    short = []
    for resource, (free, each) in totals.items():
        if not each:
            continue
        alone = [_resource_fits(node, resource, each) for node in nodes]
        if sum(alone) < wanted:
            short.append(f"{resource} ({_amount(resource, free)} free, {_amount(resource, each)} per worker)")
    return ", ".join(short)


def _resource_fits(node: NodeFree, resource: str, each: float) -> int:
    free = {"CPU": node.cpus, "GPU": node.gpus, "memory": node.memory or 0}[resource]
    return int(free // each)


def _needs(cpus: int, gpus: float, min_memory: int) -> str:
    parts = [_count(cpus, "CPU")] + ([_count(gpus, "GPU")] if gpus else []) + [f"{min_memory / GIB:.1f} GiB memory"]
    return ", ".join(parts)


def describe_free(nodes: list[NodeFree]) -> str:
    """``its node has free CPU 1, GPU 0, memory 15.9 GiB``."""
    if not nodes:
        return "it has no live node"
    parts = [f"CPU {sum(node.cpus for node in nodes):g}", f"GPU {sum(node.gpus for node in nodes):g}"]
    if any(node.memory is not None for node in nodes):
        parts.append(f"memory {sum(node.memory or 0 for node in nodes) / GIB:.1f} GiB")
    where = "its node" if len(nodes) == 1 else f"its {len(nodes)} nodes"
    return f"{where} {'has' if len(nodes) == 1 else 'have'} free {', '.join(parts)}"


def _amount(resource: str, value: float) -> str:
    return f"{value / GIB:.1f} GiB" if resource == "memory" else f"{value:g}"


def _count(value: float, unit: str) -> str:
    return f"{value:g} {unit}{'s' if value != 1 else ''}"
