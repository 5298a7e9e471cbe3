"""Planning a Ray run's workers from what each node has free (unlimisum.runs.ray_plan): no Ray needed."""

from __future__ import annotations

import pytest

from unlimisum.runs.ray_plan import GIB, NodeFree, WorkerPlacementError, nodes_from_ray, plan_workers
from unlimisum.search import packed

BIG = NodeFree("big", cpus=16, memory=64 * GIB)
SMALL = NodeFree("small", cpus=2, memory=8 * GIB)


def test_a_cluster_smaller_than_asked_gets_what_fits_and_says_what_is_short():
    plan = plan_workers([NodeFree("one", cpus=1, memory=16 * GIB)], books=3, workers=2)
    assert (plan.workers, plan.cpus, plan.asked) == (1, 1, 2)
    assert plan.short_of == "CPU (1 free, 1 per worker)"
    gpu = plan_workers([NodeFree("a", cpus=8, gpus=1, memory=32 * GIB)], books=4, workers=3, gpus_per_worker=1)
    assert (gpu.workers, gpu.cpus, gpu.short_of) == (1, 8, "GPU (1 free, 1 per worker)")


def test_no_room_is_an_error_naming_the_resource():
    with pytest.raises(WorkerPlacementError) as error:
        plan_workers([NodeFree("a", cpus=4, gpus=0, memory=32 * GIB)], books=2, gpus_per_worker=1)
    assert "no room for a worker: each needs 1 CPU, 1 GPU, 2.0 GiB memory" in str(error.value)
    assert "short of GPU (0 free, 1 per worker)" in str(error.value)
    with pytest.raises(WorkerPlacementError, match=r"short of CPU \(0 free"):
        plan_workers([NodeFree("a", cpus=0, memory=32 * GIB)], books=2)
    with pytest.raises(WorkerPlacementError, match=r"short of memory \(1.0 GiB free, 2.0 GiB per worker\)"):
        plan_workers([NodeFree("a", cpus=8, memory=1 * GIB)], books=2)


def test_cpus_are_shared_out_among_the_workers():
    assert (plan_workers([BIG], books=100, workers=2).cpus, plan_workers([BIG], books=100, workers=3).cpus) == (8, 5)
    default = plan_workers([BIG], books=100)  # one worker per free CPU, one thread each
    assert (default.workers, default.cpus) == (16, 1)
    few_books = plan_workers([BIG], books=4)  # at most one worker per book: the CPUs go to threads instead
    assert (few_books.workers, few_books.cpus) == (4, 4)
    # 18 CPUs over 4 workers: 4 each fit on the big node only (the small one has 2)
    spread = plan_workers([BIG, SMALL], books=10, workers=4)
    assert (spread.workers, spread.cpus, spread.per_node) == (4, 4, {"big": 4})
    nine = plan_workers([BIG, SMALL], books=10, workers=9)
    assert (nine.workers, nine.cpus, nine.per_node) == (9, 2, {"big": 8, "small": 1})
    fixed = plan_workers([BIG, SMALL], books=100, cpus_per_worker=3)
    assert (fixed.workers, fixed.cpus, fixed.per_node) == (5, 3, {"big": 5})


def test_memory_is_a_per_node_share_and_limits_the_workers():
    plan = plan_workers([BIG], books=100, workers=4)
    assert plan.memory == 16 * GIB  # a quarter of the node's free memory each
    crowded = NodeFree("a", cpus=16, memory=8 * GIB)
    default = plan_workers([crowded], books=100)
    assert (default.workers, default.cpus, default.memory) == (4, 4, 2 * GIB)  # not 16 workers of 0.5 GiB
    asked = plan_workers([crowded], books=100, workers=16)
    assert (asked.workers, asked.cpus, asked.memory) == (4, 4, 2 * GIB)  # the CPUs of the 12 left out shared
    assert asked.short_of == "memory (8.0 GiB free, 2.0 GiB per worker)"
    two_nodes = plan_workers([BIG, SMALL], books=100, workers=9)
    assert two_nodes.memory == 8 * GIB  # the smallest share over the nodes used: 64/8 and 8/1
    assert plan_workers([NodeFree("a", cpus=4)], books=2).memory is None  # a node that reports no memory


def test_nodes_from_rays_view():
    nodes = nodes_from_ray({"n2": {"CPU": 1.0, "memory": 5e9, "node:x": 1.0}, "n1": {"GPU": 2.0}})
    assert nodes == [NodeFree("n1", cpus=0.0, gpus=2.0, memory=None), NodeFree("n2", cpus=1.0, gpus=0.0, memory=5e9)]
    # all of a node's memory and CPUs taken: Ray leaves them out of what is free, the totals still have them
    taken = nodes_from_ray({"n1": {"GPU": 2.0}}, totals={"n1": {"CPU": 4.0, "GPU": 2.0, "memory": 5e9}})
    assert taken == [NodeFree("n1", cpus=0.0, gpus=2.0, memory=0.0)]


def test_the_packed_kernel_budgets_a_workers_share_of_memory(monkeypatch):
    """The copies may take an eighth of what is left beside the process: of the machine alone, of its
    share when a Ray worker (margins of ~40 MB cover the resident set moving between the calls)."""
    monkeypatch.delenv(packed.MEMORY_LIMIT_ENV, raising=False)
    machine = packed.usable_memory()
    assert machine and machine > 2 * GIB
    per_token = 2 * packed.BYTES_PER_NUMBER * 768

    def fitting(usable: int) -> int:
        return int(packed.PACKED_MEMORY_FRACTION * (usable - packed.resident_memory()) / per_token)

    tokens = fitting(machine) - 10_000
    assert packed.memory_allows(tokens, 768)  # alone on the machine
    monkeypatch.setenv(packed.MEMORY_LIMIT_ENV, str(machine // 4))  # one of four workers on this node
    assert packed.usable_memory() == machine // 4
    assert not packed.memory_allows(tokens, 768)
    assert packed.memory_allows(fitting(machine // 4) - 10_000, 768)