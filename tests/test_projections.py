"""The decoder's linear layers in the form measured faster (unlimisum/search/projections.py): the same products as
the model's own, the form taken from the measurement kept for this machine, the model put back as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unlimisum import measurements
from unlimisum.search import projections
from unlimisum.search.projections import LinearGroup, MeasuredLinear, columns_product, faster_projections


@pytest.fixture(autouse=True)
def _own_cache_folder(monkeypatch, tmp_path):
    """Each test measures (or reads back) in a cache folder of its own."""
    monkeypatch.setenv("UNLIMISUM_CACHE_HOME", str(tmp_path))


class FixedGroup(LinearGroup):
    """A group whose form is given, counting the rows it was asked for."""

    def __init__(self, form: str):
        super().__init__("test", [])
        self.fixed, self.asked = form, []

    def form(self, rows: int) -> str:
        self.asked.append(rows)
        return self.fixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_the_columns_form_is_the_linear_product(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 48, generator=generator).to(dtype)
    hidden = torch.randn(rows, 48, generator=generator).to(dtype)
    product = columns_product(hidden, weight)
    assert product.shape == (rows, 1000) and product.is_contiguous() and product.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(product, F.linear(hidden, weight), **tolerance)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("form", ["linear", "columns", "compiled"])
@pytest.mark.parametrize("shape", [(1, 1, 32), (3, 1, 32), (2, 7, 32)])
def test_a_measured_linear_gives_the_originals_product_in_every_form(form, shape, bias, monkeypatch):
    from unlimisum.search import compiled

    columns, kernel = [], []
    product, linear = projections.columns_product, compiled.linear
    monkeypatch.setattr(projections, "columns_product", lambda *args: columns.append(1) or product(*args))
    monkeypatch.setattr(compiled, "linear", lambda *args: kernel.append(1) or linear(*args))
    original = nn.Linear(32, 500, bias=bias)
    group = FixedGroup(form)
    measured = MeasuredLinear(original, group)
    assert measured.weight is original.weight and measured.bias is original.bias
    assert dict(measured.named_parameters()) == dict(original.named_parameters())
    hidden = torch.randn(*shape)
    with torch.inference_mode():
        expected, output = original(hidden), measured(hidden)
    assert group.asked == [shape[0] * shape[1]] and len(columns) == (form == "columns")
    assert len(kernel) == (form == "compiled")
    assert output.shape == expected.shape
    torch.testing.assert_close(output, expected)


def test_the_kept_measurement_chooses_the_form_and_a_stale_entry_is_measured_again(monkeypatch):
    weights = [torch.randn(300, 16), torch.randn(16, 300)]
    raced = []
    monkeypatch.setattr(LinearGroup, "race", lambda self, rows: raced.append(rows) or ({"form": "columns"}, "raced"))
    assert LinearGroup("decoder layers", weights).form(3) == "columns"
    assert raced == [4]  # measured at the rows' class
    assert LinearGroup("decoder layers", weights).form(4) == "columns" and raced == [4]  # read back: not raced
    [entry] = measurements.default_store().all()
    assert entry.name == "decoder layers v2 cpu float32 2 weights of 16x300, 300x16, 4 rows"
    measurements.default_store().put(measurements.Measurement(entry.name, {"form": "another"}, "then", 0.1, "old"))
    assert LinearGroup("decoder layers", weights).form(4) == "columns" and raced == [4, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_race_times_the_forms_over_the_groups_weights_and_names_the_faster(dtype):
    group = LinearGroup("output projection", [torch.randn(2000, 32).to(dtype), torch.randn(32, 2000).to(dtype)])
    value, reason = group.race(2)
    assert set(value) == {"form", "linear_seconds", "columns_seconds", "compiled_seconds"}
    assert value[f"{value['form']}_seconds"] == min(value[f"{form}_seconds"] for form in projections.FORMS)
    assert reason.startswith("output projection as ") and "for 2 rows x 2 weights" in reason
    assert "the compiled product" in reason


@pytest.mark.parametrize("weights, rows", [
    ([torch.randn(40, 32)], projections.COMPILED_MAX_ROWS + 1),  # more rows than it races for
    ([torch.randn(40, 31).to(torch.bfloat16)], 1),  # bfloat16 words need an even width
    ([torch.randn(40, 32).to(torch.float16)], 1),  # a dtype it does not read
], ids=["rows", "odd width", "float16"])
def test_the_compiled_form_races_only_where_it_runs(weights, rows):
    assert not projections.compiled_runs(weights, rows)
    value, _ = LinearGroup("test", weights).race(rows)
    assert "compiled_seconds" not in value and value["form"] in ("linear", "columns")


def test_a_models_compiled_kernels_are_named_for_each_groups_dtype(tiny_loaded, monkeypatch):
    model = tiny_loaded("bart").model
    assert projections.compiled_kernels(model) == []  # a tiny model keeps F.linear: nothing to compile
    monkeypatch.setattr(projections, "MIN_GROUP_ELEMENTS", 0)
    assert projections.compiled_kernels(model) == [("linear", torch.float32)]
    assert projections.compiled_kernels(copy.deepcopy(model).to(torch.bfloat16)) == [("linear", torch.bfloat16)]


@pytest.mark.parametrize("rows", [1, 2, 3, 33, 64])
def test_rows_are_measured_at_their_power_of_two(rows):
    assert projections.rows_class(rows) == {1: 1, 2: 2, 3: 4, 33: 64, 64: 64}[rows]


def test_more_rows_than_measured_keep_f_linear_unmeasured(monkeypatch):
    group = FixedGroup("columns")
    columns = []
    monkeypatch.setattr(projections, "columns_product", lambda *args: columns.append(1))
    original = nn.Linear(16, 40)
    hidden = torch.randn(projections.MAX_MEASURED_ROWS + 1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(MeasuredLinear(original, group)(hidden), original(hidden))
    assert group.asked == [] and columns == []


@pytest.mark.parametrize("form", ["columns", "compiled"])
def test_a_models_decoder_and_output_projection_are_measured_inside_the_context_and_put_back(tiny_loaded, form,
                                                                                          monkeypatch):
    model = tiny_loaded("bart").model
    head = model.get_output_embeddings()
    state = {name: tensor for name, tensor in model.state_dict().items()}
    with faster_projections(model) as found:
        assert found == []  # a tiny model keeps F.linear: nothing is measured or replaced
    monkeypatch.setattr(projections, "MIN_GROUP_ELEMENTS", 0)
    monkeypatch.setattr(LinearGroup, "form", lambda self, rows: form)
    decoder_linears = [module for module in model.get_decoder().modules() if type(module) is nn.Linear]
    inputs = torch.tensor([[2, 10, 11, 12, 13, 2]])
    with torch.inference_mode():
        expected = model(input_ids=inputs, decoder_input_ids=inputs[:, :3]).logits
        with faster_projections(model) as found:
            assert [group.name for group in found] == ["decoder layers", "output projection"]
            assert len(found[0].weights) == len(decoder_linears) and found[1].weights == [head.weight]
            replaced = model.get_output_embeddings()
            assert isinstance(replaced, MeasuredLinear) and replaced.original is head
            assert not any(type(module) is nn.Linear for module in model.get_decoder().modules())
            assert model.state_dict().keys() == state.keys()
            logits = model(input_ids=inputs, decoder_input_ids=inputs[:, :3]).logits
    assert model.get_output_embeddings() is head
    assert [module for module in model.get_decoder().modules() if type(module) is nn.Linear] == decoder_linears
    assert all(tensor is state[name] or torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [768, 24], ids=["aligned rows", "unaligned rows"])
@pytest.mark.parametrize("form", ["linear", "columns", None], ids=["F.linear", "columns", "plain nn.Linear"])
def test_rows_apart_computes_equal_rows_alike_wherever_they_sit(form, width, dtype):
    """The support readings' pair: two equal rows of 1 to 6 positions give the same bits in either place (one
    [2L, in] product computed them apart on MKL for 3 and 5 positions), and the original's product to rounding."""
    generator = torch.Generator().manual_seed(width)
    original = nn.Linear(width, 3 * width).to(dtype)
    module = MeasuredLinear(original, FixedGroup(form)) if form else original
    wrapped = projections.RowsApartLinear(module)
    assert wrapped.weight is original.weight and wrapped.bias is original.bias
    tolerance = {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    with torch.inference_mode():
        for length in range(1, 7):
            row = torch.randn(1, length, width, generator=generator).to(dtype)
            pair = row.expand(2, -1, -1).contiguous()
            output = wrapped(pair)
            assert output.shape == (2, length, 3 * width)
            assert torch.equal(output[0], output[1]), length
            torch.testing.assert_close(output, module(pair), **tolerance)
            assert torch.equal(wrapped(row), module(row))  # one row: the original's call


def test_rows_apart_wraps_the_decoders_linear_layers_and_puts_them_back(tiny_loaded):
    model = tiny_loaded("bart").model
    decoder_linears = [module for module in model.get_decoder().modules() if type(module) is nn.Linear]
    head = model.get_output_embeddings()
    with projections.rows_apart(model):
        wrapped = [module for module in model.get_decoder().modules() if isinstance(module, nn.Linear)]
        assert len(wrapped) == len(decoder_linears)
        assert all(type(module) is projections.RowsApartLinear for module in wrapped)
        assert [module.original for module in wrapped] == decoder_linears
        assert model.get_output_embeddings() is head  # the output projection is not the decoder's
    assert [module for module in model.get_decoder().modules() if type(module) is nn.Linear] == decoder_linears


def test_a_summary_compiles_the_product_before_generating_and_races_it(tiny_loaded, monkeypatch):
    """The first run's path: the compiled product named among the kernels generation waits for (compiled while the
    book is encoded), then raced with the other forms for a step's row."""
    from unlimisum.config import GenerationOptions
    from unlimisum.search import compiled
    from unlimisum.summarizer import Summarizer

    monkeypatch.setattr(projections, "MIN_GROUP_ELEMENTS", 0)  # the tiny model's groups measured too
    waited, wait = [], compiled.wait_ready
    monkeypatch.setattr(compiled, "wait_ready", lambda needed, report=None: wait(waited.extend(needed) or needed,
                                                                                report))
    summarizer = Summarizer(tiny_loaded("bart"), generation=GenerationOptions(max_new_tokens=3, min_new_tokens=3))
    assert summarizer.summarize(" ".join(f"word{i}" for i in range(300))).text is not None
    assert ("linear", torch.float32) in waited
    raced = {entry.name: entry.value for entry in measurements.default_store().all()
             if entry.name.startswith(("decoder layers", "output projection"))}
    assert {name.split(" v")[0] for name in raced} == {"decoder layers", "output projection"}
    assert all(value["form"] in projections.FORMS and "compiled_seconds" in value for value in raced.values())
