"""The encoder's linear layers as dynamic int8 while a book is encoded on a CPU (``--encode-int8``, opt-in).

Encoding is most of a book's time on a CPU (every token is encoded twice with the default overlap). torch's
dynamic int8 linear (weights int8 per tensor, activations quantized per batch, int32 accumulation) runs the
linear layers of a bart-base encoder 1.8x faster than float32 on an AVX2 CPU, a whole book's encoding 1.22x
(Moby-Dick: 479 s to 392 s, BENCHMARKS.md), its states within ~3 % relative error (random weights); the
trained needle model gives the same answer with it on 30 of 30 inputs 50 windows long.
The result is not the float32 encoder's bit for bit, so it is never chosen for the user. Within
``int8_linears`` each ``nn.Linear`` of the module is swapped (setattr) for its int8 version, made once and kept
in ``made``; the originals are put back on leaving, and nothing else of the model changes.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from unlimisum.errors import ConfigError


def int8_linear(linear: nn.Linear) -> nn.Module:
    """A dynamic int8 copy of ``linear`` (torch.ao.quantization); ConfigError where this torch has none."""
    try:
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():  # torch says its quantized tensors are deprecated: not the reader's concern
            warnings.simplefilter("ignore")
            return quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]
    except (ImportError, AttributeError, RuntimeError) as error:
        raise ConfigError(f"--encode-int8 needs torch's dynamic int8 quantization, which this torch build cannot "
                          f"run ({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                          "encode in float32 instead") from None


@contextmanager
def int8_linears(module: nn.Module, made: dict) -> Iterator[None]:
    """Within the block every ``nn.Linear`` under ``module`` (on the CPU) is its dynamic int8 copy."""
    sites = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    if any(child.weight.device.type != "cpu" for _, _, child in sites):
        raise ConfigError("--encode-int8 runs on the CPU; the model is on a GPU (use --device cpu, or leave it off)")
    if any(child.weight.dtype != torch.float32 for _, _, child in sites):
        raise ConfigError("--encode-int8 quantizes float32 weights; the model is in 16 bits (add --dtype float32)")
    swapped = []
    try:
        for parent, name, child in sites:
            if id(child) not in made:
                made[id(child)] = int8_linear(child)
            setattr(parent, name, made[id(child)])
            swapped.append((parent, name, child))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
