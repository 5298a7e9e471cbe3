"""Window plan: every token kept exactly once, inside its window; batched encoding equals one window per pass."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unlimisum.unlimiformer.encoding import auto_batch_size, encode_windows, plan_windows, shard_windows
from unlimisum.errors import ConfigError


def _check_plan(n_tokens: int, window: int, overlap: float) -> None:
    plan = plan_windows(n_tokens, window, overlap)
    kept = []
    for i, start in enumerate(plan.starts):
        length = plan.length(i)
        assert length == min(window, n_tokens)  # every window is full unless the input is short
        keep_start, keep_end = plan.kept(i)
        assert start <= keep_start < keep_end <= start + length
        kept.extend(range(keep_start, keep_end))
    assert kept == list(range(n_tokens))
    stride = window - round(overlap * window)
    assert all(b - a <= max(1, stride) for a, b in zip(plan.starts, plan.starts[1:]))
    assert plan.starts[-1] + plan.length(plan.n_windows - 1) == n_tokens


@pytest.mark.parametrize("window", [2, 3, 16, 64, 1024])
@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5, 0.75])
def test_plan_around_window_boundaries(window, overlap):
    for n_tokens in {1, window - 1, window, window + 1, 2 * window - 1, 2 * window, 2 * window + 1, 7 * window + 3}:
        if n_tokens >= 1:
            _check_plan(n_tokens, window, overlap)


@settings(max_examples=300, deadline=None)
@given(
    n_tokens=st.integers(min_value=1, max_value=20_000),
    window=st.integers(min_value=2, max_value=2048),
    overlap=st.floats(min_value=0.0, max_value=0.95),
)
def test_plan_keeps_every_token_exactly_once(n_tokens, window, overlap):
    _check_plan(n_tokens, window, overlap)


def test_middle_windows_keep_their_middle_half():
    plan = plan_windows(10 * 64, 64, 0.5)
    for i in range(1, plan.n_windows - 1):
        keep_start, keep_end = plan.kept(i)
        assert keep_start - plan.starts[i] >= 16  # a quarter window of left context
        assert plan.starts[i] + 64 - keep_end >= 16  # and of right context


@pytest.mark.parametrize("bad", [dict(n_tokens=0), dict(window=1), dict(overlap=1.0), dict(overlap=-0.1)])
def test_plan_rejects_bad_arguments(bad):
    arguments = dict(n_tokens=10, window=8, overlap=0.5) | bad
    with pytest.raises(ConfigError):
        plan_windows(**arguments)


@given(st.integers(1, 400), st.integers(1, 9), st.integers(1, 40), st.integers(1, 20))
def test_shards_are_whole_batches_in_order_covering_every_window(n_windows, batch_size, wanted, most):
    shards = shard_windows(n_windows, batch_size, wanted, most)
    assert shards[0][0] == 0 and shards[-1][1] == n_windows
    assert all(stop == first for (_, stop), (first, _) in zip(shards, shards[1:]))
    assert all(first % batch_size == 0 and first < stop for first, stop in shards)
    longest = max(batch_size, -(-most // batch_size) * batch_size)
    assert all(stop - first <= longest for first, stop in shards)
    assert len(shards) >= min(wanted, -(-n_windows // longest))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([16, 64, 1024]), st.sampled_from([0.0, 0.25, 0.5]), st.data())
def test_a_part_of_a_plan_keeps_what_its_windows_keep(n_tokens, window, overlap, data):
    plan = plan_windows(n_tokens, window, overlap)
    first = data.draw(st.integers(0, plan.n_windows - 1))
    stop = data.draw(st.integers(first + 1, plan.n_windows))
    part, offset = plan.part(first, stop)
    assert part.n_windows == stop - first and part.window == window
    for i in range(part.n_windows):
        assert part.starts[i] + offset == plan.starts[first + i]
        assert part.length(i) == plan.length(first + i)
        assert tuple(bound + offset for bound in part.kept(i)) == plan.kept(first + i)
    assert offset + part.n_tokens == plan.starts[stop - 1] + plan.length(stop - 1)


@pytest.mark.parametrize("model_type", ["bart", "led", "t5"])
def test_parts_of_a_plan_encoded_apart_give_the_whole_plans_states_bit_for_bit(tiny_loaded, model_type):
    """What a Ray worker computes for its part (unlimisum/runs/ray_windows.py) is what one process computes."""
    loaded = tiny_loaded(model_type)
    torch.manual_seed(2)
    input_ids = torch.randint(5, 200, (900,))
    plan = plan_windows(len(input_ids), 64, 0.5)
    whole = kept_states(loaded, input_ids, plan, batch_size=3)
    apart = []
    shards = shard_windows(plan.n_windows, 3, 4)
    assert len(shards) == 4
    for first, stop in shards:
        part, offset = plan.part(first, stop)
        apart += kept_states(loaded, input_ids[offset:offset + part.n_tokens], part, batch_size=3)
    assert torch.equal(torch.cat(apart), torch.cat(whole))


def kept_states(loaded, input_ids: torch.Tensor, plan, batch_size: int) -> list[torch.Tensor]:
    """Each window's kept states, as ``encode_windows`` hands them out with the model's encoder inputs (BART's
    last layer on the kept rows)."""
    chunks = []
    encode_windows(loaded.model.get_encoder(), input_ids, plan, chunks.append, batch_size=batch_size,
                   encoder_inputs=loaded.architecture.encoder_inputs, kept_rows=loaded.architecture.kept_rows)
    return chunks


def test_auto_batch_size_is_bounded_by_windows():
    assert auto_batch_size(1024, 1, torch.device("cpu")) == 1
    assert auto_batch_size(1024, 100, torch.device("cpu")) == 2
    assert auto_batch_size(64, 100, torch.device("cpu")) == 32
    assert auto_batch_size(16384, 100, torch.device("cpu")) == 1
    assert auto_batch_size(1024, 100, torch.device("cuda")) == 32


@pytest.mark.parametrize("model_type", ["bart", "led", "t5"])
def test_batched_encoding_equals_one_window_per_pass(tiny_loaded, model_type):
    loaded = tiny_loaded(model_type)
    torch.manual_seed(1)
    input_ids = torch.randint(5, 200, (500,))
    plan = plan_windows(len(input_ids), 64, 0.5)
    results = {}
    for batch_size in (1, 3, plan.n_windows):
        results[batch_size] = torch.cat(kept_states(loaded, input_ids, plan, batch_size))
        assert results[batch_size].shape == (500, loaded.model.config.d_model)
    torch.testing.assert_close(results[1], results[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1], results[plan.n_windows], rtol=1e-5, atol=1e-5)


def test_kept_states_come_from_the_planned_window(tiny_loaded):
    loaded = tiny_loaded("bart")
    input_ids = torch.randint(5, 200, (150,))
    plan = plan_windows(150, 64, 0.5)
    chunks = []
    encode_windows(loaded.model.get_encoder(), input_ids, plan, chunks.append, batch_size=2)
    with torch.inference_mode():
        i = 1
        start = plan.starts[i]
        alone = loaded.model.get_encoder()(input_ids=input_ids[None, start : start + 64]).last_hidden_state[0]
    keep_start, keep_end = plan.kept(i)
    torch.testing.assert_close(chunks[i], alone[keep_start - start : keep_end - start], rtol=1e-5, atol=1e-5)
