"""Datastore: exact search equals brute force, values are one 16-bit copy, placement policy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unlimisum.search import kernels
from unlimisum.search import packed as packing
from unlimisum.config import IndexConfig
from unlimisum.search.datastore import DatastoreBuilder, IndexPlan, attention_mass_recall, plan_index
from unlimisum.errors import ConfigError

CPU = IndexPlan("exact", "cpu", "test")


def clustered_states(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n, d] states around 64 topic centres, with a shared offset (like encoder outputs)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(64, d, generator=g)
    topic = torch.randint(0, 64, (n,), generator=g)
    return 0.5 * torch.randn(d, generator=g) + centres[topic] + 0.7 * torch.randn(n, d, generator=g)


def queries_near(states: torch.Tensor, nq: int, seed: int = 1) -> torch.Tensor:
    """[nq, d] queries: random rank-16 projections of stored states plus noise."""
    g = torch.Generator().manual_seed(seed)
    n, d = states.shape
    w_q, w_k = (torch.randn(nq, d, 16, generator=g) / d**0.5 for _ in range(2))
    anchors = states[torch.randint(0, n, (nq,), generator=g)]
    q = torch.einsum("qd,qde,qfe->qf", anchors, w_q, w_k) * 3
    return q + 0.1 * q.norm(dim=1, keepdim=True) / d**0.5 * torch.randn(nq, d, generator=g)


def build(states: torch.Tensor, plan: IndexPlan = CPU, config: IndexConfig = IndexConfig(), chunks=None):
    builder = DatastoreBuilder(states.shape[0], states.shape[1], plan, config)
    for chunk in states.split(chunks if chunks is not None else states.shape[0]):  # int or list of sizes
        builder.add(chunk)
    return builder.finish()


@pytest.fixture(params=["native", "native-tokens-major", "native-bmm-gather", "float32", "packed"])
def kernel(request, monkeypatch):
    """Every exact test runs with every score kernel, both selection layouts and both gathers of the native
    kernel (fused embedding_bag, gathered rows and a bmm), whichever this machine would pick, and with blocks,
    packed slices and gathers small enough that the stores here take several of each."""
    name = request.param.split("-")[0]
    if name == "packed" and not packing.available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM (the packed kernel falls back to float32)")
    monkeypatch.setattr(packing, "SLICE_ROWS", 500)
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", name)
    real = kernels.kernel_for
    layout = request.param.endswith("tokens-major")
    fused = not request.param.endswith("bmm-gather")
    monkeypatch.setattr(kernels, "kernel_for",
                        lambda *args, **kwargs: dataclasses.replace(real(*args, **kwargs), tokens_major=layout,
                                                                    block_rows=384, dense_block_rows=300,
                                                                    fused_gather=fused))
    monkeypatch.setattr(kernels, "GATHER_ROWS", 700)
    return name


def score_tolerance(queries: torch.Tensor, stored: torch.Tensor, kernel: str) -> float:
    """The documented precision of a kernel's scores (unlimisum/search/kernels.py): exact in fp32; with native
    16-bit scores, query and score rounding each cost at most eps/2 relative, so |error| <= eps |q| |s|."""
    if kernel == "float32" or stored.dtype == torch.float32:
        return 1e-4
    eps = torch.finfo(stored.dtype).eps
    return float(eps * queries.norm(dim=1).max() * stored.float().norm(dim=1).max())


def assert_topk_matches_brute_force(store, states_as_stored, queries, k, kernel):
    scores, ids = store.search(queries, k)
    reference = queries.float() @ states_as_stored.float().T  # [nq, N]
    ref_scores, _ = reference.topk(k, dim=1)
    assert scores.shape == ids.shape == (queries.shape[0], k)
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    # the scores returned are the exact fp32 inner products of the ids returned
    torch.testing.assert_close(reference.gather(1, ids), scores, rtol=1e-5, atol=1e-4)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    assert all(len(set(row.tolist())) == k for row in ids)
    # each id found scores at least the true k-th score, up to the kernel's precision
    tolerance = score_tolerance(queries, states_as_stored, kernel)
    assert (scores >= ref_scores[:, -1:] - tolerance).all()
    if tolerance <= 1e-4:
        torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_exact_search_equals_brute_force(kernel, dtype, monkeypatch):
    states = clustered_states(1500, 48)
    queries = queries_near(states, 7)
    store = build(states, config=IndexConfig(storage_dtype=dtype), chunks=400)
    expected_dtype = {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16,
                      "float16": torch.float16}[dtype]
    assert store.storage_dtype == expected_dtype and store.states().dtype == expected_dtype
    stored = states.to(expected_dtype)
    assert torch.equal(store.states(), stored)
    for k in (1, 37, 1500):
        assert_topk_matches_brute_force(store, stored, queries, k, kernel)
    # scores in slices of 100 states: the running top-k merge across slices
    monkeypatch.setattr(kernels, "MAX_SCORE_BYTES", 100 * 7 * 4)
    for k in (37, 100, 1500):
        assert_topk_matches_brute_force(store, stored, queries, k, kernel)


def reference_attention(stored: torch.Tensor, queries: torch.Tensor, k: int, kernel: str = "float32") -> torch.Tensor:
    """Per query: softmax over its k best scores, times those states, in float64. With the native kernel the
    scores are computed as it does (query rounded to the storage dtype, scores rounded to it)."""
    states = stored.double()
    if kernel == "native" and stored.dtype != torch.float32:
        logits = (queries.to(stored.dtype).double() @ states.T).to(stored.dtype).double()  # [nq, N]
    else:
        logits = queries.double() @ states.T
    top, ids = logits.topk(min(k, states.shape[0]), dim=1)
    return torch.einsum("qk,qkd->qd", torch.softmax(top, dim=1), states[ids])


def unambiguous(stored: torch.Tensor, queries: torch.Tensor, k: int, kernel: str) -> torch.Tensor:
    """[nq] bool: the query's k-th and (k+1)-th scores differ, so its top-k is one set (with 16-bit scores,
    equal scores at the k-th place may take either state: the documented precision)."""
    if k >= stored.shape[0] or kernel != "native" or stored.dtype == torch.float32:
        return torch.ones(queries.shape[0], dtype=torch.bool)
    logits = (queries.to(stored.dtype).double() @ stored.double().T).to(stored.dtype).double()
    top = logits.topk(k + 1, dim=1).values
    return top[:, k - 1] != top[:, k]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("path", ["gather", "dense", "slices"])
def test_exact_attention_equals_the_reference(kernel, dtype, path, monkeypatch):
    """Every way an exact step can run (gather the top-k, a masked dense pass, k >= N, slices) gives the
    attention over the top-k of the kernel's scores; the native kernel's weighted sum, in the storage
    dtype, is exact to that dtype's rounding of the result."""
    states = clustered_states(2000, 48)
    queries = queries_near(states, 9) * 0.05  # attention logits of ordinary size (the scaling is folded in)
    store = build(states, config=IndexConfig(storage_dtype=dtype), chunks=700)
    stored = store.states()
    choice = store.kernel()
    cheaper = {"gather": False, "dense": True, "slices": False}[path]
    monkeypatch.setattr(type(choice), "dense_is_cheaper", lambda self, nq, k, n: cheaper)
    if path == "slices":
        monkeypatch.setattr(kernels, "MAX_SCORE_BYTES", 300 * 9 * 4)
    sixteen_bit_sum = kernel == "native" and stored.dtype != torch.float32
    for k in (5, 300, 2000, 5000):
        got = store.attend(queries, k)
        expected = reference_attention(stored, queries, k, kernel).float()
        assert got.shape == (9, 48) and got.dtype == torch.float32
        # the weighted sum rounded to the storage dtype: half an ulp of each output, plus summation order
        atol = 1e-4 + (torch.finfo(stored.dtype).eps * float(expected.abs().max()) if sixteen_bit_sum else 0.0)
        rows = unambiguous(stored, queries, k, kernel)
        assert rows.sum() >= 5  # most queries have no tie at the k-th place
        torch.testing.assert_close(got[rows], expected[rows], rtol=1e-4, atol=atol)
        if k == 5:  # attention over 5 random states instead of the top 5 is far outside the tolerance
            ids = torch.randint(0, 2000, (9, 5), generator=torch.Generator().manual_seed(0))
            rows = stored.double()[ids]  # [9, 5, d]
            weights = torch.softmax(torch.einsum("qkd,qd->qk", rows, queries.double()), dim=1)
            wrong = torch.einsum("qk,qkd->qd", weights, rows).float()
            assert (got - wrong).abs().max() > 10 * atol


