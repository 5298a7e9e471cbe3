"""The decoder's linear layers computed in the matmul form measured faster on this machine.

A generation step multiplies a few rows (one per beam) by every weight of the decoder and by the output
projection, the model's largest matrix (bart-base: 50,265 x 768, 154 MB in float32): a step streams the weights
from memory, and the BLAS call is the whole cost. ``F.linear`` hands a weight to the BLAS as a transposed
operand; for one row that becomes a matrix-vector product some BLAS runs on one thread, and for a few rows a
product that reads the weight several times over. On an AMD EPYC Zen 2 (2 cores), bart-base's output projection
took 14.5 ms for one row and 34 ms for four (the beams), its decoder's linear layers 19 ms and 37 ms; the same
products taken the other way round, ``weight @ rows^T`` (one row doubled, so that the BLAS runs a matrix
product over its threads), took 9.6, 9.7, 16 and 16 ms. Neither reads the weight at the memory's speed: on an
EPYC Zen 4 every torch form of a bfloat16 product of 1 to 32 rows streamed its weight at 8-16 GB/s of the 28 the
machine had, so bfloat16 weights (half the bytes) gave a step nothing. The third form, ``compiled_product``,
streams each weight once over the threads, every row met while a weight row is in cache (linear_loops.py):
27-33 GB/s there, bart-base's greedy step at 16k tokens in bfloat16 1.33-1.45x as fast as with the other two forms.
No form wins everywhere, so the choice is measured: once per machine (unlimisum/measurements.py keeps it), per
group of weights (the decoder's layers, timed in turn as a step reads them; the output projection), dtype and
count of rows, with the model's own weights; the compiled form races for at most COMPILED_MAX_ROWS rows, where
its kernel compiles and checks here (a first run compiles it while the book is encoded: ``compiled_kernels``).

``faster_projections(model)`` puts a ``MeasuredLinear`` in place of each of those nn.Linear modules for the time
of a generation or a reading: an nn.Linear holding the same Parameters (the state dict, the weight tying and
everything that reads ``.weight`` are unchanged), put back on exit. Every form computes the same product: the
logits agree to float rounding, not bit for bit (each sums in its own order; the compiled form sums in fp32 and
rounds once to the weights' dtype, as torch does).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from unlimisum import measurements
from unlimisum.search import compiled

# Groups of fewer weights than this (16 MB in float32) keep F.linear without measuring: either form takes a
# millisecond at most there (the tiny test models), and a measurement would cost more than it saves.
MIN_GROUP_ELEMENTS = 1 << 22
# Row counts are measured at the next power of two, up to this; more rows (a prompt, a long reading) are the
# matrix products the BLAS is built for and keep F.linear without measuring. 128: the support readings' output
# projection takes up to 128 rows at once where a sentence is long (reread.HEAD_ROWS); bart-base's ran as
# weight @ rows^T in 85 ms and as F.linear in 107 there (EPYC Zen 2).
MAX_MEASURED_ROWS = 128
# What an entry's value means changes with the code that measured it: entries of another version are ignored.
MEASUREMENT_VERSION = 2  # 2: the compiled form races too
FORMS = ("linear", "columns", "compiled")
# The compiled form (linear_loops.py: the weight streamed once, every row met while a weight row is in cache)
# races for at most this many rows: a step's (one a beam); more rows do that many multiply-adds a weight number
COMPILED_MAX_ROWS = 8
# Bytes a row's start is aligned to for RowsApartLinear (the allocator's alignment, a cache line): a BLAS may
# take an operand at another alignment by another path.
ALIGNMENT = 64


class LinearGroup:
    """Linear layers whose form is measured as one: ``name`` ("decoder layers", "output projection") and their
    weights, in the order a step reads them."""

    def __init__(self, name: str, weights: Sequence[torch.Tensor]):
        self.name, self.weights = name, list(weights)
        self._forms: dict[int, str] = {}  # rows class -> form, per process

    @property
    def elements(self) -> int:
        return sum(weight.numel() for weight in self.weights)

    def measurement_name(self, rows: int) -> str:
        """The key of this group's measurement at ``rows`` rows: what identifies its shapes and dtype."""
        shapes = sorted({tuple(weight.shape) for weight in self.weights})
        listed = ", ".join(f"{out}x{width}" for out, width in shapes)
        return (f"{self.name} v{MEASUREMENT_VERSION} cpu {str(self.weights[0].dtype).removeprefix('torch.')} "
                f"{len(self.weights)} weights of {listed}, {rows} rows")

    def form(self, rows: int) -> str:
        """``"linear"``, ``"columns"`` or ``"compiled"``: the form measured faster for ``rows`` rows (their class),
        raced once per machine with these weights, kept in the user's cache folder, memoised per process."""
        counted = rows_class(rows)
        if counted not in self._forms:
            found = measurements.remembered(self.measurement_name(counted), lambda: self.race(counted))
            form = found.value.get("form") if isinstance(found.value, dict) else None
            self._forms[counted] = form if form in FORMS else self.race(counted)[0]["form"]  # another release's
        return self._forms[counted]

    def race(self, rows: int) -> tuple[dict, str]:
        """({"form", "linear_seconds", "columns_seconds"[, "compiled_seconds"]}, reason): the forms timed in turns
        (measurements.race), each over every weight of the group in turn, on ``rows`` random rows; the compiled
        one where it runs here for these weights and rows (``compiled_runs``)."""
        width = max(weight.shape[1] for weight in self.weights)
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(rows, width, generator=generator).to(self.weights[0].dtype)
        inputs = {weight.shape[1]: hidden[:, :weight.shape[1]].contiguous() for weight in self.weights}

        def each(product):
            return lambda: [product(inputs[weight.shape[1]], weight) for weight in self.weights]

        candidates = {"linear": each(F.linear), "columns": each(columns_product)}
        if compiled_runs(self.weights, rows):
            candidates["compiled"] = each(compiled_product)
        with torch.inference_mode():
            seconds = measurements.race(candidates)
        form = min(seconds, key=seconds.get)
        value = {"form": form, **{f"{name}_seconds": best for name, best in seconds.items()}}
        timed = ", ".join(f"{FORM_NAMES[name]} {best * 1e3:.2f} ms" for name, best in seconds.items())
        reason = (f"{self.name} as {FORM_NAMES[form]}: {timed} for {rows} rows x {len(self.weights)} weights "
                  f"({self.elements / 1e6:.1f}M)")
        return value, reason


