"""Associative recall beyond the window: full cache vs sliding window vs Tensor Cache (SPEC §8).

Task: BOS k1 v1 ... kN vN  f x G  SEP kq1 vq1 ... kqQ vqQ. 32 key tokens (N distinct per
sequence), 32 value tokens, 16 fillers; accuracy of predicting vq after each queried kq (chance
1/32). Every pair is >= G + 2 tokens before its query, more than the sliding-window stack can see
(L (W-1) + 2), so the sliding window is at chance and only L2 can carry the pairs.

Model (identical for all modes): pre-LN GPT, 2 layers, d_model 64, one head of 64, MLP 4x,
RoPE, tied embeddings, token shift (a second embedding of token t-1 added at t); weights N(0, 0.02)
but the attention output and MLP output projections N(0, 0.02/sqrt(2 L)) (GPT-2, as in the
published code; tc_proj keeps 0.02). Tensor Cache =
unlimisum.tensor_cache: exact parallel form for training, outer-product rule, normalised keys,
raw read, λ, η per head, one gate per layer, and (SPEC §1, §8) the memory read through a
projection of its own, y = out(local) + sigmoid(g) · tc_proj(r); mode ``tc_tied`` reads it
through the layer's output projection instead, y = out(local + sigmoid(g) r) (the ablation).
After training: accuracy on fresh sequences, the same through the token-by-token streaming form
(must agree), the TC model with its gate closed (must fall to chance), other gaps, and the
retained state in bytes.

    python -m bench.tc_recall                  # seeds 0, 1, 2 x full, swa, tc: 2000 steps, 1.5-5 min per model
    python -m bench.tc_recall --seeds 0 --modes tc,tc_tied
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from unlimisum.tensor_cache.scan import tensor_cache_attention
from unlimisum.tensor_cache.streaming import MemoryParams, MemoryState, extend_parts

BOS, SEP = 0, 1
KEYS, VALUES, FILLERS = 32, 32, 16
KEY0, VALUE0, FILLER0 = 2, 2 + KEYS, 2 + KEYS + VALUES
VOCAB = FILLER0 + FILLERS


@dataclass(frozen=True)
class TaskConfig:
    pairs: int = 8  # N key-value pairs per sequence
    gap: int = 24  # G filler tokens between the pairs and the queries
    queries: int = 4  # Q queried keys

    @property
    def length(self) -> int:
        return 1 + 2 * self.pairs + self.gap + 1 + 2 * self.queries


def make_batch(task: TaskConfig, batch: int, generator: torch.Generator):
    """tokens [B, T] and the positions whose next token is a queried value [Q]."""
    keys = torch.stack([torch.randperm(KEYS, generator=generator)[: task.pairs] for _ in range(batch)])  # [B, N]
    values = torch.randint(0, VALUES, (batch, task.pairs), generator=generator)  # [B, N]
    fillers = torch.randint(0, FILLERS, (batch, task.gap), generator=generator) + FILLER0
    asked = torch.stack([torch.randperm(task.pairs, generator=generator)[: task.queries] for _ in range(batch)])  # [B, Q]
    pairs = torch.stack([keys + KEY0, values + VALUE0], dim=2).reshape(batch, -1)  # [B, 2N]
    query = torch.stack([keys.gather(1, asked) + KEY0, values.gather(1, asked) + VALUE0], dim=2).reshape(batch, -1)
    tokens = torch.cat([torch.full((batch, 1), BOS), pairs, fillers, torch.full((batch, 1), SEP), query], dim=1)
    start = 1 + 2 * task.pairs + task.gap + 1
    return tokens, torch.arange(start, start + 2 * task.queries, 2)  # positions of kq


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary positions on [B, T, H, d] at ``positions`` [T]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = positions[:, None].float() * freq[None]  # [T, half]
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


@dataclass(frozen=True)
class ModelConfig:
    mode: str = "tc"  # full | swa | tc (reads the memory through projection below)
    window: int = 8  # W of swa and tc
    layers: int = 2
    d_model: int = 64
    heads: int = 1  # one head of 64: L2 needs d_head >= number of key identities (SPEC §8)
    init_decay: float = 0.995
    init_write_rate: float = 0.5
    init_gate_logit: float = 0.0
    projection: str = "own"  # own: the memory read has its own output projection (SPEC's tc_proj); tied: the layer's
    scaled_init: bool = True  # out and MLP output projections N(0, 0.02/sqrt(2L)); False: N(0, 0.02) like the rest


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d, h = config.d_model, config.heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        own = config.mode == "tc" and config.projection == "own"
        self.memory_out = nn.Linear(d, d, bias=False) if own else None  # None: read through self.out (tied)
        logit = lambda p: math.log(p / (1 - p))  # noqa: E731
        self.decay_logit = nn.Parameter(torch.full((h,), logit(config.init_decay)))
        self.write_logit = nn.Parameter(torch.full((h,), logit(config.init_write_rate)))
        self.gate_logit = nn.Parameter(torch.tensor(config.init_gate_logit))
        self.gate_closed = False  # ablation: γ = 0 exactly

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.config.heads, -1).unbind(2)  # [B, T, H, dh]
        return rope(q, positions), rope(k, positions), v

    def _memory(self, big_window: int):
        c = self.config
        window = big_window if c.mode == "full" else c.window
        gate = None if (c.mode != "tc" or self.gate_closed) else self.gate_logit
        return window, torch.sigmoid(self.decay_logit), torch.sigmoid(self.write_logit), gate

    def forward(self, x):  # [B, T, d] -> [B, T, d]
        b, t, _ = x.shape
        q, k, v = self._qkv(x, torch.arange(t))
        window, decay, write_rate, gate = self._memory(t)
        out, local, read = tensor_cache_attention(q, k, v, window, decay, write_rate, gate, return_parts=True)  # [B, T, H, dh]
        if gate is None or self.memory_out is None:
            return self.out(out.reshape(b, t, -1))
        return self.out(local.reshape(b, t, -1)) + torch.sigmoid(gate) * self.memory_out(read.reshape(b, t, -1))

    def stream(self, x, state: MemoryState | None, big_window: int):  # one token: [B, 1, d]
        window, decay, write_rate, gate = self._memory(big_window)
        params = MemoryParams(window=window, decay=decay, write_rate=write_rate,
                              gate=None if gate is None else torch.sigmoid(gate).expand(self.config.heads))
        seen = 0 if state is None else state.seen
        q, k, v = self._qkv(x, torch.tensor([seen]))
        if state is None:
            state = MemoryState.empty(x.shape[0], self.config.heads, q.shape[-1], v.shape[-1], params, x.dtype, x.device)
        local, read, state = extend_parts(state, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), params, q.shape[-1] ** -0.5)
        merge = lambda heads: heads.transpose(1, 2).reshape(x.shape[0], 1, -1)  # noqa: E731  [B, H, 1, dh] -> [B, 1, d]
        if read is None:
            return self.out(merge(local)), state
        if self.memory_out is None:
            return self.out(merge(local + params.gate[None, :, None, None] * read)), state
        return self.out(merge(local)) + torch.sigmoid(gate) * self.memory_out(merge(read)), state


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = Attention(config)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RecallGPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.d_model)
        self.shift = nn.Embedding(VOCAB, config.d_model)  # its own table: "k then v" differs from "v then k"
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.apply(self._init)
        for block in self.blocks if config.scaled_init else []:  # GPT-2's init of the projections into the residual
            for projection in (block.attention.out, block.mlp[2]):  # stream, as in the published code
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def embed_tokens(self, tokens, previous):
        return self.embed(tokens) + self.shift(previous)  # token shift: token t-1 is added at t

    def forward(self, tokens):  # [B, T] -> logits [B, T, V]
        previous = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1)
        x = self.embed_tokens(tokens, previous)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T

    def stream_logits(self, tokens):
        """Token by token with the streaming state; logits [B, T, V] and the retained bytes at the end."""
        states = [None] * len(self.blocks)
        logits, previous = [], torch.full_like(tokens[:, :1], BOS)
        for t in range(tokens.shape[1]):
            x = self.embed_tokens(tokens[:, t:t + 1], previous)
            for i, block in enumerate(self.blocks):
                attended, states[i] = block.attention.stream(block.norm1(x), states[i], tokens.shape[1])
                x = x + attended
                x = x + block.mlp(block.norm2(x))
            logits.append(self.norm(x) @ self.embed.weight.T)
            previous = tokens[:, t:t + 1]
        retained = sum(s.nbytes() for s in states) // tokens.shape[0]  # per sequence
        return torch.cat(logits, dim=1), retained


def accuracy(logits, tokens, query_positions) -> float:
    predicted = logits[:, query_positions].argmax(-1)  # [B, Q]
    return float((predicted == tokens[:, query_positions + 1]).float().mean())


def train(config: ModelConfig, task: TaskConfig, steps: int, batch: int, seed: int, log_every: int) -> tuple[RecallGPT, list]:
    torch.manual_seed(seed)
    model = RecallGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps * 2 // 15)  # 200 of 1500 in the SPEC recipe, the same share of any budget
    schedule = lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(seed + 1)
    history, losses = [], []
    for step in range(steps):
        tokens, where = make_batch(task, batch, generator)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, where].reshape(-1, VOCAB), tokens[:, where + 1].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            history.append({"step": step + 1, "loss": loss.item(), "batch_accuracy": accuracy(logits.detach(), tokens, where)})
            print(f"  [{config.mode}] step {step + 1}/{steps} loss {loss.item():.3f} acc {history[-1]['batch_accuracy']:.3f}", flush=True)
    tail = losses[-max(1, steps // 20):]  # the last 5 % of the steps: one batch's loss is noisy
    history.append({"final_loss": sum(tail) / len(tail), "over_last_steps": len(tail)})
    return model, history


@torch.no_grad()
def evaluate(model: RecallGPT, task: TaskConfig, sequences: int, seed: int, gaps: list[int], stream_sequences: int) -> dict:
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens, where = make_batch(task, sequences, generator)
    parallel = model(tokens)
    result = {"accuracy": accuracy(parallel, tokens, where)}
    few = tokens[:stream_sequences]
    streamed, retained = model.stream_logits(few)
    result["streaming_accuracy"] = accuracy(streamed, few, where)
    result["parallel_accuracy_same_sequences"] = accuracy(parallel[:stream_sequences], few, where)
    result["streaming_max_abs_logit_diff"] = float((streamed - parallel[:stream_sequences]).abs().max())
    result["retained_bytes_per_sequence"] = retained  # after T tokens, all layers, float32
    result["gaps"] = {}
    for gap in gaps:
        other = TaskConfig(task.pairs, gap, task.queries)
        t, w = make_batch(other, sequences, torch.Generator().manual_seed(seed + gap))
        result["gaps"][gap] = accuracy(model(t), t, w)
    long_task = TaskConfig(task.pairs, max(gaps), task.queries)
    t, _ = make_batch(long_task, 1, torch.Generator().manual_seed(seed))
    result["retained_bytes_at_T=%d" % long_task.length] = model.stream_logits(t)[1]
    if model.config.mode == "tc":
        for block in model.blocks:
            block.attention.gate_closed = True
        result["gate_closed_accuracy"] = accuracy(model(tokens), tokens, where)
        for block in model.blocks:
            block.attention.gate_closed = False
        result["learned"] = [
            {"decay": torch.sigmoid(b.attention.decay_logit).tolist(), "write_rate": torch.sigmoid(b.attention.write_logit).tolist(),
             "gate": float(torch.sigmoid(b.attention.gate_logit))} for b in model.blocks
        ]
    return result


MODES = {  # name -> ModelConfig fields
    "full": dict(mode="full"), "swa": dict(mode="swa"), "tc": dict(mode="tc", projection="own"),
    "tc_tied": dict(mode="tc", projection="tied"),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--gap", type=int, default=24)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (one table each)")
    parser.add_argument("--modes", default="full,swa,tc", help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--eval-sequences", type=int, default=1024)
    parser.add_argument("--stream-sequences", type=int, default=128)
    parser.add_argument("--gaps", default="8,24,48,96,192")
    parser.add_argument("--plain-init", action="store_true", help="every weight N(0, 0.02), no scaled residual projections (ablation)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: bench/results/tc_recall.json (tc_recall_quick.json)")
    parser.add_argument("--quick", action="store_true", help="a one-minute smoke run (seed 0, 300 steps: the memory is still learning; BENCHMARKS.md has the full run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_sequences, args.stream_sequences, args.seeds, args.gaps = 300, 256, 16, "0", "8,24,48"
    if args.out is None:
        args.out = "bench/results/tc_recall_quick.json" if args.quick else "bench/results/tc_recall.json"
    torch.set_num_threads(args.threads)
    task = TaskConfig(gap=args.gap)
    gaps = [int(g) for g in args.gaps.split(",")]
    from bench.common import machine, print_table

    results = {"task": asdict(task) | {"length": task.length, "chance": 1 / VALUES}, "steps": args.steps,
               "batch": args.batch, "threads": args.threads, "machine": machine(), "seeds": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        runs = results["seeds"][str(seed)] = {}
        for mode in args.modes.split(","):
            config = ModelConfig(window=args.window, scaled_init=not args.plain_init, **MODES[mode])
            started = time.perf_counter()
            model, history = train(config, task, args.steps, args.batch, seed, max(1, args.steps // 8))
            seconds = time.perf_counter() - started
            result = evaluate(model, task, args.eval_sequences, 12345, gaps, args.stream_sequences)
            result.update(train_seconds=round(seconds, 1), final_loss=history[-1]["final_loss"], history=history,
                          config=asdict(config))
            runs[mode] = result
            print(f"seed {seed} {mode}: accuracy {result['accuracy']:.4f} (streaming {result['streaming_accuracy']:.4f}), "
                  f"gaps {result['gaps']}, final loss {result['final_loss']:.4f}, {seconds:.0f}s", flush=True)
            out.write_text(json.dumps(results, indent=2))  # after every model: a long run keeps what it has
        print(f"\nseed {seed}, {args.steps} steps (accuracy on {args.eval_sequences} fresh sequences; chance {1 / VALUES:.1%}; "
              f"streaming: token by token / parallel, on the first {args.stream_sequences})")
        print_table(
            ["mode", *[f"gap {g}" + (" (train)" if g == args.gap else "") for g in gaps], "streaming", "gate closed",
             "final loss", "retained B @T=%d" % task.length],
            [[mode, *[f"{(r['accuracy'] if g == args.gap else r['gaps'][g]):.2%}" for g in gaps], f"{r['streaming_accuracy']:.2%} / {r['parallel_accuracy_same_sequences']:.2%}",
              f"{r['gate_closed_accuracy']:.2%}" if "gate_closed_accuracy" in r else "-", f"{r['final_loss']:.4f}",
              r["retained_bytes_per_sequence"]] for mode, r in runs.items()],
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
