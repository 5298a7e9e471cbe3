"""The compiled sums over the states (unlimisum/search/compiled.py): the fp32 sums of the stored numbers,
as torch takes them from the widened states, for the gather of each query's top-k and for the dense pass (over
the states, or per head over a layer's values); the compiled top-k of score rows, as torch.topk takes it; and the
compiled matrix-vector products of a step's linear layers, as F.linear takes them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from unlimisum import measurements
from unlimisum.search import compiled, kernels


@pytest.mark.parametrize("dtype", compiled.SCAN_DTYPES)
def test_the_compiled_kernels_run_here(dtype):
    """numba is a dependency: where its kernels do not compile or disagree with torch, this fails (the tool would
    fall back to the torch kernels, slower on a CPU without 16-bit units)."""
    assert [kernel for kernel in compiled.KERNELS if not compiled.ready(kernel, dtype)] == []
    assert compiled.pending(compiled.KERNELS, dtype) == []
    assert not compiled.ready("select", torch.float16)  # float16 keys keep the torch kernels and faiss


def test_a_compiled_kernel_leaves_torch_the_threads_it_was_given():
    """numba's OpenMP pool, started by the first compiled call of a process, set the calling thread's OpenMP
    thread count to the pool's size (the CPU count), which torch read as its own: a process set to 1 thread ran
    torch on every core after its first compiled kernel on that thread (the suite's own 1 thread, conftest.py,
    became 2 after the first compiled test). In a process of its own, where the pool has not started."""
    script = textwrap.dedent("""
        import torch
        torch.set_num_threads(1)
        torch.ones(64, 64) @ torch.ones(64, 64)  # torch has run on this thread, as a worker's encoding has
        from unlimisum.search import compiled
        assert compiled.ready("top_k", torch.float32)
        compiled.top_k(torch.randn(2, 20_000), 100)
        print(torch.get_num_threads())
    """)
    env = dict(os.environ, NUMBA_NUM_THREADS="2")  # a pool larger than torch's 1 on any machine
    found = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["1"]


def test_an_unknown_kernel_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown compiled kernel 'gather'.*select, select_grouped"):
        compiled.ready("gather", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 7, 64])  # 7: four states at a time, then three one by one
def test_the_weighted_sum_of_chosen_states_is_torchs_fp32_sum(dtype, k):
    generator = torch.Generator().manual_seed(1)
    book = torch.randn(900, 24, generator=generator).to(dtype)  # [N, d]
    states = book[100:700]  # a chapter's view
    ids = torch.randint(0, 600, (5, k), generator=generator)  # [nq, k], repeats included
    weights = torch.rand(5, k, generator=generator)
    expected = torch.einsum("qk,qkd->qd", weights, states.float()[ids])
    torch.testing.assert_close(compiled.weighted_sum(states, ids, weights), expected)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)  # widens: the path that calls it on a CPU
    torch.testing.assert_close(kernels.gathered_attention(states, ids, weights, shared.widens, False), expected)


def test_a_state_id_outside_the_store_is_refused_not_read():
    states = torch.randn(10, 8)
    with pytest.raises(IndexError, match="0..9"):
        compiled.weighted_sum(states, torch.tensor([[3, 10]]), torch.ones(1, 2))
    with pytest.raises(IndexError):
        compiled.weighted_sum(states, torch.tensor([[-1]]), torch.ones(1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 1027, 5000])  # fewer than four rows; a remainder; rows split among threads
def test_the_dense_sum_is_the_weights_times_the_widened_states(dtype, n):
    generator = torch.Generator().manual_seed(2)
    states = torch.randn(n, 16, generator=generator).to(dtype)
    weights = torch.softmax(torch.randn(6, n, generator=generator), dim=1)  # [nq, N]
    expected = weights @ states.float()
    torch.testing.assert_close(compiled.dense_sum(states, weights), expected)
    choice = kernels.KernelChoice("float32", 256, False, 1e-9, 1e-9)
    torch.testing.assert_close(kernels.dense_values(states, weights, choice), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 1027])
def test_the_dense_sum_per_head_is_each_heads_weights_times_its_widened_values(dtype, n):
    generator = torch.Generator().manual_seed(3)
    book = torch.randn(5, n + 200, 8, generator=generator).to(dtype)  # [H, N, dh]
    values = book[:, 100:100 + n]  # a chapter's view: each head's rows at an offset into its block
    weights = torch.softmax(torch.randn(5, 3, n, generator=generator), dim=2)  # [H, nq, N]
    expected = torch.bmm(weights, values.float())
    torch.testing.assert_close(compiled.head_dense_sum(values, weights), expected)
    assert compiled.head_dense_sum(values, weights[:, :0]).shape == (5, 0, 8)


def _softmax_values(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T) V per head in fp64 from the stored numbers, as fp32: the reference of ``attend_dense``."""
    weights = torch.softmax(torch.einsum("hqd,hnd->hqn", queries.double(), keys.double()), dim=2)
    return torch.einsum("hqn,hnd->hqd", weights, values.double()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_dim,value_dim", [(8, 8), (16, 16), (64, 64), (80, 48), (12, 20)])  # vectors or not
@pytest.mark.parametrize("queries", [1, 3, 4, 5, 9])  # 4 at a time, then 1 to 3
@pytest.mark.parametrize("n", [3, 1027, 2600])  # fewer than 8 rows; blocks of 1024 and a remainder
def test_dense_attention_in_one_pass_is_the_softmax_of_the_scores_times_the_values(dtype, key_dim, value_dim,
                                                                                  queries, n):
    generator = torch.Generator().manual_seed(4)
    book_keys = torch.randn(3, n + 50, key_dim, generator=generator).to(dtype)
    book_values = torch.randn(3, n + 50, value_dim, generator=generator).to(dtype)
    keys, values = book_keys[:, 50:], book_values[:, 50:]  # a chapter's view: each head's rows at an offset
    scale = torch.tensor([0.1, 1.0, 4.0]).view(3, 1, 1)  # flat, ordinary and peaked weights
    query_rows = torch.randn(3, queries, key_dim, generator=generator) * scale
    if n > 2048:  # a key in the last block far above the others: every earlier block's sums rescaled to it
        keys = keys.clone()
        keys[1, n - 5] = (query_rows[1, 0] * 3).to(dtype)
    got = compiled.attend_dense(keys, values, query_rows)
    # fp32 scores of up to ~100 are within ~2e-5 of their fp64 ones (from 8 queries on, bfloat16 keys, each score
    # one chain of dh products: 1.3e-5 seen), and so are their weights (relative)
    expected = _softmax_values(keys, values, query_rows)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
    coverage = torch.full((n,), 0.5)  # added to, as a generation's running count is
    kept = torch.full((3 * queries * n + 7,), float("nan"))  # a reused buffer, larger than needed
    torch.testing.assert_close(compiled.attend_dense(keys, values, query_rows, coverage, kept), got)
    weights = torch.softmax(torch.einsum("hqd,hnd->hqn", query_rows.double(), keys.double()), dim=2)
    torch.testing.assert_close(coverage, 0.5 + weights.sum(dim=(0, 1)).float(), rtol=1e-4, atol=1e-5)


def test_dense_attention_in_one_pass_floors_exp_as_the_online_softmax_does_and_zeroes_a_nan_row():
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3000, 16, generator=generator).bfloat16()
    values = torch.randn(2, 3000, 16, generator=generator).bfloat16()
    queries = torch.randn(2, 4, 16, generator=generator) * 40  # most weights below e^-87 of the largest
    expected = _softmax_values(keys, values, queries)
    torch.testing.assert_close(compiled.attend_dense(keys, values, queries), expected, rtol=1e-4, atol=1e-5)
    queries[1, 2, 3] = float("nan")  # every score of one query NaN: its row zeros (as nan_to_num makes it), the
    got = compiled.attend_dense(keys, values, queries)  # other rows as they were
    assert got[1, 2].eq(0).all()
    expected[1, 2] = 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    coverage = torch.zeros(3000)  # the NaN query adds nothing; every other query's weights sum to one
    compiled.attend_dense(keys, values, queries, coverage)
    torch.testing.assert_close(coverage.sum(), torch.tensor(7.0))