class MeasuredLinear(nn.Linear):
    """An nn.Linear holding ``original``'s own Parameters (the same tensors, under the same names), whose product
    is computed in the form its ``group`` measured faster for the rows of each call."""

    def __init__(self, original: nn.Linear, group: LinearGroup):
        nn.Module.__init__(self)
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight
        self.register_parameter("bias", original.bias)
        self.group = group
        self.__dict__["original"] = original  # not a child: nothing of the model's state changes names
        self._operands = None  # the compiled form's views of the weight and bias, made at its first call

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in] -> [..., out], as ``original(hidden)``."""
        rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
        form = self.group.form(rows) if 0 < rows <= MAX_MEASURED_ROWS else "linear"
        if form == "linear" or (form == "compiled" and hidden.dtype != self.weight.dtype):
            return F.linear(hidden, self.weight, self.bias)
        if form == "compiled":
            if self._operands is None:  # the kernel's views of the weight and bias, kept for every step
                self._operands = compiled.linear_operands(self.weight, self.bias)
            product = compiled.linear(hidden.reshape(rows, -1), self.weight, self.bias, self._operands)
        else:
            product = columns_product(hidden.reshape(rows, -1), self.weight)  # [rows, out]
            if self.bias is not None:
                product += self.bias
        return product.view(*hidden.shape[:-1], self.out_features)


class RowsApartLinear(nn.Linear):
    """An nn.Linear holding ``original``'s own Parameters whose batch [R, L, in] is R calls of ``original`` of the
    same shape, each row from an aligned start, so that equal rows give equal results wherever they sit in the
    batch: a BLAS computes the rows at different places of one [R * L, in] product with different kernels, and two
    equal rows of it may differ in the last bit (MKL on an EPYC Zen 2: for 3 and 5 positions a row, in the
    columns form). The weight is read R times, but from cache after the first: bart-base's decoder, 2 rows of 16
    positions, took 38 ms a reading rather than 32 (one product of 32 rows in the columns form; torch.bmm took
    42)."""

    def __init__(self, original: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight
        self.register_parameter("bias", original.bias)
        self.__dict__["original"] = original  # not a child: nothing of the model's state changes names

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in] -> [..., out], as ``original(hidden)`` up to rounding; [R, L, in] row by row."""
        if hidden.dim() != 3 or hidden.shape[0] == 1:
            return self.original(hidden)
        hidden = hidden.contiguous()
        aligned = hidden.data_ptr() % ALIGNMENT == 0 and hidden[0].numel() * hidden.element_size() % ALIGNMENT == 0
        return torch.stack([self.original(row if aligned else row.clone()) for row in hidden.unbind(0)])


@contextmanager
def rows_apart(model: nn.Module) -> Iterator[None]:
    """Inside the context, every linear layer of ``model``'s decoder (an nn.Linear or the MeasuredLinear in its
    place) is a RowsApartLinear: the support readings' two rows, the same sentence with and without its passages,
    computed alike, so that hiding nothing changes no bit. Put back on exit."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    installed = []
    try:
        for name, module in list(decoder.named_modules()):
            if name and isinstance(module, nn.Linear) and not isinstance(module, RowsApartLinear):
                parent_name, _, attribute = name.rpartition(".")
                parent = decoder.get_submodule(parent_name)
                setattr(parent, attribute, RowsApartLinear(module))
                installed.append((parent, attribute, module))
        yield
    finally:
        for parent, attribute, module in reversed(installed):
            setattr(parent, attribute, module)


def columns_product(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [rows, in] x weight [out, in]^T -> [rows, out] contiguous, computed as (weight @ hidden^T)^T: one
    row is doubled, so that the BLAS runs a matrix product over its threads rather than a matrix-vector one."""
    rows = hidden if hidden.shape[0] > 1 else hidden.expand(2, -1)
    # [in, rows or 2] as the transpose of contiguous rows: the BLAS reads it as such (a [in, 2] copy ran 3x slower)
    columns = rows.contiguous().t()
    return torch.mm(weight, columns).t()[:hidden.shape[0]].contiguous()