@pytest.mark.parametrize("path", ["gather", "dense"])
@pytest.mark.parametrize("kernel", ["float32", "packed"])
def test_attention_with_scores_hundreds_apart_equals_the_reference(kernel, path, monkeypatch):
    """Sharp heads over long inputs: scores spread far beyond exp's normal range. The online softmax raises
    the weights below e^EXP_FLOOR of the largest to it (torch.exp is slow below it); the result is still the
    reference's, and so is every query's coverage (its weights sum to one). With fp32 scores: the native
    kernel's 16-bit scores of this size are only as exact as their rounding (test_exact_attention_...)."""
    if kernel == "packed" and not packing.available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", kernel)
    monkeypatch.setattr(packing, "SLICE_ROWS", 500)
    states = clustered_states(2000, 48)
    queries = queries_near(states, 9) * 4.0
    store = build(states, config=IndexConfig(storage_dtype="bfloat16"), chunks=700)
    stored = store.states()
    logits = queries.double() @ stored.double().T
    assert float((logits.amax(1) - logits.amin(1)).min()) > 3 * -kernels.EXP_FLOOR
    monkeypatch.setattr(type(store.kernel()), "dense_is_cheaper", lambda self, nq, k, n: path == "dense")
    for k in (300, 2000):
        coverage = torch.zeros(2000)
        got = store.attend(queries, k, coverage)
        expected = reference_attention(stored, queries, k, kernel).float()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(coverage.sum(), torch.tensor(9.0), rtol=1e-5, atol=1e-5)