def test_dense_attention_in_one_pass_refuses_values_it_cannot_pair_with_the_keys():
    keys = torch.randn(2, 10, 8).bfloat16()
    with pytest.raises(ValueError, match="values"):
        compiled.attend_dense(keys, torch.randn(2, 10, 8), torch.randn(2, 1, 8))  # fp32 values, bfloat16 keys
    with pytest.raises(ValueError, match="values"):
        compiled.attend_dense(keys, torch.randn(2, 9, 8).bfloat16(), torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="kept"):
        compiled.attend_dense(keys, keys, torch.randn(2, 1, 8), torch.zeros(10), torch.empty(19))  # 20 needed
    assert compiled.attend_dense(keys[:, :0], keys[:, :0], torch.randn(2, 3, 8)).shape == (2, 3, 8)


def test_the_states_it_cannot_read_stay_with_torch():
    assert compiled.usable_states(torch.randn(4, 8).bfloat16()) and compiled.usable_states(torch.randn(4, 7))
    assert not compiled.usable_states(torch.randn(4, 7).bfloat16())  # an odd width has no whole 32-bit words
    assert not compiled.usable_states(torch.randn(4, 8).half())
    states = torch.randn(40, 7).bfloat16()
    ids, weights = torch.randint(0, 40, (2, 5)), torch.rand(2, 5)
    torch.testing.assert_close(kernels.gathered_attention(states, ids, weights, True, False),
                               torch.einsum("qk,qkd->qd", weights, states.float()[ids]))


