"""Fitting a frozen encoder-decoder's Tensor Cache: λ, η, gate, projection, query maps (SPEC §3, §5).

A pretrained model never learned a Tensor Cache. ``fit_tensor_cache`` freezes every weight and
learns the decay λ and write rate η per KV head, the gate g per layer (or per head) and, by
default, a projection of the memory read of its own per layer (SPEC's tc_proj, d_model x H d_v,
initialised from the layer's output projection so that fitting starts from the tied model):
y = out_proj(local) + γ · memory_proj(r), and, by default, a query map M_h per head (d_k x d_k,
initialised to the identity) that the memory is read with, r = (M_h q) A, and, by default, a write gate
per KV head (d_k + 1 numbers, started where every key is written with strength 1) that scales each
evicted key by 2 sigmoid(u·k̂ + c) as it is written, A <- λA + η s k̂⊗v. With ``tie_projection``
the read goes through out_proj itself, y = out_proj(local + γ r); with ``tie_projection`` and
without ``query_map`` or ``write_gate`` only 2 H_kv + 1 numbers per layer are learned.
Everything is fitted with the exact form under the W-band mask: chunked (the streaming extend over
blocks of ``chunk`` tokens, linear in the context) or, with ``chunk=None``, the dense parallel form.

How the decoder is fed (an encoder-decoder model is run as a language model over the text):
each text is tokenized without special tokens; its first ``encoder_tokens`` tokens go to the
encoder (ordinary cross-attention over them, as context), and the tokens after them are cut
into blocks of ``context`` tokens that the decoder reads with teacher forcing
(decoder input = start token + block[:-1], labels = block). Blocks never overlap the encoder's
tokens, so the decoder cannot copy the far past from the cross-attention.

The loss is the mean NLL over far positions (t >= W, where L2 holds something; nearer positions
do not depend on the parameters). The report compares, on held-out blocks, the NLL of the full
cache, the plain sliding window (gate closed) and the fitted Tensor Cache, near and far.

A fit can continue from an earlier one (``start``; `tc fit --start`). Fitted first on short blocks,
where the rare far-dependent tokens are a larger share of the loss, and then on blocks as long as the
outputs to be generated, the memory learns what to keep first and then how long to keep it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from unlimisum.models.architectures import Architecture
from unlimisum.models.tokens import encode_text
from unlimisum.errors import ConfigError
from unlimisum.tensor_cache.self_attention import ParallelMemory, resolve_architecture, wrapped_self_attention
from unlimisum.tensor_cache.params import TensorCacheParams


@dataclass(frozen=True)
class FitSettings:
    """How λ, η, g are fitted."""

    window: int = 64  # W of L1 during fitting (use the W you will summarize with)
    context: int | None = None  # decoder tokens per block; None: min(4 W, the decoder's position limit)
    steps: int = 200  # optimizer steps (each one batch of blocks)
    batch_size: int = 4  # blocks per step
    learning_rate: float = 0.05  # Adam on logits; they move by O(1), so a large rate is fine
    gate: str = "layer"  # "layer": one gate per layer (as published); "head": one per query head
    normalize_read: bool = True  # r / max(|q·z|, 1): bounds the read for uncalibrated pretrained queries
    encoder_tokens: int = 64  # leading tokens of each text given to the encoder (capped by its window)
    held_out: float = 0.2  # fraction of blocks kept for the report (at least one)
    init_gate_logit: float = -4.0  # γ0 ≈ 0.018: start close to the sliding window (SPEC §5)
    tie_projection: bool = False  # True: read the memory through out_proj (fewest parameters); False: fit its own
    projection_learning_rate: float = 1e-3  # Adam rate of the own projection (its entries are O(0.01-0.1))
    query_map: bool = True  # fit a d_k x d_k map per head that the memory is read with (M q), started at identity
    query_map_learning_rate: float = 1e-3  # Adam rate of the query maps (entries O(1) on the diagonal)
    write_gate: bool = True  # fit a write gate per KV head (which evicted keys A keeps), started at strength 1
    write_gate_learning_rate: float = 1e-2  # Adam rate of the write gates (logits; u·k̂ with ‖k̂‖ = 1)
    # the exact form fitted with: an int, the chunked form over blocks of that many decoder tokens (linear in the
    # context); None, the dense parallel form (quadratic); "auto": whichever of the two (chunks of 32, 64 or 128)
    # runs a step of the first batch fastest on this machine (they give the same numbers)
    chunk: int | str | None = "auto"
    seed: int = 0  # block order

    def __post_init__(self):
        if self.window < 1:
            raise ConfigError(f"--window must be at least 1, got {self.window}")
        if self.chunk != "auto" and self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise ConfigError(f"--chunk must be 'auto', 'dense' or a number of tokens of at least 1, got {self.chunk!r}")
        if self.gate not in ("layer", "head"):
            raise ConfigError(f"--gate must be 'layer' or 'head', got {self.gate!r}")


@dataclass
class FitReport:
    """What fitting learned and how held-out NLL compares (nats per token)."""

    params: TensorCacheParams = field(repr=False)
    window: int
    context: int
    train_blocks: int
    held_out_blocks: int
    steps: int
    seconds: float
    # {"full" | "sliding_window" | "tensor_cache": {"near": nll at t < W, "far": nll at t >= W}}
    nll: dict
    losses: list = field(default_factory=list, repr=False)  # training loss per step
    chunk: int | None = None  # the form fitted with: chunks of this many tokens, or None for the dense form

    def summary(self) -> dict:
        """JSON-ready numbers (no tensors)."""
        out = {key: value for key, value in asdict(self).items() if key not in ("params", "losses")}
        out["decay"] = torch.sigmoid(self.params.decay_logit).tolist()
        out["write_rate"] = torch.sigmoid(self.params.write_logit).tolist()
        out["gate"] = torch.sigmoid(self.params.gate_logit).tolist()
        out["projection"] = self.params.projection
        out["query_map"] = self.params.memory_query_map is not None
        out["write_gate"] = self.params.memory_write_gate is not None
        out["final_loss"] = self.losses[-1] if self.losses else None
        return out


def decoder_position_limit(config) -> int | None:
    """How many decoder positions the model has (None: relative positions, no limit)."""
    for name in ("max_decoder_position_embeddings", "max_position_embeddings"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


@dataclass
class _Block:
    encoder_states: torch.Tensor  # [1, S, d_model]
    encoder_mask: torch.Tensor  # [1, S]
    labels: torch.Tensor  # [C]


def _blocks(model, tokenizer, architecture: Architecture, texts: list[str], settings: FitSettings, context: int) -> list[_Block]:
    device = next(model.parameters()).device
    encoder_tokens = min(settings.encoder_tokens, architecture.max_source_length(model.config, tokenizer))
    blocks = []
    for text in texts:
        ids = encode_text(tokenizer, text).ids
        source, rest = ids[:encoder_tokens], ids[encoder_tokens:]
        if not source or len(rest) < context:
            continue
        source_ids = torch.tensor([source], device=device)
        extra = architecture.encoder_inputs(source_ids) if architecture.encoder_inputs else {}
        with torch.no_grad():
            states = model.get_encoder()(input_ids=source_ids, attention_mask=torch.ones_like(source_ids), **extra).last_hidden_state
        for start in range(0, len(rest) - context + 1, context):
            blocks.append(_Block(states, torch.ones_like(source_ids), torch.tensor(rest[start:start + context], device=device)))
    return blocks


def _token_nll(model, blocks: list[_Block]) -> torch.Tensor:
    """Teacher-forced NLL of every label: [B, C]. Blocks of one batch share the encoder length."""
    start = model.config.decoder_start_token_id
    labels = torch.stack([block.labels for block in blocks])  # [B, C]
    decoder_inputs = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)  # [B, C]
    from unlimisum.models.compat import encoder_outputs

    width = max(block.encoder_states.shape[1] for block in blocks)
    states = torch.cat([nn.functional.pad(b.encoder_states, (0, 0, 0, width - b.encoder_states.shape[1])) for b in blocks])
    mask = torch.cat([nn.functional.pad(b.encoder_mask, (0, width - b.encoder_mask.shape[1])) for b in blocks])
    logits = model(
        encoder_outputs=encoder_outputs(states), attention_mask=mask, decoder_input_ids=decoder_inputs, use_cache=False,
    ).logits  # [B, C, V]
    return nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")  # [B, C]


def _set_memory(wrappers, window: int, chunk: int | None, decay_logit, write_logit, gate_logit, normalize_read: bool,
                heads: int, projections=None, query_maps=None, write_gates=None) -> None:
    """Put every wrapper in parallel mode; gate_logit None closes the gate (sliding window);
    projections None reads through each layer's out_proj (tied)."""
    for layer, wrapper in enumerate(wrappers):
        gate = None
        if gate_logit is not None:
            gate = gate_logit[layer] if gate_logit.shape[1] == heads else gate_logit[layer, 0]
        wrapper.parallel = ParallelMemory(
            window=window, decay=torch.sigmoid(decay_logit[layer]), write_rate=torch.sigmoid(write_logit[layer]),
            gate_logit=gate, normalize_keys=True, normalize_read=normalize_read,
            projection=None if projections is None else projections[layer],
            query_map=None if query_maps is None else query_maps[layer],
            write_gate=None if write_gates is None else write_gates[layer], chunk=chunk,
        )