def test_dense_and_gather_paths_take_exactly_k_tokens_even_with_ties(monkeypatch):
    """Many equal scores at the k-th place: both paths keep exactly the same k states."""
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "native")
    base = clustered_states(50, 32)
    states = base.repeat(40, 1)  # every state 40 times: scores tie in groups of 40
    store = build(states)
    queries = queries_near(base, 6) * 0.05
    outputs = {}
    for cheaper in (False, True):
        monkeypatch.setattr(type(store.kernel()), "dense_is_cheaper", lambda self, nq, k, n, c=cheaper: c)
        coverage = torch.zeros(2000)
        outputs[cheaper] = store.attend(queries, 100, coverage)
        assert int((coverage > 0).sum()) <= 6 * 100  # exactly k per query, ties or not
    torch.testing.assert_close(outputs[True], outputs[False], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_coverage_is_rescored_when_the_scores_do_not_fit(kernel, dtype, monkeypatch):
    """k >= N: a dense pass whose scores are too large to keep scores the store a second time for the
    coverage; the output and the coverage equal those from kept scores and the reference softmax."""
    states = clustered_states(3000, 32)
    store = build(states, config=IndexConfig(storage_dtype=dtype))
    stored = store.states()
    queries = queries_near(states, 7) * 0.05
    kept = torch.zeros(3000)
    whole = store.attend(queries, 3000, kept)
    monkeypatch.setattr(kernels, "MAX_SCORE_BYTES", 256 * 7 * 4)  # the [7, 3000] fp32 scores do not fit
    rescored = torch.zeros(3000)
    again = store.attend(queries, 3000, rescored)
    torch.testing.assert_close(again, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rescored, kept, rtol=1e-5, atol=1e-7)
    if kernel == "native" and stored.dtype != torch.float32:  # the scores as the kernel computes them
        logits = (queries.to(stored.dtype) @ stored.T).double()
    else:
        logits = queries.double() @ stored.double().T  # [7, N]
    expected = torch.softmax(logits, dim=1).sum(dim=0).float()  # [N]
    torch.testing.assert_close(kept, expected, rtol=1e-3, atol=1e-6)
    assert kept.sum().item() == pytest.approx(7.0, rel=1e-5) and (kept > 0).all()


def test_kernel_choice_is_measured_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    choice = kernels.calibrate(torch.device("cpu"), torch.bfloat16, 64, rows=2048)
    assert choice.scores in kernels.SCORE_KERNELS and choice.block_rows in kernels.BLOCK_CHOICES
    assert choice.gather_row_cost > 0 and choice.dense_row_cost > 0 and "measured" in choice.reason
    native = kernels.calibrate(torch.device("cpu"), torch.bfloat16, 64, rows=2048, force="native")
    assert "gather/fused" in native.reason and isinstance(native.fused_gather, bool)  # both gathers timed
    forced = kernels.calibrate(torch.device("cpu"), torch.bfloat16, 64, rows=2048, force="float32")
    assert forced.scores == "float32" and "forced" in forced.reason
    assert kernels.calibrate(torch.device("cpu"), torch.bfloat16, 64, rows=2048, force="native").scores == "native"
    assert kernels.calibrate(torch.device("cpu"), torch.float32, 64, rows=2048, force="native").scores == "float32"
    packed = kernels.calibrate(torch.device("cpu"), torch.bfloat16, 64, rows=2048, force="packed")
    assert packed.scores == ("packed" if packing.available() else "float32")
    assert packed.unpacked().scores == "float32" and packed.unpacked().block_rows == packed.block_rows
    assert kernels.calibrate(torch.device("cpu"), torch.float32, 64, rows=2048, force="packed").scores == "float32"
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "fastest")
    with pytest.raises(ValueError, match="native, float32 or packed"):
        kernels.forced_kernel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_gather_equals_the_gathered_rows_bmm(dtype):
    """The native kernel's two gathers: one embedding_bag call and gathered rows with a bmm give the same sums,
    each within the storage dtype's rounding of the float64 reference; with no ids, zeros."""
    states = clustered_states(3000, 40).to(dtype)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3000, (7, 900), generator=generator)
    weights = torch.softmax(torch.randn(7, 900, generator=generator) * 3, dim=1)
    expected = torch.einsum("qk,qkd->qd", weights.to(dtype).double(), states.double()[ids])
    atol = torch.finfo(dtype).eps * float(expected.abs().max())
    fused = kernels.gathered_attention(states, ids, weights, widen=False, fused=True)
    rows = kernels.gathered_attention(states, ids, weights, widen=False, fused=False)
    assert fused.dtype == rows.dtype == torch.float32 and fused.shape == (7, 40)
    torch.testing.assert_close(fused.double(), expected, rtol=0, atol=atol)
    torch.testing.assert_close(rows.double(), expected, rtol=0, atol=atol)
    torch.testing.assert_close(fused, rows, rtol=0, atol=2 * atol)
    wrong = kernels.gathered_attention(states, ids.roll(1, dims=1), weights, widen=False, fused=True)
    assert (wrong.double() - expected).abs().max() > 10 * atol
    empty = kernels.gathered_attention(states, ids[:, :0], weights[:, :0], widen=False)
    assert empty.shape == (7, 40) and (empty == 0).all()