@pytest.mark.parametrize("dtype", compiled.SCAN_DTYPES)
@pytest.mark.parametrize("queries_per_head", [1, 7])  # one at a time, and the explicit vectors (four, then three)
def test_the_top_k_holds_only_real_candidates_where_fewer_scores_are_numbers(dtype, queries_per_head):
    """A row of -inf or NaN scores has no candidates: the scan returns the ones that are numbers and marks the
    rest -inf with id 0 (weight 0 in a softmax), never an entry of memory it did not write."""
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(3, 700, 16, generator=generator)  # [H, n, dh]
    queries = torch.randn(3, queries_per_head, 16, generator=generator).abs() + 0.1  # every dimension positive
    keys[0, 3:, 0] = float("-inf")  # head 0: three finite scores, the rest -inf
    keys[1, :, 0] = float("nan")  # head 1: every score NaN
    keys[2, 100:, 0] = float("-inf")
    keys[2, 10, 0] = float("nan")  # head 2: 99 numbers (one NaN among the first hundred)
    keys = keys.to(dtype)
    for attempt in range(3):  # fresh outputs each time: garbage would differ from call to call
        scores, ids = compiled.select(keys, queries, 5)
        expected = torch.einsum("hqd,hnd->hqn", queries, keys.float())
        head0 = scores[0].sort(dim=1, descending=True)
        assert torch.equal(head0.values[:, 3:], torch.full((queries_per_head, 2), float("-inf")))
        assert torch.equal(ids[0].gather(1, head0.indices)[:, 3:], torch.zeros(queries_per_head, 2, dtype=torch.long))
        assert sorted(ids[0, 0][head0.indices[0, :3]].tolist()) == [0, 1, 2]
        torch.testing.assert_close(head0.values[:, :3], expected[0, :, :3].sort(dim=1, descending=True).values)
        assert torch.equal(scores[1], torch.full((queries_per_head, 5), float("-inf")))
        assert torch.equal(ids[1], torch.zeros(queries_per_head, 5, dtype=torch.long))
        top = expected[2].nan_to_num(float("-inf")).topk(5, dim=1)
        found = scores[2].sort(dim=1, descending=True)
        torch.testing.assert_close(found.values, top.values)
        assert torch.equal(ids[2].gather(1, found.indices), top.indices)


