"""The compiled grouped scan of the decoder-only generation step (unlimisum/search/compiled.py
``select_grouped``, unlimisum/decoder_only/selection.py ``decode_ids``): under grouped-query attention each key is
scored by the largest of its group's g scores, and each row and key-value head keeps the top-k by that score, as
the brute-force reference finds them."""

from __future__ import annotations

import pytest
import torch

from unlimisum import measurements
from unlimisum.decoder_only import selection
from unlimisum.search import compiled, kernels


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