def test_the_calibration_times_on_a_stores_own_rows_where_it_has_enough(monkeypatch, tmp_path):
    """No synthetic store beside a real one (its bytes were the calibration's largest temporary): the first
    ``rows`` of the store are read in place, unless too few, of another dtype, or beyond fp16's range where
    the packed race would copy them."""
    generator = torch.Generator().manual_seed(0)
    device = torch.device("cpu")
    store = torch.randn(3000, 64).bfloat16()
    pick = lambda sample: kernels._calibration_states(sample, 2048, 64, torch.bfloat16, device, generator,  # noqa: E731
                                                      packing.available())
    picked = pick(store)
    assert picked.shape == (2048, 64) and picked.data_ptr() == store.data_ptr()
    for sample in (store[:1000], store.half(), None):
        other = pick(sample)
        assert other.shape == (2048, 64) and other.dtype == torch.bfloat16
        assert sample is None or other.data_ptr() != sample.data_ptr()
    if packing.available():
        huge = store.clone()
        huge[5, 3] = 1e6  # beyond fp16: the packed race could not copy these rows
        assert pick(huge).data_ptr() != huge.data_ptr()
    seen = []
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))  # nothing measured on this machine yet
    monkeypatch.setattr(kernels, "_CALIBRATED", {})
    monkeypatch.setattr(kernels, "calibrate", lambda *args, sample=None, **kwargs: seen.append(sample) or
                        kernels.KernelChoice("native", 512, False, 1e-9, 1e-9))
    built = build(clustered_states(3000, 64), config=IndexConfig(storage_dtype="bfloat16"))
    built.kernel()
    assert seen and seen[0] is built.states()


def test_dense_attention_over_an_empty_store_is_zero():
    choice = kernels.kernel_for(torch.device("cpu"), torch.float32, 16)
    coverage = torch.zeros(0)
    out = kernels.dense_attention(torch.zeros(0, 16), torch.randn(3, 16), choice, coverage)
    assert out.shape == (3, 16) and not out.isnan().any() and (out == 0).all()


def test_k_above_n_is_capped():
    states = clustered_states(50, 16)
    store = build(states)
    scores, ids = store.search(queries_near(states, 3), 200)
    assert scores.shape == (3, 50) and sorted(ids[0].tolist()) == list(range(50))


def test_weighted_sum_equals_dense_reference(monkeypatch):
    states = clustered_states(900, 40)
    store = build(states)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 900, (9, 300), generator=g)
    weights = torch.softmax(torch.randn(9, 300, generator=g), dim=1)
    dense = torch.einsum("qk,qkd->qd", weights, store.states().float()[ids])
    torch.testing.assert_close(store.weighted_sum(ids, weights), dense)
    # tiny gather budgets: steps over rows, and over slices of one row's k, give the same answer
    for rows in (50, 700):
        monkeypatch.setattr(kernels, "GATHER_ROWS", rows)
        torch.testing.assert_close(store.weighted_sum(ids, weights), dense)


def test_exact_cpu_store_is_one_16_bit_copy():
    n, d = 4000, 96
    states = clustered_states(n, d)
    store = build(states, chunks=[1000, 7, 2500, 493])
    assert store.nbytes / (n * d) <= 2.2
    view = store.states()
    assert view.dtype == torch.bfloat16 and view.shape == (n, d)
    # the view is the searched buffer itself: writing through it changes search results
    q = torch.zeros(1, d)
    q[0, 0] = 1.0
    view[123, 0] = 1000.0
    assert store.search(q, 1)[1].item() == 123


def test_uneven_chunks_equal_one_chunk():
    states = clustered_states(1000, 32)
    queries = queries_near(states, 5)
    for kind in ("exact", "ivf", "hnsw"):
        plan = IndexPlan(kind, "cpu", "test")
        one = build(states, plan)
        many = build(states, plan, chunks=[1, 333, 500, 166])
        assert torch.equal(one.states(), many.states())
        if kind != "hnsw":  # an HNSW graph depends on the insertion batches; exact and IVF do not
            s1, i1 = one.search(queries, 20)
            s2, i2 = many.search(queries, 20)
            assert torch.equal(s1, s2) and torch.equal(i1, i2)


@pytest.mark.parametrize("kind", ["exact", "ivf", "hnsw"])
def test_wrong_total_is_an_error(kind):
    plan = IndexPlan(kind, "cpu", "test")
    builder = DatastoreBuilder(10, 8, plan)
    builder.add(torch.randn(6, 8))
    with pytest.raises(ValueError, match="only 6"):
        builder.finish()
    with pytest.raises(ValueError, match="announced 10"):
        builder.add(torch.randn(5, 8))
    with pytest.raises(ValueError):
        builder.add(torch.randn(2, 9))


def test_fp16_overflow_is_reported_and_auto_storage_never_overflows():
    stored = build(torch.full((4, 8), 1e6))  # auto: bfloat16 has the float32 range
    assert torch.isfinite(stored.states().float()).all()
    builder = DatastoreBuilder(4, 8, CPU, IndexConfig(storage_dtype="float16"))
    with pytest.raises(ConfigError, match="bfloat16"):
        builder.add(torch.full((4, 8), 1e6))


