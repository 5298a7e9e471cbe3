"""faiss's exact inner-product index over the stored numbers themselves: ``IndexFlatIP`` for fp32, a scalar
quantizer whose codes are the float16 or bfloat16 numbers bit for bit. The shared store's exact index
(datastore.py) and a head's faiss scan (head_kernels.py) are made here."""

from __future__ import annotations

import faiss
import torch

SCALAR_QUANTIZER = {torch.float16: faiss.ScalarQuantizer.QT_fp16, torch.bfloat16: faiss.ScalarQuantizer.QT_bf16}


def new_flat_index(dim: int, dtype: torch.dtype) -> faiss.Index:
    """An empty exact inner-product index of ``dim``-wide vectors stored as ``dtype`` (float32: flat; 16-bit:
    a scalar quantizer whose codes are the numbers bit for bit); KeyError for another dtype."""
    if dtype == torch.float32:
        return faiss.IndexFlatIP(dim)
    return faiss.IndexScalarQuantizer(dim, SCALAR_QUANTIZER[dtype], faiss.METRIC_INNER_PRODUCT)