# --- the compiled top-k of score rows (unlimisum/search/top_k_loops.py) -----------------------------------------


def _assert_top_k_of(scores: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor) -> None:
    """values/ids [rows, k] are a top-k of scores [rows, n] as torch.topk takes it: the same values (NaN first),
    each id distinct and holding its value."""
    expected = scores.topk(k, dim=1).values.nan_to_num(9e9, posinf=8e9, neginf=-8e9)
    found = values.nan_to_num(9e9, posinf=8e9, neginf=-8e9)
    assert torch.equal(found.sort(dim=1, descending=True).values, expected)
    assert torch.equal(scores.gather(1, ids).nan_to_num(9e9, posinf=8e9, neginf=-8e9), found)
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("rows,n,k", [(6, 20_000, 1_024), (5, 16_384, 1_123), (3, 4_096, 1), (4, 300, 299),
                                      (2, 40, 40), (3, 100_000, 1_024), (7, 3_200, 16)])
def test_the_compiled_top_k_is_torchs_top_k(rows, n, k):
    """Rows long enough for a sampled floor (n >= 256), rows without one, k = 1, k = n, k a large share of n."""
    generator = torch.Generator().manual_seed(6)
    scores = torch.randn(rows, n, generator=generator)
    values, ids = compiled.top_k(scores, k)
    _assert_top_k_of(scores, k, values, ids)


def test_the_compiled_top_k_breaks_ties_and_keeps_infinities_and_nans_as_torch_orders_them():
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(6, 5_000, generator=generator)
    scores[0] = torch.randint(0, 4, (5_000,), generator=generator).float()  # four values, ties across the k-th
    scores[1, ::7] = float("inf")  # more infinities than k
    scores[2, 3:] = float("-inf")  # three numbers, the rest -inf: -inf among the top k
    scores[3, 4_000] = float("nan")  # NaN: torch orders it first (the row is left to torch)
    scores[4, ::2] = float("-inf")  # every sampled score -inf: no sampled floor
    scores[5, 1::2] = 3.0e38  # numbers whose span is no float
    scores[5, ::2] = -3.0e38
    for k in (5, 700):
        values, ids = compiled.top_k(scores, k)
        _assert_top_k_of(scores, k, values, ids)


def test_a_sample_that_misjudges_the_row_falls_back_to_the_whole_row():
    """The sampled scores (evenly apart: here every odd column) far above the rest put the floor so high that
    fewer than k reach it: the row is kept again from -inf, and the top-k is still exact."""
    generator = torch.Generator().manual_seed(8)
    scores = torch.randn(2, 4_096, generator=generator)
    scores[:, 1::2] += 100.0  # 2,048 sampled-column scores; 1,024 of them sampled
    values, ids = compiled.top_k(scores, 3_000)  # beyond the odd columns' 2,048: the floor must drop to -inf
    _assert_top_k_of(scores, 3_000, values, ids)


def test_masked_scores_among_the_sampled_ones_leave_the_floor_to_the_others():
    """A support reading's hidden columns (-inf) where the sample falls: the floor is the other samples' (finite,
    under the row's k-th largest: the row is not kept whole); with fewer than the rank left, -inf; exact both
    ways."""
    from unlimisum.search import top_k_loops

    generator = torch.Generator().manual_seed(11)
    n, k, spread = 16_384, 1_024, top_k_loops.SAMPLE_SCORES
    rank = top_k_loops.sample_rank(spread, n, k)
    scores = torch.randn(2, n, generator=generator)
    sampled = torch.arange(spread) * 2 * n // (2 * spread) + n // (2 * spread)  # the sampled columns
    scores[0, sampled[:300]] = float("-inf")  # 300 of 1,024 sampled scores masked
    scores[1, sampled[:spread - rank + 1]] = float("-inf")  # fewer than the rank left
    floors = [top_k_loops._sampled_floor(row.numpy(), spread, rank) for row in scores]
    assert -np.inf < floors[0] <= scores[0].topk(k).values[-1] and floors[1] == -np.inf
    values, ids = compiled.top_k(scores, k)
    _assert_top_k_of(scores, k, values, ids)


