"""A prefill chunk's attention on the CPU: torch's fused flash kernel, parts merged by log-sum-exp.

parts.attend computes every score in float32 and holds them for one softmax: at a chunk of 1,024
queries over ~3,000 keys that is ~4x the time of the model's own (flash) attention, most of it in
passes over the scores (concatenation, masking, softmax, the attention mass); a whole prompt read
exactly (chunks of 4,096 over up to the model's positions) ~3x in all. Here each group of
parts that share their queries (all of them at true positions; sinks, far tokens and the local
window each in the fixed-distance regime) is one call of torch's CPU flash-attention kernel per
key-value head (products accumulated in float32, as the model's own SDPA attention does), and the
chunk's own keys one more in the kernel's causal mode (no mask is built), each returning its
queries' log-sum-exps; the calls are merged in float32 by their log-sum-exps. Block mode needs the
attention each local key drew (its mass): it is recomputed for the local part only, where a key
will leave the window, exp(scaling q.k - lse) in float32 from the same keys and queries: for a 16-bit
model by the flash kernel with the roles of keys and queries swapped, for a float32 one by matrix products
(``_mass_products``: the kernel would also sum a column of zero values for every score, half its work).

Precision: the output is the model's dtype either way; against parts.attend it differs by the
kernel's order of summation and, for a 16-bit model, one more 16-bit rounding of each call's
output before the merge; the local mass agrees to ~1e-5. In the fixed-distance regime a 16-bit
model's turned queries and the window's re-rotated keys (float32 in parts.attend) are rounded to 16
bits, as the model's own queries and keys are, which moves the mass by up to ~1 % on a random model
(tests/test_decoder_prefill.py bounds all of it). A float32 model's differs by the order of
summation only.
"""

from __future__ import annotations

import torch

from unlimisum.decoder_only.parts import Part

FLASH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# keys whose mass one product scores: [g * C, 64] float32 scores, 7 MiB for a chunk of 4,096 queries of 7 heads
MASS_BLOCK_KEYS = 64


def _kernel():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def usable(queries: torch.Tensor, parts: list[Part], softcap: float | None) -> bool:
    """The flash path applies: a 16-bit or float32 model on the CPU (float64 keeps parts.attend: the tests'
    reference), no soft-capping (Gemma 2), every part shared by the chunk's queries (not token mode's per-query
    far tokens), and a torch that has the kernel."""
    return (queries.dtype in FLASH_DTYPES and queries.device.type == "cpu" and softcap is None
            and all(part.layout == "shared" for part in parts) and _kernel() is not None)


def _head_mask(part: Part, head: int, n_queries: int) -> torch.Tensor | None:
    """The part's mask for KV head ``head`` as [C, n] or [1, n] bool, or None (every key)."""
    mask = part.visible(n_queries)
    if mask is None:
        return None
    if mask.dim() == 5:  # [1, G, 1, 1|C, n]
        mask = mask[0, head if mask.shape[1] > 1 else 0, 0]
    return mask


