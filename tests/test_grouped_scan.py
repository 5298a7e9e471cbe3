"""The compiled grouped scan of the decoder-only generation step (unlimisum/search/compiled.py
``select_grouped``, unlimisum/decoder_only/selection.py ``decode_ids``): under grouped-query attention each key is
scored by the largest of its group's g scores, and each row and key-value head keeps the top-k by that score, as
the brute-force reference finds them."""

from __future__ import annotations

import pytest
import torch

from unlimisum import measurements
from unlimisum.decoder_only import selection
from unlimisum.search import compiled, grouped_loops, kernels


def grouped_scores(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[B, G, n]: each key's largest fp32 score over its group's queries [B, G, g, D] (keys [G, n, D] widened)."""
    return torch.einsum("bghd,gnd->bghn", queries, keys.float()).amax(dim=2)


def reference(keys: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, ids) [B, G, k'] sorted: the brute-force top-k by the max over each group (``token_ids``' rule)."""
    return grouped_scores(keys, queries).topk(min(k, keys.shape[1]), dim=-1)


def assert_same_ids(ids: torch.Tensor, expected: torch.Tensor) -> None:
    """The same id sets per row and KV head, whatever their order (scores within fp32 rounding may swap)."""
    assert ids.shape == expected.shape
    assert torch.equal(ids.sort(dim=2).values, expected.sort(dim=2).values)


def assert_equals_reference(keys: torch.Tensor, queries: torch.Tensor, k: int) -> None:
    found, ids = compiled.select_grouped(keys, queries, k)  # [B, G, k'], no order
    expected = reference(keys, queries, k)
    assert_same_ids(ids, expected.indices)
    torch.testing.assert_close(found, grouped_scores(keys, queries).gather(2, ids))  # each id's own score
    torch.testing.assert_close(found.sort(dim=2, descending=True).values, expected.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, group", [(1, 1), (1, 7), (3, 1), (3, 7)])
@pytest.mark.parametrize("k", [1, 700])
def test_the_grouped_select_is_the_top_k_by_the_max_over_each_group(dtype, rows, group, k):
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3_000, 16, generator=generator).to(dtype)  # [G, n, D]: two full blocks and a partial one
    queries = torch.randn(rows, 2, group, 16, generator=generator)  # [B, G, g, D]
    assert_equals_reference(keys, queries, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_k_at_least_the_keys_every_key_is_selected_once(dtype):
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(3, 1_500, 8, generator=generator).to(dtype)  # [G, n, D]
    queries = torch.randn(3, 3, 7, 8, generator=generator)  # [B, G, g, D]
    for k in (1_500, 4_000):
        assert_equals_reference(keys, queries, k)
        _, ids = compiled.select_grouped(keys, queries, k)
        assert torch.equal(ids.sort(dim=2).values, torch.arange(1_500).expand(3, 3, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_view_of_a_larger_store_is_read_where_it_lies(dtype):
    """The decoder-only store passes its far tokens as keys[:, a:b] of a [G, capacity, D] buffer."""
    generator = torch.Generator().manual_seed(6)
    store = torch.randn(2, 5_000, 16, generator=generator).to(dtype)  # [G, capacity, D]
    far = store[:, 300:2_900]  # [G, 2600, D]: not a multiple of the block, at an offset into each head's rows
    queries = torch.randn(3, 2, 7, 16, generator=generator)  # [B, G, g, D]
    assert_equals_reference(far, queries, 700)
    store[:, :300] = 1e3  # keys outside the view: never read, never selected
    store[:, 2_900:] = 1e3
    assert_equals_reference(far, queries, 700)


def in_parts(keys: torch.Tensor, queries: torch.Tensor, k: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, ids) [B, G, k'] of ``select_grouped`` with each head's keys scanned in ``parts`` parts, in the
    order of the ids (and of the scores for one id: the -inf with id 0 where fewer than k' are finite)."""
    rows, heads, group, dim = queries.shape
    k = min(k, keys.shape[1])
    scores, ids = torch.empty(heads, rows, k), torch.empty(heads, rows, k, dtype=torch.long)
    compiled._select_grouped_in(keys, queries.transpose(0, 1).reshape(heads, rows * group, dim), group, k, scores,
                                ids, parts)
    order = scores.sort(dim=2, descending=True, stable=True).indices
    scores, ids = scores.gather(2, order), ids.gather(2, order)
    order = ids.sort(dim=2, stable=True).indices
    return scores.gather(2, order).transpose(0, 1), ids.gather(2, order).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 3, 7])
@pytest.mark.parametrize("k", [1, 700, 2_500])
def test_a_head_scanned_in_parts_selects_what_the_whole_scan_selects(dtype, parts, k):
    """Each part on a thread of its own (grouped_loops.py), starting at a multiple of the block (some parts empty:
    7 parts of 6,100 keys), the parts' candidates merged: the very scores and ids of one pass over the head, and
    no key beyond those that are finite (a key of NaN scores NaN, one of -inf scores -inf: never selected)."""
    generator = torch.Generator().manual_seed(8)
    store = torch.randn(2, 6_500, 32, generator=generator)  # [G, capacity, D]
    store[0, 1_000:5_500] = float("nan")  # head 0: 900 keys of the view score a number, fewer than k = 2,500
    store[0, 5_500:] = float("-inf")
    keys = store.to(dtype)[:, 100:6_200]  # a view, at an offset into each head's rows
    queries = torch.randn(3, 2, 4, 32, generator=generator).abs()  # [B, G, g, D]: -inf keys score -inf
    whole_scores, whole_ids = in_parts(keys, queries, k, 1)
    scores, ids = in_parts(keys, queries, k, parts)
    assert torch.equal(ids, whole_ids) and torch.equal(scores, whole_scores)
    expected = reference(keys[1:], queries[:, 1:], k)  # head 1: every key a number
    assert_same_ids(ids[:, 1:], expected.indices)
    finite = scores[:, 0].isfinite()  # head 0: its 900 keys that score a number, then -inf with id 0
    assert bool((finite.sum(dim=1) == min(k, 900)).all()) and bool((ids[:, 0][~finite] == 0).all())
    assert bool((ids[:, 0][finite] < 900).all())


@pytest.mark.parametrize("heads, n, threads, parts", [
    (1, 100_000, 2, 2), (1, 100_000, 8, 8), (2, 100_000, 8, 4), (3, 100_000, 8, 3), (2, 100_000, 2, 1),
    (12, 100_000, 8, 1), (1, 3 * grouped_loops.PART_MIN_KEYS - 1, 8, 2), (1, grouped_loops.PART_MIN_KEYS, 8, 1)])
def test_the_parts_give_each_thread_one_and_none_shorter_than_the_least(heads, n, threads, parts):
    assert grouped_loops.parts_of(heads, n, threads) == parts


def test_a_store_with_fewer_key_value_heads_than_threads_is_scanned_in_parts(monkeypatch):
    """select_grouped asks for a part a thread (the machine's threads: as torch runs them) where the heads are
    fewer, and finds the reference's top-k so."""
    monkeypatch.setattr(grouped_loops, "PART_MIN_KEYS", 1_024)  # parts of a small store
    asked = []
    parts_of = grouped_loops.parts_of
    monkeypatch.setattr(compiled, "parts_of", lambda *shape: (asked.append(parts_of(*shape)), asked[-1])[1])
    monkeypatch.setattr(compiled, "_threads", lambda: 4)
    generator = torch.Generator().manual_seed(9)
    keys = torch.randn(1, 5_000, 16, generator=generator).to(torch.bfloat16)  # [G, n, D]: one key-value head
    queries = torch.randn(2, 1, 7, 16, generator=generator)  # [B, G, g, D]
    assert_equals_reference(keys, queries, 300)
    assert_equals_reference(keys.expand(4, -1, -1), queries.expand(-1, 4, -1, -1), 300)  # a head a thread
    assert asked == [4, 1]


def test_nothing_to_select_gives_empty_results():
    scores, ids = compiled.select_grouped(torch.randn(2, 0, 8), torch.randn(1, 2, 3, 8), 4)
    assert scores.shape == ids.shape == (1, 2, 0)
    scores, ids = compiled.select_grouped(torch.randn(2, 10, 8), torch.randn(0, 2, 3, 8), 4)
    assert scores.shape == ids.shape == (0, 2, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, group", [(1, 7), (3, 2)])
def test_decode_ids_gives_the_same_ids_through_either_path(monkeypatch, dtype, rows, group):
    generator = torch.Generator().manual_seed(7)
    store = torch.randn(2, 20_000, 16, generator=generator).to(dtype)  # [G, capacity, D]
    keys = store[:, 100:17_000]  # [G, n, D]: GROUPED_SCAN_MIN_KEYS or more
    assert keys.shape[1] >= selection.GROUPED_SCAN_MIN_KEYS
    queries = torch.randn(rows, 2, group, 16, generator=generator)  # [B, G, g, D]
    choice = kernels.kernel_for(torch.device("cpu"), dtype, 16)
    monkeypatch.setattr(selection, "grouped_scan_wins", lambda *shape: True)
    assert selection.grouped_scan_serves(keys, queries, 700)
    scanned = selection.decode_ids(keys, queries, 700, choice)
    monkeypatch.setattr(selection, "grouped_scan_wins", lambda *shape: False)
    assert not selection.grouped_scan_serves(keys, queries, 700)
    by_torch = selection.decode_ids(keys, queries, 700, choice)
    expected = reference(keys, queries, 700)  # [B, G, k], sorted by score
    assert_same_ids(scanned, expected.indices)  # exact fp32 scores: the reference's very ids
    # the torch path scores by the measured kernel (bfloat16 keys natively where measured faster, or packed): ids
    # within that kernel's rounding of the k-th score may swap, so its winners' true scores match the reference's
    by_torch_scores = grouped_scores(keys, queries).gather(2, by_torch).sort(dim=2, descending=True).values
    torch.testing.assert_close(by_torch_scores, expected.values, atol=2**-6 * 16, rtol=0)
    in_order = grouped_scores(keys, queries).gather(2, scanned)  # [B, G, k]: sorted by score, as the torch path
    assert bool((in_order[..., 1:] <= in_order[..., :-1] + 1e-5).all())
    # the torch path's ids in descending order of its kernel's scores: of the true scores within twice its rounding
    # (two nearly equal scores may swap), the best first
    rounding = 2**-6 * 16
    in_torch_order = grouped_scores(keys, queries).gather(2, by_torch)  # [B, G, k]
    assert bool((in_torch_order[..., 1:] <= in_torch_order[..., :-1] + 2 * rounding).all())
    assert bool((in_torch_order[..., :10] >= expected.values[..., 9:10] - 2 * rounding).all())


def test_a_forced_kernel_short_store_or_many_queries_keep_the_torch_path(monkeypatch):
    keys = torch.randn(2, selection.GROUPED_SCAN_MIN_KEYS, 8)  # [G, n, D]
    queries = torch.randn(1, 2, 4, 8)  # [B, G, g, D]
    monkeypatch.setattr(selection, "grouped_scan_wins", lambda *shape: True)
    assert selection.grouped_scan_serves(keys, queries, 16)
    assert not selection.grouped_scan_serves(keys[:, 1:], queries, 16)
    many = torch.randn(selection.GROUPED_SCAN_MAX_ROWS // 4 + 1, 2, 4, 8)
    assert not selection.grouped_scan_serves(keys, many, 16)
    assert not selection.grouped_scan_serves(keys.half(), queries, 16)
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    assert not selection.grouped_scan_serves(keys, queries, 16)

    def refused(*args):
        raise AssertionError("the compiled grouped scan ran under a forced kernel")

    monkeypatch.setattr(compiled, "select_grouped", refused)
    choice = kernels.kernel_for(torch.device("cpu"), torch.float32, 8)
    assert_same_ids(selection.decode_ids(keys, queries, 16, choice), reference(keys, queries, 16).indices)


def test_the_race_is_measured_once_and_kept(monkeypatch):
    selection.grouped_scan_wins.cache_clear()
    wins = selection.grouped_scan_wins(torch.float32, 1, 3, 2, 8, 16)
    assert isinstance(wins, bool)
    kept = [m for m in measurements.default_store().all() if m.name.startswith("decoder-only grouped scan")]
    version = selection.GROUPED_MEASUREMENT_VERSION
    assert [m.name for m in kept] == [f"decoder-only grouped scan v{version} cpu float32 1 KV heads x 4 rows x 2 "
                                      "queries, d=8, k=16"]  # 3 rows measured as 4
    assert kept[0].value["compiled_wins"] == wins and "compiled" in kept[0].reason
    selection.grouped_scan_wins.cache_clear()

    def raced_again(*shape):
        raise AssertionError("measured again")

    monkeypatch.setattr(selection, "_race_grouped_scan", raced_again)
    assert selection.grouped_scan_wins(torch.float32, 1, 3, 2, 8, 16) == wins  # the kept entry
    selection.grouped_scan_wins.cache_clear()