def compiled_product(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [rows, in] x weight [out, in]^T -> [rows, out] (both of one dtype the kernel reads), by the
    compiled kernel (linear_loops.py): summed in fp32 from the stored numbers, the weight read once."""
    return compiled.linear(hidden, weight)


def compiled_runs(weights: Sequence[torch.Tensor], rows: int) -> bool:
    """Whether the compiled form runs for ``rows`` rows times ``weights``: at most COMPILED_MAX_ROWS rows, each weight
    one the kernel reads here (``compiled.usable_states``: on the CPU, in a dtype it reads, bfloat16 of an even
    width, the kernel compiled and checked; it is compiled now where it is not yet: ``compiled_kernels`` names it
    for a run to compile beforehand)."""
    return (0 < rows <= COMPILED_MAX_ROWS and bool(weights)
            and all(compiled.usable_states(weight, "linear") for weight in weights))


def compiled_kernels(model: nn.Module) -> list[tuple[str, torch.dtype]]:
    """The compiled kernels (compiled.KERNELS, with their dtype) the measured forms of ``model``'s groups may run:
    what a first run compiles while its book is encoded."""
    dtypes = {group.weights[0].dtype for group, _ in groups(model)}
    return [("linear", dtype) for dtype in sorted(dtypes, key=str) if dtype in compiled.SCAN_DTYPES]


FORM_NAMES = {"linear": "F.linear", "columns": "weight @ rows^T", "compiled": "the compiled product"}


def rows_class(rows: int) -> int:
    """The count of rows a call of ``rows`` (at most MAX_MEASURED_ROWS) is measured at: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def groups(model: nn.Module) -> list[tuple[LinearGroup, list[tuple[nn.Module, str, nn.Linear]]]]:
    """The groups worth measuring in ``model``: its decoder's nn.Linear layers, and its output projection, each
    with (parent, attribute, module) of its members; a group only where it is on the CPU, of one floating dtype,
    with at least MIN_GROUP_ELEMENTS weights."""
    found = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings()
    for name, root in (("decoder layers", decoder), ("output projection", head)):
        if root is None:
            continue
        members = [(parent, attribute, module) for parent, attribute, module in _linears(root, model)
                   if module is not head or root is head]
        weights = [module.weight for _, _, module in members]
        if (weights and all(w.device.type == "cpu" and w.is_floating_point() and w.dtype == weights[0].dtype
                            for w in weights) and sum(w.numel() for w in weights) >= MIN_GROUP_ELEMENTS):
            found.append((LinearGroup(name, weights), members))
    return found


def prepare(model: nn.Module, rows: int) -> None:
    """Measure now (where not yet measured on this machine) the forms for ``rows`` rows, so that the first
    generation step does not."""
    if 0 < rows <= MAX_MEASURED_ROWS:
        for group, _ in groups(model):
            group.form(rows)


@contextmanager
def faster_projections(model: nn.Module) -> Iterator[list[LinearGroup]]:
    """Inside the context, ``model``'s decoder layers and output projection (``groups``) have MeasuredLinear
    modules in place of their nn.Linear ones; the originals are put back on exit."""
    found, installed = groups(model), []
    try:
        for group, members in found:
            for parent, attribute, module in members:
                setattr(parent, attribute, MeasuredLinear(module, group))
                installed.append((parent, attribute, module))
        yield [group for group, _ in found]
    finally:
        for parent, attribute, module in reversed(installed):
            setattr(parent, attribute, module)


def _linears(root: nn.Module, model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every plain nn.Linear in ``root`` (``root`` itself included, its parent
    found in ``model``), in the order of ``root.named_modules()``."""
    if type(root) is nn.Linear:
        located = locate(model, root)
        return [(*located, root)] if located is not None else []
    found = []
    for name, module in root.named_modules():
        if type(module) is nn.Linear and name:
            parent_name, _, attribute = name.rpartition(".")
            found.append((root.get_submodule(parent_name), attribute, module))
    return found


def locate(model: nn.Module, module: nn.Module) -> tuple[nn.Module, str] | None:
    """(parent, attribute) holding ``module`` in ``model``, or None."""
    for name, candidate in model.named_modules():
        if candidate is module and name:
            parent_name, _, attribute = name.rpartition(".")
            return model.get_submodule(parent_name), attribute
    return None