def attend(queries: torch.Tensor, parts: list[Part], scaling: float, mass_part: int | None = None,
           mass_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """queries [1, G, g, C, D] and shared parts -> (out [1, G, g, C, D] float32, mass [G, n] float32 of
    part ``mass_part``: the attention each of its keys drew, summed over the g query heads and the C queries).
    ``mass_keys``: only the part's first that many keys need it (the others may be left 0); None: all."""
    kernel = _kernel()
    _, heads, group, n_queries, dim = queries.shape
    dtype = queries.dtype
    groups: list[list[Part]] = []
    for part in parts:
        if part.size == 0:
            continue
        own = part.queries if part.queries is not None else queries
        if groups and (groups[-1][0].queries if groups[-1][0].queries is not None else queries) is own:
            groups[-1].append(part)
        else:
            groups.append([part])
    out = queries.new_empty(queries.shape, dtype=torch.float32)
    mass = None
    if mass_part is not None:
        mass = torch.zeros(heads, parts[mass_part].size, dtype=torch.float32, device=queries.device)
    for head in range(heads):
        outputs, lses = [], []  # [g, C, D] and [g, C] float32 per kernel call
        for members in groups:
            q = (members[0].queries if members[0].queries is not None else queries)[0, head].to(dtype)  # [g, C, D]
            seen, causal = [], []  # (keys, values, mask or None) seen by every query; (keys, values) seen causally
            for part in members:
                keys, values = part.keys[head].to(dtype), part.values[head].to(dtype)
                if part.causal_tail:  # the keys before the tail are seen by all; the tail in the kernel's causal mode
                    first = part.size - part.causal_tail
                    seen.append((keys[:first], values[:first], None))
                    causal.append((keys[first:], values[first:]))
                else:
                    seen.append((keys, values, _head_mask(part, head, n_queries)))
            seen = [entry for entry in seen if entry[0].shape[0]]
            calls = [(keys, values, None, True) for keys, values in causal]
            if seen:
                keys = torch.cat([entry[0] for entry in seen]) if len(seen) > 1 else seen[0][0]
                values = torch.cat([entry[1] for entry in seen]) if len(seen) > 1 else seen[0][1]
                calls.insert(0, (keys, values, _additive([(entry[0].shape[0], entry[2]) for entry in seen], n_queries,
                                                         dtype, queries.device), False))
            for keys, values, additive, is_causal in calls:
                blind = None  # queries that see none of the call's keys: the kernel gives them a log-sum-exp of 0
                if additive is not None:
                    blind = torch.isinf(additive).all(dim=-1)  # [C] or [1]
                    if bool(blind.all()):
                        continue
                shape = (1, group, keys.shape[0], dim)
                o, lse = kernel(q.unsqueeze(0), keys.expand(shape), values.expand(shape), 0.0, is_causal,
                                attn_mask=additive, scale=scaling)
                if blind is not None and bool(blind.any()):
                    lse[0, :, blind] = float("-inf")
                outputs.append(o[0])  # [g, C, D]
                lses.append(lse[0])  # [g, C] float32
        if len(outputs) == 1:
            out[0, head] = outputs[0]
            total = lses[0]
        else:
            stacked = torch.stack(lses)  # [calls, g, C]
            total = torch.logsumexp(stacked, dim=0)
            weights = torch.exp(stacked - total).unsqueeze(-1)  # [calls, g, C, 1]
            out[0, head] = sum(w * o.float() for w, o in zip(weights, outputs))  # a blind query's w: 0
        if mass is not None:
            mass[head] = _mass(queries, parts[mass_part], head, scaling, total, mass_keys)
    return out, mass


def _additive(pieces: list[tuple[int, torch.Tensor | None]], n_queries: int, dtype: torch.dtype,
              device) -> torch.Tensor | None:
    """The kernel's additive mask over keys concatenated from ``pieces`` (size, bool mask [C, n] or [1, n] or
    None): 0 where seen, -inf where not; [1, n] where no piece's mask varies by query; None where none masks."""
    if all(mask is None for _, mask in pieces):
        return None
    rows = n_queries if any(mask is not None and mask.shape[0] > 1 for _, mask in pieces) else 1
    additive = torch.zeros(rows, sum(size for size, _ in pieces), dtype=dtype, device=device)
    offset = 0
    for size, mask in pieces:
        if mask is not None:
            additive[:, offset:offset + size].masked_fill_(~mask, float("-inf"))
        offset += size
    return additive


def _split(x: torch.Tensor, dtype: torch.dtype, parts: int = 3) -> list[torch.Tensor]:
    """float32 x as ``parts`` tensors of ``dtype`` whose sum is x to ~float32 precision (x itself, then zeros,
    for float32)."""
    out = []
    for _ in range(parts):
        high = x.to(dtype)
        out.append(high)
        x = x - high.float()
    return out


def _mass(queries: torch.Tensor, part: Part, head: int, scaling: float, lse: torch.Tensor,
          needed: int | None = None) -> torch.Tensor:
    """[n]: exp(scaling q.k - lse) over the part's keys, masked, summed over the g heads and C queries (float32);
    ``needed``: only the first that many keys' (where the others cost a call of their own they are left 0).

    A float32 model's comes from matrix products (``_mass_products``).

    The flash kernel computes it with the roles of keys and queries swapped: its log-sum-exp for "query" k_j
    over "keys" [q_i, -lse_i / scaling] is log sum_i exp(scaling q_i.k_j - lse_i), the mass of k_j, with
    float32 scores and without holding them. -lse / scaling rides in three 16-bit columns (their sum keeps
    float32's precision). A causal mask (the chunk's own keys) is the kernel's causal mode on reversed
    sequences; any other mask falls back to float32 scores.
    """
    q = (part.queries if part.queries is not None else queries)[0, head]  # [g, C, D]
    group, n_queries, dim = q.shape
    dtype = queries.dtype
    keys = part.keys[head].to(dtype)  # [n, D]
    n = keys.shape[0]
    first, tail = n, 0  # keys [0, first) are seen by every query, the last ``tail`` causally (the chunk's own)
    mask = None if part.causal_tail else _head_mask(part, head, n_queries)  # a causal tail says it without one
    if part.causal_tail:
        first, tail = n - part.causal_tail, part.causal_tail
    elif mask is not None:
        full = mask.expand(n_queries, n)
        first, tail = n - n_queries, n_queries
        if first < 0 or not bool(full[:, :first].all()) or not torch.equal(
                full[:, first:], torch.ones(tail, tail, dtype=torch.bool, device=q.device).tril()):
            return _mass_float32(q, keys, mask, scaling, lse)
    needed = n if needed is None else max(0, min(needed, n))
    if dtype == torch.float32:
        return _mass_products(q, keys, first, tail, scaling, lse, needed)
    if needed <= first:  # the causal tail's keys never need it
        first, tail = needed, 0
    offsets = _split(lse.neg() / scaling, dtype)  # 3 x [g, C]
    sources = torch.cat([q] + [o.unsqueeze(-1) for o in offsets], dim=-1)  # [g, C, D + 3]: the kernel's keys
    readers = torch.cat([keys, keys.new_ones(n, len(offsets))], dim=-1)  # [n, D + 3]: its queries
    width = readers.shape[-1]
    values = sources.new_zeros(1, group, n_queries, width)  # the kernel's output is not used
    mass = keys.new_zeros(n, dtype=torch.float32)
    kernel = _kernel()
    if first:
        _, lse_seen = kernel(readers[:first].expand(1, group, first, width), sources.unsqueeze(0), values, 0.0, False,
                             scale=scaling)
        mass[:first] = lse_seen[0].exp().sum(dim=0)
    if tail:  # key j sees queries i >= j: reversed, that is the kernel's causal mask
        _, lse_tail = kernel(readers[first:].flip(0).expand(1, group, tail, width), sources.flip(1).unsqueeze(0),
                             values, 0.0, True, scale=scaling)
        mass[first:] = lse_tail[0].flip(-1).exp().sum(dim=0)
    return mass


def _mass_products(q: torch.Tensor, keys: torch.Tensor, first: int, tail: int, scaling: float, lse: torch.Tensor,
                   needed: int) -> torch.Tensor:
    """``_mass`` of a float32 model: keys [0, first) seen by every query, the last ``tail`` (the chunk's own, one
    a query) causally, only the first ``needed`` scored. Blocks of MASS_BLOCK_KEYS keys against every query (and
    -lse_i as one more dimension): [g * C, block] scores from one matrix product (the queries its long side, as the
    BLAS runs fastest: on the EPYC (Zen 2) 71 GMAC/s, the other way round 41), exponentiated and summed; a tail
    block meets only the queries at or after its first key, and its own triangle is zeroed. Half the flash
    kernel's work, which also multiplies every weight by a zero value."""
    group, n_queries, dim = q.shape
    n = keys.shape[0]
    # row i * g + h: query i of head h, scaled, then -lse: [C * g, D + 1], query-major
    sources = torch.cat([q.float() * scaling, lse.neg().unsqueeze(-1)], dim=-1).transpose(0, 1)
    sources = sources.reshape(n_queries * group, dim + 1)
    mass = torch.zeros(n, dtype=torch.float32, device=q.device)
    block = MASS_BLOCK_KEYS
    scores = torch.empty(n_queries * group * block, dtype=torch.float32, device=q.device)
    for start in range(0, min(first, needed), block):
        end = min(first, needed, start + block)
        readers = torch.cat([keys[start:end].float(), keys.new_ones(end - start, 1, dtype=torch.float32)], dim=-1)
        product = torch.mm(sources, readers.T, out=scores[:sources.shape[0] * (end - start)].view(-1, end - start))
        mass[start:end] = product.exp_().sum(dim=0)
    # row r of a tail block's first block * g rows is query t0 + r // g: it sees the block's key a where r // g >= a
    seen = (torch.arange(block * group, device=q.device) // group).unsqueeze(1) >= torch.arange(block, device=q.device)
    for t0 in range(0, min(tail, needed - first), block):
        t1 = min(tail, needed - first, t0 + block)
        width = t1 - t0
        later = sources[t0 * group:]  # the queries t0 .. C - 1
        readers = torch.cat([keys[first + t0:first + t1].float(),
                             keys.new_ones(width, 1, dtype=torch.float32)], dim=-1)
        product = torch.mm(later, readers.T, out=scores[:later.shape[0] * width].view(-1, width)).exp_()
        product[:width * group].mul_(seen[:width * group, :width])
        mass[first + t0:first + t1] = product.sum(dim=0)
    return mass


def _mass_float32(q, keys, mask, scaling: float, lse: torch.Tensor) -> torch.Tensor:
    """_mass by float32 scores: q [g, C, D], keys [n, D], mask broadcast to [C, n] or None."""
    group, n_queries, dim = q.shape
    weights = torch.addmm(lse.reshape(-1, 1).neg(), q.reshape(-1, dim).float(), keys.float().T, alpha=scaling).exp_()
    weights = weights.view(group, n_queries, -1)
    if mask is not None:
        weights.mul_(mask.expand(n_queries, -1))
    return weights.sum(dim=(0, 1))