def test_the_kernels_top_k_runs_compiled_for_long_rows_once_ready():
    assert compiled.ready("top_k", torch.float32)
    assert compiled.is_ready("top_k") and compiled.ready("top_k", torch.bfloat16)  # one kernel for every store
    generator = torch.Generator().manual_seed(9)
    scores = torch.randn(4, kernels.COMPILED_MIN_STATES + 5, generator=generator)
    assert kernels._compiled_top_k(scores, 1_024)
    assert kernels._compiled_top_k(scores[:, :kernels.COMPILED_TOP_K_MIN_STATES].contiguous(), 1_024)
    assert not kernels._compiled_top_k(scores[:, :kernels.COMPILED_TOP_K_MIN_STATES - 1].contiguous(), 1_024)
    values, ids = kernels.top_k(scores, 1_024, ordered=False)
    assert torch.equal(ids, compiled.top_k(scores, 1_024)[1])
    _assert_top_k_of(scores, 1_024, values, ids)
    ordered = kernels.top_k(scores, 1_024)  # sorted: torch's
    assert torch.equal(ordered.values, scores.topk(1_024, dim=1).values)


# --- the blocked weighted sum: many queries choosing the same states -----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,nq,k", [(3_000, 40, 301), (2_500, 9, 1_200), (1_100, 5, 1_100)])
def test_the_blocked_weighted_sum_is_torchs_fp32_sum(dtype, n, nq, k):
    """Each state chosen BLOCKED_SUMS_MIN_READS times or more on average: the sums go block by block of the
    states (1,024 a block: up to 3, the last partial); ids in any order, repeats included; k not a multiple of 4;
    the queries in a share per thread (5 queries: uneven shares)."""
    assert nq * k >= compiled.BLOCKED_SUMS_MIN_READS * n
    generator = torch.Generator().manual_seed(10)
    states = torch.randn(n, 24, generator=generator).to(dtype)
    ids = torch.randint(0, n, (nq, k), generator=generator)
    weights = torch.rand(nq, k, generator=generator)
    expected = torch.einsum("qk,qkd->qd", weights.double(), states.double()[ids]).float()
    torch.testing.assert_close(compiled.weighted_sum(states, ids, weights), expected, rtol=1e-5, atol=1e-4)


def test_a_reading_sums_its_many_queries_compiled_and_a_step_its_few_as_measured():
    """The 16-bit gather (the native kernel's: embedding_bag, sums rounded to bfloat16) gives way to the compiled
    fp32 sums where the queries choose each state several times (a reading's many positions at once)."""
    generator = torch.Generator().manual_seed(11)
    n = kernels.COMPILED_MIN_STATES
    states = torch.randn(n, 32, generator=generator).bfloat16()
    many = torch.randint(0, n, (64, 1_024), generator=generator)  # 4 reads a state
    few = many[:8]
    weights = torch.rand(64, 1_024, generator=generator)
    assert torch.equal(kernels.gathered_attention(states, many, weights, False), compiled.weighted_sum(states, many,
                                                                                                       weights))
    bags = torch.nn.functional.embedding_bag(few, states, mode="sum", per_sample_weights=weights[:8].bfloat16())
    assert torch.equal(kernels.gathered_attention(states, few, weights[:8], False), bags.float())