def _step_seconds(model, wrappers, batch: list[_Block], window: int, chunk: int | None, memory: tuple) -> float:
    """Seconds of one forward and backward pass of the fit's loss on ``batch`` in the form ``chunk``."""
    _set_memory(wrappers, window, chunk, *memory)
    started = time.perf_counter()
    _token_nll(model, batch)[:, window:].mean().backward()
    return time.perf_counter() - started


def _fastest_form(model, wrappers, batch: list[_Block], window: int, context: int, memory: tuple) -> int | None:
    """The exact form (None: dense, or a chunk size) whose step is fastest here, the least of two timings each,
    interleaved. The gradients it leaves are cleared by the first optimizer step."""
    candidates = [None] + [size for size in (32, 64, 128) if size < context]
    times = dict.fromkeys(candidates, math.inf)
    for _ in range(2):
        for chunk in candidates:
            times[chunk] = min(times[chunk], _step_seconds(model, wrappers, batch, window, chunk, memory))
    return min(times, key=times.get)


def _parameter(started: torch.Tensor | None, fresh: torch.Tensor, name: str) -> nn.Parameter:
    """A fitted tensor: from the fit continued from when it has one (of the fresh one's shape), else fresh."""
    if started is None:
        return nn.Parameter(fresh.clone())
    if started.shape != fresh.shape:
        raise ConfigError(f"the Tensor Cache file to continue from has a {name} of shape {list(started.shape)}; "
                          f"this model needs {list(fresh.shape)}")
    return nn.Parameter(started.float().clone().to(fresh.device))