@pytest.mark.parametrize("kind, bar", [("ivf", 0.95), ("hnsw", 0.85)])
def test_approximate_kinds_keep_most_attention_mass(kind, bar):
    # measured on this data: ivf 0.98 (scan factor 16; more with the default), hnsw 0.92; bars leave margin
    states = clustered_states(20_000, 64)
    queries = queries_near(states, 24)
    exact = build(states)
    approx = build(states, IndexPlan(kind, "cpu", "test"), chunks=6000)
    assert approx.kind == kind
    recall = attention_mass_recall(exact, approx, queries, k=256, scaling=0.25)
    assert bar < recall <= 1.0
    assert attention_mass_recall(exact, exact, queries, k=256) == pytest.approx(1.0)
    # scores of approximate results are still the exact inner products of the stored states
    # (HNSW's states are rounded to fp16 by faiss, which differs from torch's rounding in the last bit)
    scores, ids = approx.search(queries, 256)
    finite = scores.isfinite()
    reference = (queries @ approx.states().float().T).gather(1, ids)
    torch.testing.assert_close(scores[finite], reference[finite], rtol=1e-5, atol=1e-4)


def test_ivf_pads_missing_results_with_minus_inf():
    states = clustered_states(2000, 16)
    store = build(states, IndexPlan("ivf", "cpu", "test"))
    store.scan_factor = 1e-6  # probe a single list: fewer than k states
    scores, ids = store.search(queries_near(states, 4), 1000)
    missing = scores == float("-inf")
    assert missing.any() and (ids[missing] == 0).all()
    assert (scores[:, :-1] >= scores[:, 1:]).all()  # padding sits at the end
    weights = torch.softmax(scores, dim=1)
    assert (weights[missing] == 0).all() and torch.isfinite(store.weighted_sum(ids, weights)).all()
    store.scan_factor = 1e9  # all lists: the exact answer
    exact = build(states)
    torch.testing.assert_close(store.search(states[:3], 50), exact.search(states[:3], 50))


def test_search_results_follow_the_queries_device_and_dtype():
    states = clustered_states(100, 8)
    store = build(states)
    scores, ids = store.search(states[:2].half(), 5)
    assert scores.dtype == torch.float32 and scores.device.type == "cpu"


# --- placement ---------------------------------------------------------------------------------


def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_plan_auto_kind_by_threshold(monkeypatch):
    no_cuda(monkeypatch)
    config = IndexConfig(exact_max_tokens=1000)
    assert plan_index(1000, 64, config) == IndexPlan("exact", "cpu", plan_index(1000, 64, config).reason)
    above = plan_index(1001, 64, config)
    assert (above.kind, above.device) == (config.approximate_kind, "cpu")
    assert "exact_max_tokens" in above.reason and "\n" not in above.reason
    assert plan_index(5, 8, IndexConfig(kind="hnsw")).kind == "hnsw"
    assert plan_index(5, 8, IndexConfig(approximate_kind="hnsw", exact_max_tokens=1)).kind == "hnsw"


def test_auto_knows_k_ivf_only_when_it_scans_less_than_one_exact_pass(monkeypatch):
    no_cuda(monkeypatch)
    config = IndexConfig(exact_max_tokens=100_000)  # ivf_scan_factor 64
    n = 2_000_000
    # 12 heads x k=1,024 x 64 = 786k states scanned per step < 2M: IVF
    assert plan_index(n, 768, config, retrieval_k=1024, queries_per_step=12).kind == "ivf"
    # k=16,384 (the window of an LED model): IVF would scan every list several times over
    exact = plan_index(n, 768, config, retrieval_k=16_384, queries_per_step=12)
    assert exact.kind == "exact" and "IVF would scan" in exact.reason
    # 4 beams: four times the queries
    assert plan_index(n, 768, config, retrieval_k=1024, queries_per_step=48).kind == "exact"
    assert plan_index(300_000, 768, IndexConfig(), retrieval_k=1024, queries_per_step=12).kind == "exact"


