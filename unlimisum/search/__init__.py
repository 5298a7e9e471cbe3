"""The search: the encoded input's stores, the kernels that search them, and the measurements that choose the
kernels, below both methods (``unlimiformer/`` for encoder-decoder models, ``decoder_only/``), which call it and
never each other.

- ``datastore.py``: the one 16-bit copy of the encoder states (``Datastore``): exact, IVF or HNSW, views of a
  token range; ``placement.py``: which index, on which device, in which dtype (``plan_index``, ``plan_key_store``,
  ``storage_dtype``); ``keys.py``: a key store per decoder layer built from the states (``build_key_store``);
  ``packed.py``: the packed kernel's copies of a store.
- ``kernels.py``: exact retrieval over the shared store, the kernel measured per machine (``kernel_for``,
  ``select``, ``scores``, ``top_k``, ``gathered_attention``); ``head_kernels.py``: the same per head over a
  layer's own keys (``kernel_for``, ``head_attend``, ``head_retrieve``).
- ``projections.py``: the decoder's linear layers for a generation step's few rows in the form measured faster
  here (``faster_projections``: F.linear, ``weight @ rows^T`` or the compiled product).
- ``compiled.py``: the numba kernels' public functions (``select``, ``select_grouped``, ``weighted_sum``,
  ``attend_dense``, ``linear``...), compiled once per machine (``ready``, ``warm``, ``wait_ready``); their loops
  live in ``compiled_loops.py`` (the scores of keys in ``score_loops.py``, the top-k in ``top_k_loops.py``, the
  linear layers' products in ``linear_loops.py``, the grouped select's in ``grouped_loops.py``), the few LLVM
  instructions numba does not emit on its own in ``llvm.py``.

The methods use these modules' public names only (no leading underscore): tests/test_layout.py checks it.
"""