def _evaluate(model, wrappers, blocks, window, chunk, batch_size, memory) -> dict:
    """Mean NLL at t < W and t >= W over ``blocks``; memory: None = full attention, else _set_memory args."""
    near, far = [], []
    for start in range(0, len(blocks), batch_size):
        if memory is None:
            for wrapper in wrappers:
                wrapper.parallel = None
        else:
            _set_memory(wrappers, window, chunk, *memory)
        with torch.no_grad():
            nll = _token_nll(model, blocks[start:start + batch_size])  # [B, C]
        near.append(nll[:, :window].reshape(-1))
        far.append(nll[:, window:].reshape(-1))
    return {"near": float(torch.cat(near).mean()), "far": float(torch.cat(far).mean())}


def fit_tensor_cache(model: nn.Module, tokenizer, texts: list[str], window: int | None = None, *,
                     architecture: Architecture | str | None = None, settings: FitSettings | None = None,
                     model_name: str = "", progress=None, start: TensorCacheParams | None = None) -> FitReport:
    """Learn λ, η (per KV head), g (per layer or head) and, as ``settings`` ask, the memory projections, query
    maps and write gates of a frozen model on ``texts``.

    ``window`` overrides ``settings.window``. ``progress(step, steps, loss)`` is called after each
    step. ``start``: a fit to continue from (its λ, η, gates, and the projections, query maps and write
    gates it has and ``settings`` ask for) instead of the usual starting values. The model's weights are
    not changed (they are frozen during fitting and their requires_grad flags and train/eval mode are
    restored); returns a FitReport whose ``params`` go to ``save_params``.
    """
    settings = settings or FitSettings()
    if window is not None:
        settings = FitSettings(**{**asdict(settings), "window": window})
    window = settings.window
    row = resolve_architecture(architecture or model.config.model_type)
    limit = decoder_position_limit(model.config)
    context = settings.context or (min(4 * window, limit) if limit else 4 * window)
    if limit and context > limit:
        raise ConfigError(f"--context {context} exceeds the decoder's {limit} positions")
    if context <= window:
        raise ConfigError(
            f"--window {window} leaves no far positions in blocks of {context} decoder tokens; "
            f"use a smaller window or a longer --context (the decoder has {limit or 'unlimited'} positions)"
        )
    blocks = _blocks(model, tokenizer, row, texts, settings, context)
    if len(blocks) < 2:
        raise ConfigError(
            f"the texts give {len(blocks)} block(s) of {context} tokens after the first {settings.encoder_tokens}; "
            "fitting needs at least 2 (give more or longer text, or a smaller --context)"
        )
    held = max(1, int(round(settings.held_out * len(blocks))))
    train, evaluation = blocks[:-held], blocks[-held:]

    started = time.perf_counter()
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()  # no dropout: the fitted constants should not learn noise
    for parameter, _ in flags:
        parameter.requires_grad_(False)
    try:
        with wrapped_self_attention(model, row) as wrappers:
            heads, head_dim = wrappers[0].num_heads, wrappers[0].head_dim
            kv_heads = wrappers[0]._projection("key").out_features // head_dim
            initial = TensorCacheParams.initial(
                len(wrappers), kv_heads, window, gate_heads=heads if settings.gate == "head" else 1,
                gate_logit=settings.init_gate_logit, normalize_read=settings.normalize_read,
            )
            device = next(model.parameters()).device
            from_start = lambda name: None if start is None else getattr(start, name)  # noqa: E731
            decay_logit = _parameter(from_start("decay_logit"), initial.decay_logit.to(device), "decay_logit")
            write_logit = _parameter(from_start("write_logit"), initial.write_logit.to(device), "write_logit")
            gate_logit = _parameter(from_start("gate_logit"), initial.gate_logit.to(device), "gate_logit")  # G: --gate
            groups = [{"params": [decay_logit, write_logit, gate_logit], "lr": settings.learning_rate}]
            projections = query_maps = write_gates = None
            if not settings.tie_projection:  # fresh: out_proj, the tied model whatever the gate
                fresh = torch.stack([wrapper._projection("output").weight.detach().float() for wrapper in wrappers])
                projections = _parameter(from_start("memory_projection"), fresh, "memory projection")  # [L, d_model, H d_v]
                groups.append({"params": [projections], "lr": settings.projection_learning_rate})
            if settings.query_map:  # fresh: identity, the layer's own queries as without a map
                fresh = torch.eye(head_dim, device=device).expand(len(wrappers), heads, head_dim, head_dim)
                query_maps = _parameter(from_start("memory_query_map"), fresh, "query map")  # [L, H, d_k, d_k]
                groups.append({"params": [query_maps], "lr": settings.query_map_learning_rate})
            if settings.write_gate:  # fresh: u = 0, c = 0, strength 2 sigmoid(0) = 1 for every key, as without a gate
                fresh = torch.zeros(len(wrappers), kv_heads, head_dim + 1, device=device)
                write_gates = _parameter(from_start("memory_write_gate"), fresh, "write gate")  # [L, H_kv, d_k + 1]
                groups.append({"params": [write_gates], "lr": settings.write_gate_learning_rate})
            optimizer = torch.optim.Adam(groups)
            generator = torch.Generator().manual_seed(settings.seed)
            losses = []
            order: list[int] = []
            memory = (decay_logit, write_logit, gate_logit, settings.normalize_read, heads, projections, query_maps,
                      write_gates)
            chunk = settings.chunk
            if chunk == "auto":
                chunk = _fastest_form(model, wrappers, train[:settings.batch_size], window, context, memory)
            for step in range(settings.steps):
                if len(order) < settings.batch_size:
                    order += torch.randperm(len(train), generator=generator).tolist()
                batch = [train[i] for i in order[:settings.batch_size]]
                del order[:settings.batch_size]
                _set_memory(wrappers, window, chunk, *memory)
                loss = _token_nll(model, batch)[:, window:].mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if progress is not None:
                    progress(step + 1, settings.steps, losses[-1])
            fitted_projections = None if projections is None else projections.detach()
            fitted_query_maps = None if query_maps is None else query_maps.detach()
            fitted_write_gates = None if write_gates is None else write_gates.detach()
            fitted = (decay_logit.detach(), write_logit.detach(), gate_logit.detach(), settings.normalize_read, heads,
                      fitted_projections, fitted_query_maps, fitted_write_gates)
            closed = (decay_logit.detach(), write_logit.detach(), None, settings.normalize_read, heads)
            nll = {
                "full": _evaluate(model, wrappers, evaluation, window, chunk, settings.batch_size, None),
                "sliding_window": _evaluate(model, wrappers, evaluation, window, chunk, settings.batch_size, closed),
                "tensor_cache": _evaluate(model, wrappers, evaluation, window, chunk, settings.batch_size, fitted),
            }
    finally:
        for parameter, requires_grad in flags:
            parameter.requires_grad_(requires_grad)
        model.train(was_training)

    report_numbers = {"nll_held_out": nll, "window": window, "context": context, "steps": settings.steps,
                      "train_blocks": len(train), "held_out_blocks": len(evaluation),
                      "projection": "tied" if settings.tie_projection else "own", "query_map": settings.query_map,
                      "write_gate": settings.write_gate, "chunk": chunk}
    params = TensorCacheParams(
        decay_logit=fitted[0].cpu(), write_logit=fitted[1].cpu(), gate_logit=fitted[2].cpu(), window=window,
        normalize_keys=True, normalize_read=settings.normalize_read, model_type=model.config.model_type,
        model_name=model_name, report=report_numbers,
        memory_projection=None if fitted_projections is None else fitted_projections.cpu(),
        memory_query_map=None if fitted_query_maps is None else fitted_query_maps.cpu(),
        memory_write_gate=None if fitted_write_gates is None else fitted_write_gates.cpu(),
    )
    return FitReport(
        params=params, window=window, context=context, train_blocks=len(train), held_out_blocks=len(evaluation),
        steps=settings.steps, seconds=time.perf_counter() - started, nll=nll, losses=losses, chunk=chunk,
    )


def nll_summary(report: FitReport) -> list[str]:
    """Lines for people: held-out NLL near and far, per mode, and the far-position change vs the sliding window."""
    lines = [f"held-out NLL (nats/token) over {report.held_out_blocks} block(s) of {report.context} tokens, W={report.window}:"]
    for name, label in (("full", "full cache"), ("sliding_window", "sliding window"), ("tensor_cache", "Tensor Cache")):
        values = report.nll[name]
        lines.append(f"  {label:<15} near (t<W) {values['near']:.4f}   far (t>=W) {values['far']:.4f}")
    gain = report.nll["sliding_window"]["far"] - report.nll["tensor_cache"]["far"]
    gap = report.nll["sliding_window"]["far"] - report.nll["full"]["far"]
    share = f" ({100 * gain / gap:.0f}% of the sliding-window gap to the full cache)" if gap > 0 and math.isfinite(gap) else ""
    lines.append(f"  far NLL change vs sliding window: {-gain:+.4f}{share}")
    return lines