def test_plan_gpu_only_when_the_store_fits(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    n, d = 300_000, 1024  # 600 MiB in fp16, above exact_max_tokens
    fits = plan_index(n, d, IndexConfig(), cuda_free_bytes=2 * n * d * 2)
    assert (fits.kind, fits.device) == ("exact", "cuda:0")  # the GPU stays exact at any size
    too_big = plan_index(n, d, IndexConfig(exact_max_tokens=100_000), cuda_free_bytes=n * d * 2)  # 0.5 * free < store
    assert too_big.device == "cpu" and too_big.kind == IndexConfig().approximate_kind
    assert plan_index(n, d, IndexConfig(device="cpu"), cuda_free_bytes=10 * n * d).device == "cpu"
    assert plan_index(n, d, IndexConfig(device="gpu"), cuda_free_bytes=0).device == "cuda:0"
    assert plan_index(n, d, IndexConfig(kind="ivf"), cuda_free_bytes=10 * n * d).device == "cpu"
    with pytest.raises(ConfigError, match="CPU only"):
        plan_index(n, d, IndexConfig(kind="hnsw", device="gpu"))


def test_plan_follows_the_models_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plenty = 10**12
    on_cpu = plan_index(1000, 64, IndexConfig(), cuda_free_bytes=plenty, model_device="cpu")
    assert on_cpu.device == "cpu"  # --device cpu on a CUDA machine keeps the store beside the model
    on_second_gpu = plan_index(1000, 64, IndexConfig(), cuda_free_bytes=plenty, model_device="cuda:1")
    assert on_second_gpu.device == "cuda:1"
    assert plan_index(1000, 64, IndexConfig(device="gpu"), model_device="cuda:1").device == "cuda:1"


def test_auto_storage_is_bfloat16_whatever_the_model():
    from unlimisum.search.placement import storage_dtype

    assert storage_dtype(IndexConfig()) == torch.bfloat16  # whatever the model's dtype
    assert storage_dtype(IndexConfig(storage_dtype="float32")) == torch.float32


def test_plan_without_cuda(monkeypatch):
    no_cuda(monkeypatch)
    assert plan_index(10, 8, IndexConfig(), cuda_free_bytes=10**12).device == "cpu"
    with pytest.raises(ConfigError, match="CUDA is not available"):
        plan_index(10, 8, IndexConfig(device="gpu"))


@pytest.mark.parametrize("bad", [
    {"kind": "flat"}, {"device": "cuda"}, {"storage_dtype": "int8"}, {"approximate_kind": "exact"},
    {"gpu_memory_fraction": 0.0}, {"gpu_memory_fraction": 1.5}, {"exact_max_tokens": -1},
])
def test_invalid_options_are_config_errors(bad, monkeypatch):
    no_cuda(monkeypatch)
    with pytest.raises(ConfigError):
        plan_index(10, 8, IndexConfig(**bad))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_matches_cpu_store():
    states = clustered_states(3000, 64)
    queries = queries_near(states, 12)
    plan = plan_index(3000, 64, IndexConfig(device="gpu"))
    gpu = build(states.cuda(), plan, chunks=1000)
    cpu = build(states)
    assert gpu.device.startswith("cuda") and gpu.states().is_cuda
    scores, ids = gpu.search(queries.cuda(), 100)
    assert scores.is_cuda and ids.is_cuda
    torch.testing.assert_close(scores.cpu(), cpu.search(queries, 100)[0], rtol=1e-5, atol=1e-3)
    weights = torch.softmax(scores, 1)
    torch.testing.assert_close(gpu.weighted_sum(ids, weights).cpu(),
                               cpu.weighted_sum(ids.cpu(), weights.cpu()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, k, block", [(20_000, 64, 16), (20_003, 100, 16), (40_001, 1024, 8), (100_000, 50, 32),
                                         (5_000, 1024, None)])
def test_blocked_top_k_equals_torch_topk(n, k, block):
    assert kernels.topk_block(n, k) == block  # blocks of about sqrt(n / k) columns, or the whole row
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, n, generator=g)
    logits[2, 1000:1500] += 10  # the winners crowded into a few blocks
    values, ids = kernels.top_k(logits, k)
    expected_values, _ = logits.topk(k, dim=1)
    torch.testing.assert_close(values, expected_values)
    torch.testing.assert_close(logits.gather(1, ids), values)
    # the same from scores laid out [N, nq]
    values, ids = kernels.top_k_tokens_major(logits.T.contiguous(), k)
    torch.testing.assert_close(values, expected_values)
    torch.testing.assert_close(logits.gather(1, ids), values)
    # in no particular order: the same values, each at its column
    for top_k in (kernels.top_k, lambda x, k, ordered: kernels.top_k_tokens_major(x.T.contiguous(), k, ordered)):
        values, ids = top_k(logits, k, ordered=False)
        torch.testing.assert_close(values.sort(dim=1, descending=True).values, expected_values)
        torch.testing.assert_close(logits.gather(1, ids), values)


@pytest.mark.parametrize("kind", ["exact", "ivf", "hnsw"])
def test_a_view_searches_only_its_range_exactly(kind):
    states = clustered_states(3000, 32)
    store = build(states, IndexPlan(kind, "cpu", "test"))
    view = store.view(1000, 1800)
    assert view.kind == "exact" and view.n_tokens == 800
    assert view.states().data_ptr() == store.states()[1000].data_ptr()  # no copy
    queries = queries_near(states, 5)
    scores, ids = view.search(queries, 20)
    inside = store.states()[1000:1800].float()
    reference, reference_ids = (queries @ inside.T).topk(20, dim=1)
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-4)
    assert (ids >= 0).all() and (ids < 800).all()
    with pytest.raises(ValueError):
        store.view(10, 5000)
    expected = store.states()[1000:1800].clone()
    del store  # the view keeps its memory alive (a faiss buffer, for IVF and HNSW)
    import gc

    gc.collect()
    assert torch.equal(view.states(), expected) and view.search(queries, 3)[1].shape == (5, 3)


@pytest.mark.parametrize("kind", ["exact", "ivf"])
@pytest.mark.parametrize("path", ["gather", "dense"])
def test_coverage_adds_every_querys_weights(kind, path, monkeypatch):
    states = clustered_states(2000, 32)
    store = build(states, IndexPlan(kind, "cpu", "test"))
    if kind == "exact":
        cheaper = path == "dense"
        monkeypatch.setattr(type(store.kernel()), "dense_is_cheaper", lambda self, nq, k, n: cheaper)
    queries = queries_near(states, 6) * 0.05
    coverage = torch.zeros(2000)
    store.attend(queries, 50, coverage)
    assert coverage.sum().item() == pytest.approx(6.0, rel=1e-4)  # each query's weights sum to one
    assert (coverage > 0).sum() <= 6 * 50 + 6  # only retrieved tokens (ties aside)
    if kind == "exact":  # k >= N: dense attention reaches every token
        all_tokens = torch.zeros(2000)
        store.attend(queries, 5000, all_tokens)
        assert all_tokens.sum().item() == pytest.approx(6.0, rel=1e-4) and (all_tokens > 0).all()