_MEASURE_TILED_FROM = compiled.measure_tiled_from  # the real one, as tests find it before they replace it


class _RacedScan:
    """compiled._scan_heads_bf16 (or _select_grouped_heads_bf16) in a race of where the keys go into the lanes,
    timed by a clock of our own: four queries at a time cost 0.25 a query, the keys in the lanes 5 whatever the
    count (so the lanes win from 32)."""

    def __init__(self):
        self.calls = 0
        self.lanes = None
        self.signatures = ["compiled"]  # as numba's dispatcher says of a kernel compiled in this process

    def __call__(self, rows, heads, pitch, n, even, odd, tiled_from, *rest):
        self.calls += 1
        self.count = even.shape[1]
        self.lanes = tiled_from <= self.count

    def timer(self, run) -> float:
        run()
        return 5.0 if self.lanes else 0.25 * self.count


@pytest.fixture
def raced(monkeypatch, tmp_path):
    assert compiled.ready("select", torch.bfloat16)  # checked on the real scan, before it is replaced
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))  # this test's own measurements
    monkeypatch.setattr(compiled, "_TILED_FROM", {})
    scan = _RacedScan()
    monkeypatch.setattr(compiled, "_scan_heads_bf16", scan)
    monkeypatch.setattr(compiled, "measure_tiled_from",
                        lambda head_dim: _MEASURE_TILED_FROM(head_dim, timer=scan.timer, n=compiled.TILED_KEYS // 8))
    return scan


def test_where_many_queries_put_the_keys_in_the_lanes_is_measured_once_per_machine_and_kept(raced):
    assert compiled.tiled_from(64) == 32  # 8 and 16 queries: four at a time faster; 32: the lanes
    calls = raced.calls
    assert compiled.tiled_from(64) == 32 and raced.calls == calls  # this process's answer
    compiled._TILED_FROM.clear()  # a later process: the kept measurement, nothing raced
    assert compiled.tiled_from(64) == 32 and raced.calls == calls
    kept = measurements.default_store().get("scan keys in the lanes, dh=64")
    assert kept.value == 32 and "8 queries: in the lanes 5000.00 ms, four at a time 2000.00 ms" in kept.reason
    compiled.tiled_from(128)  # another head width, measured on its own
    assert raced.calls > calls


def test_until_the_scan_runs_no_measurement_compiles_it(raced, monkeypatch):
    monkeypatch.setattr(compiled, "_READY", {})
    raced.signatures = []  # not compiled in this process
    grouped = _RacedScan()
    grouped.signatures = []
    monkeypatch.setattr(compiled, "_select_grouped_heads_bf16", grouped)
    assert compiled.tiled_from(64) == compiled.TILED_MIN_QUERIES and raced.calls == grouped.calls == 0
    assert measurements.default_store().get("scan keys in the lanes, dh=64") is None


def test_where_only_the_grouped_select_runs_it_is_raced_in_groups_of_one(raced, monkeypatch):
    """Decoder-only generation compiles the grouped select alone: the race times it, a group of one a row."""
    monkeypatch.setattr(compiled, "_READY", {})
    raced.signatures = []
    grouped = _RacedScan()
    monkeypatch.setattr(compiled, "_select_grouped_heads_bf16", grouped)
    monkeypatch.setattr(compiled, "measure_tiled_from",
                        lambda head_dim: _MEASURE_TILED_FROM(head_dim, timer=grouped.timer,
                                                             n=compiled.TILED_KEYS // 8))
    assert compiled.tiled_from(64) == 32 and raced.calls == 0 and grouped.calls > 0
    assert "the grouped select's" in measurements.default_store().get("scan keys in the lanes, dh=64").reason


def test_where_the_lanes_never_win_the_raced_counts_many_queries_sum_four_at_a_time(raced, monkeypatch):
    monkeypatch.setattr(raced, "timer", lambda run: (run(), 5.0 if raced.lanes else 0.01)[1])
    assert compiled.tiled_from(64) == compiled.TILED_ALWAYS


def test_a_race_of_kernels_takes_the_measurement_first_only_where_it_will_be_asked(raced):
    for keys, queries in ((torch.zeros(2, 10, 64), 8), (torch.zeros(2, 10, 64, dtype=torch.bfloat16), 4),
                          (torch.zeros(2, 10, 64, dtype=torch.bfloat16), compiled.TILED_ALWAYS)):
        compiled.measure_before_timing(keys, queries)  # float32 keys; fewer queries; the lanes whatever it says
    assert raced.calls == 0 and compiled._TILED_FROM == {}
    compiled.measure_before_timing(torch.zeros(2, 10, 64, dtype=torch.bfloat16), 8)
    assert raced.calls > 0 and compiled._TILED_FROM == {64: 32}


def test_the_measurement_races_the_real_scan_both_ways():
    """On this machine, a small store: an answer among the counts raced, with what each way took."""
    assert compiled.ready("select", torch.bfloat16)
    found, reason = compiled.measure_tiled_from(64, n=2048)
    assert found in (*compiled.TILED_RACED_QUERIES, compiled.TILED_ALWAYS)
    raced = [count for count in compiled.TILED_RACED_QUERIES if count <= found]
    assert all(f"{count} queries: in the lanes" in reason for count in raced)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_the_compiled_linear_product_is_f_linears(dtype, count, bias, two_threads):
    """Each number summed in fp32 and rounded once to the weight's dtype: in bfloat16 torch's product but where the
    fp32 sums round apart (the sum's order), in float32 within fp32 rounding; 1001 outputs over two threads."""
    generator = torch.Generator().manual_seed(count)
    weight = torch.randn(1001, 96, generator=generator).to(dtype)
    added = torch.randn(1001, generator=generator).to(dtype) if bias else None
    rows = torch.randn(count, 2, 96, generator=generator).to(dtype)[:, 1]  # rows of a larger tensor
    product = compiled.linear(rows, weight, added)
    assert product.dtype == dtype and product.shape == (count, 1001)
    exact = (rows.double() @ weight.double().t() + (added.double() if bias else 0.0)).to(dtype)
    if dtype == torch.bfloat16:
        assert (product == exact).float().mean() > 0.99  # one rounding of the fp32 sum: rarely across a boundary
        torch.testing.assert_close(product, torch.nn.functional.linear(rows, weight, added), atol=0.05, rtol=0.02)
    else:
        torch.testing.assert_close(product, torch.nn.functional.linear(rows, weight, added))
    kept = compiled.linear_operands(weight, added)
    assert torch.equal(compiled.linear(rows, weight, added, kept), product)  # the kept operands read alike


def test_the_compiled_linear_product_rounds_to_nearest_even_and_keeps_nan_and_infinity():
    """bfloat16 sums at a tie round to the even neighbour (as torch rounds), a NaN stays a NaN, inf stays inf."""
    weight = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=torch.bfloat16)
    bias = torch.tensor([0.0, float("nan"), float("inf"), -float("inf")])
    rows = torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16)
    product = compiled.linear(rows, weight, bias.to(torch.bfloat16))
    assert product[0, 0] == 1 and product[0, 1].isnan() and product[0, 2] == float("inf")
    assert product[0, 3] == -float("inf")
    # 1 + 2^-8 lies halfway between bfloat16 1 and 1 + 2^-7: to the even one, 1; 1 + 3 * 2^-8 to 1 + 2^-6
    words = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    for low, expected in ((2.0 ** -8, 1.0), (3 * 2.0 ** -8, 1.0 + 2.0 ** -6)):
        halves = torch.tensor([[1.0, low]]).to(torch.bfloat16)  # low is exact in bfloat16 (a power of two times 1 or 3)
        assert compiled.linear(halves, words).item() == expected == torch.tensor(1.0 + low).to(torch.bfloat16).item()