def test_reused_buffers_work_inside_and_outside_inference_mode():
    """The kernels' scratch buffers persist across calls: made under inference_mode (as the Summarizer runs), they
    must still take writes from a call under no_grad (training, tests) and the other way round."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(300, 24, generator=generator).to(torch.bfloat16)
    queries = torch.randn(3, 24, generator=generator)
    expected = queries @ states.float().T
    kernels._SCRATCH.buffers = {}  # this thread's buffers, fresh
    with torch.inference_mode():
        torch.testing.assert_close(kernels.float32_scores(states, queries, 128), expected)
    with torch.no_grad():
        torch.testing.assert_close(kernels.float32_scores(states, queries, 128), expected)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.float32_scores(states, queries, 128), expected)


@pytest.mark.skipif(not packing.available(), reason="this torch build has no fbgemm fp16 GEMM")
def test_packed_kernel_packs_only_what_it_can_hold(monkeypatch, tmp_path):
    """The packed copies are made for a 16-bit CPU store within fp16's range and the memory budget; any other
    store runs the float32 kernel, with the same results."""
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "packed")
    states = clustered_states(1200, 32)
    queries = queries_near(states, 5) * 0.05
    store = build(states)
    unpacked_bytes = store.nbytes
    assert store.kernel().scores == "packed" and store.packed() is not None
    assert store.nbytes == unpacked_bytes  # the store's own bytes; the copies are reported beside them
    assert store.packed_nbytes == packing.packed_bytes(1200, 32)
    prepared = build(states)
    prepared.prepare()  # what Summarizer.generate does before its first step: the copies are made now
    assert prepared.packed_nbytes == packing.packed_bytes(1200, 32)
    approximate = build(states, IndexPlan("hnsw", "cpu", "test"))
    approximate_bytes = approximate.nbytes
    approximate.prepare()  # nothing to make for a faiss index
    assert approximate.nbytes == approximate_bytes and approximate.packed_nbytes == 0
    expected = reference_attention(store.states(), queries, 1200).float()
    torch.testing.assert_close(store.attend(queries, 1200), expected, rtol=1e-4, atol=1e-4)
    huge = states.clone()
    huge[3, 5] = 1e6  # bfloat16 holds it, fp16 would not
    beyond_fp16 = build(huge)
    assert beyond_fp16.packed() is None
    expected = reference_attention(beyond_fp16.states(), queries, 40).float()
    torch.testing.assert_close(beyond_fp16.attend(queries, 40), expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(packing, "PACKED_MEMORY_FRACTION", 1e-12)
    assert build(states).packed() is None
    monkeypatch.undo()
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "packed")
    limit = tmp_path / "memory.max"  # a container allowed less than the copies' eight times
    limit.write_text(f"{8 * packing.packed_bytes(1200, 32) - 1}\n")
    monkeypatch.setattr(packing, "CGROUP_LIMIT_FILES", (str(tmp_path / "absent"), str(limit)))
    assert packing.usable_memory() == 8 * packing.packed_bytes(1200, 32) - 1
    assert build(states).packed() is None
    limit.write_text("max\n")  # no limit: physical memory decides
    assert build(states).packed() is not None
    assert build(states, config=IndexConfig(storage_dtype="float32")).packed() is None


def _calibrate_with(monkeypatch, packed_seconds: float, native_seconds: float = 5.6e-3,
                    gathers: dict[str, float] | None = None):
    """calibrate() on this machine's code path, with the timings it races replaced by given figures (seconds):
    the float32 kernel's blocks 20 ms, the native scores ``native_seconds``, the packed ones ``packed_seconds``;
    every dense pass over the quarter store twice its kernel's scores (times four: the whole store); the gathers
    as ``gathers`` says where it names them."""
    def figure(name: str) -> float:
        if gathers and name in gathers:
            return gathers[name]
        kernel = name.removeprefix("dense/").split("/")[0].split("@")[0]
        scores = {"native": native_seconds, "packed": packed_seconds}.get(kernel, 20e-3)
        return 2 * scores / 4 if name.startswith("dense/") and name.count("/") == 1 else scores

    monkeypatch.setattr(kernels, "_race", lambda runs, device, timer=None: {name: figure(name) for name in runs})
    return kernels.calibrate(torch.device("cpu"), torch.bfloat16, 64, rows=2048)


@pytest.mark.skipif(not packing.available(), reason="this torch build has no fbgemm fp16 GEMM")
def test_packed_kernel_is_chosen_only_when_it_pays_for_its_copies(monkeypatch):
    """The issue's Zen 4 figures (packed scores 4.5 ms against native bf16 5.6 ms: 1.25x) choose the native kernel;
    packed is chosen from PACKED_MIN_SPEEDUP up, and a store it cannot pack then runs the best unpacked kernel."""
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    zen4 = _calibrate_with(monkeypatch, packed_seconds=4.5e-3)
    assert zen4.scores == "native" and zen4.fallback == "native"
    assert "under the 1.5x" in zen4.reason
    just = _calibrate_with(monkeypatch, packed_seconds=5.6e-3 / kernels.PACKED_MIN_SPEEDUP)
    assert (just.scores, just.fallback) == ("packed", "native")
    assert just.unpacked().scores == "native"  # a store that is not packed: the best unpacked kernel, not float32
    below = _calibrate_with(monkeypatch, packed_seconds=5.6e-3 / kernels.PACKED_MIN_SPEEDUP * 1.01)
    assert below.scores == "native"
    avx2 = _calibrate_with(monkeypatch, packed_seconds=8e-3, native_seconds=72e-3)  # emulated bf16: float32 next
    assert (avx2.scores, avx2.fallback) == ("packed", "float32")
    assert kernels.choose_scores({"native": 3.0, "float32": 2.0}) == ("float32", "float32")


@pytest.mark.skipif(not packing.available(), reason="this torch build has no fbgemm fp16 GEMM")
@pytest.mark.parametrize("fused_seconds, fused", [(0.04e-3, True), (0.5e-3, False)])
def test_where_packed_wins_the_native_fallbacks_gather_is_measured_fused_and_not(monkeypatch, fused_seconds, fused):
    """A store the packed kernel does not pack (a key store's values) is summed by the native fallback's gather:
    fused or not as measured for it (it was left unfused, 6x slower on an EPYC Zen 5), and the packed kernel's own
    gather cost stays its own."""
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    choice = _calibrate_with(monkeypatch, packed_seconds=2e-3, native_seconds=5.6e-3,
                             gathers={"gather": 0.3e-3, "gather/16-bit": 0.24e-3, "gather/fused": fused_seconds})
    assert (choice.scores, choice.fallback) == ("packed", "native")
    assert "gather/16-bit" in choice.reason and "gather/fused" in choice.reason
    assert choice.fused_gather is fused and choice.unpacked().fused_gather is fused
    assert choice.gather_row_cost == pytest.approx(0.3e-3 / (kernels.CALIBRATION_GATHER_ROWS // 12 * 12))
    native = _calibrate_with(monkeypatch, packed_seconds=5e-3, native_seconds=5.6e-3,
                             gathers={"gather": 0.24e-3, "gather/fused": fused_seconds})
    assert native.scores == "native" and native.fused_gather is fused and "gather/16-bit" not in native.reason
    float32 = _calibrate_with(monkeypatch, packed_seconds=8e-3, native_seconds=72e-3, gathers={"gather": 0.3e-3})
    assert float32.fallback == "float32" and not float32.fused_gather and "gather/fused" not in float32.reason


def test_packed_copies_leave_room_for_what_the_process_holds(monkeypatch):
    """The copies' budget is PACKED_MEMORY_FRACTION of the memory left beside this process's resident set (the
    model and the store are in it), not of all the memory."""
    copies = packing.packed_bytes(100_000, 768)
    held = 20 * copies
    monkeypatch.setattr(packing, "resident_memory", lambda: held, raising=False)
    monkeypatch.setattr(packing, "usable_memory", lambda: held + int(copies / packing.PACKED_MEMORY_FRACTION) - 1)
    assert not packing.memory_allows(100_000, 768)  # an eighth of all the memory would have held them
    monkeypatch.setattr(packing, "usable_memory", lambda: held + int(copies / packing.PACKED_MEMORY_FRACTION) + 1)
    assert packing.memory_allows(100_000, 768)
    monkeypatch.setattr(packing, "usable_memory", lambda: held // 2)  # more held than usable: no budget at all
    assert packing.memory_budget() == 0 and not packing.memory_allows(1, 1)


@pytest.mark.skipif(not packing.available(), reason="this torch build has no fbgemm fp16 GEMM")
def test_chapter_views_read_the_books_packed_copies(monkeypatch):
    """A packed book is packed once: its chapters' views (and views of them) read windows of its copies, slices
    cut at the chapters' edges, with the results of the book's own rows."""
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "packed")
    monkeypatch.setattr(packing, "SLICE_ROWS", 500)
    states = clustered_states(1200, 32)
    queries = queries_near(states, 5) * 0.05
    book = build(states)
    assert book.kernel().scores == "packed"  # calibrated (its own packings done) before the count starts
    made = []
    real = kernels.PackedStates
    monkeypatch.setattr(kernels, "PackedStates", lambda *args, **kwargs: made.append(1) or real(*args, **kwargs))
    book.prepare()
    assert len(made) == 1 and book.packed() is not None
    chapters = [book.view(0, 1200), book.view(100, 700), book.view(700, 1200), book.view(250, 300)]
    inner = chapters[1].view(400, 550)  # tokens 500-650 of the book: across a slice edge
    for view in (*chapters, inner):
        view.prepare()
        assert view.packed() is not None and view.packed()._rows is book.packed()._rows
    assert len(made) == 1  # not one packing per view
    assert chapters[3].packed_nbytes == packing.packed_bytes(500, 32)  # the one slice it reads, shared
    for view, (start, end) in zip((*chapters, inner), ((0, 1200), (100, 700), (700, 1200), (250, 300), (500, 650))):
        rows = book.states()[start:end]
        n = end - start
        for k in (n, 40):
            expected = reference_attention(rows, queries, k).float()
            torch.testing.assert_close(view.attend(queries, k), expected, rtol=1e-4, atol=1e-4)
        scores, ids = view.search(queries, 7)
        torch.testing.assert_close(scores, (queries @ rows.float().T).topk(7, dim=1).values, rtol=1e-5, atol=1e-4)
        assert ids.max() < n
