"""Tensor Cache on a frozen, trained encoder-decoder: sliding window vs fitted Tensor Cache vs full cache.

Task (sequence to sequence, word-level symbols): the encoder reads L = 8 distinct keys (of 16); the
decoder writes

    k3=5 k0=1 ... (L tokens)   f x G   ?   k0 v1  k3 v5 ... (L questions, each key then its value)   </s>

for each of the input's keys, in order, one token "k{i}={j}" giving it a random value j (of 8: the
pairing exists only in the decoder's output; one token per pair makes the binding local, as SPEC §8's
token shift does for its recall task), G random fillers, "?", then every key again in a new order, each
followed by the value it was given more than G tokens earlier. Only the decoder's own far past can
answer: a sliding window with W < G is at chance (1/8), the full cache is not.

A tiny T5 (2+2 layers, relative positions: outputs of any length) is trained on it with the full
cache, then frozen. With the decoder's self-attention bounded to W tokens we compare, by
teacher-forced decoding through the real caches (the TensorCache inside the model's own forward,
fed 64 tokens per call):

    full cache       transformers' DynamicCache
    sliding window   TensorCache with the gate closed (bit for bit transformers' sliding window)
    tc_tied          fit_tensor_cache (what `unlimisum tc fit` runs) with --tie-projection --no-query-map --no-write-gate
    tc_own           the memory read's own projection, --no-query-map --no-write-gate
    tc_own_map       own projection and a query map per head, --no-write-gate
    tc_own_map_gate  tc fit's defaults: own projection, query maps and a write gate per head

each fitted in stages (--fit-gap 200,800 --fit-steps 2000,2000): first on shorter outputs, then, continuing
from there (`tc fit --start`), on outputs of the longest length; accuracy of the answers and retained
self-attention bytes at growing output lengths, and the time of one decoding step (one token, batch 1) of each
mode at the longest length.

    python -m bench.tc_decoder            # trains the model once (about 10 minutes; cached in bench/.cache/)
    python -m bench.tc_decoder --jobs 2   # the four fits (15-20 minutes each) two at a time
    python -m bench.tc_decoder --quick    # smoke run: a briefly trained model, short outputs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from bench.common import RESULTS, machine, print_table

KEYS, VALUES, FILLERS = 8, 8, 16
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "?"]
WORDS = (SPECIALS + [f"k{i}" for i in range(KEYS)] + [f"v{j}" for j in range(VALUES)]
         + [f"k{i}={j}" for i in range(KEYS) for j in range(VALUES)] + [f"f{i}" for i in range(FILLERS)])
BOS, PAD, EOS, UNK, ASK = range(len(SPECIALS))
KEY0 = len(SPECIALS)
VALUE0 = KEY0 + KEYS
PAIR0 = VALUE0 + VALUES  # "k{i}={j}": key i given value j, one token (the binding is local, as SPEC §8's token shift makes it)
FILLER0 = PAIR0 + KEYS * VALUES


CACHE = Path(__file__).resolve().parent / ".cache"  # the trained model (not in git)
TRAINING = "AdamW 3e-3, warmup 5 %, cosine to 10 %, gaps grown over the first half; every output token, answers weighted x4"  # in the cache key


@dataclass(frozen=True)
class Task:
    listed: int = 8  # keys the input names; the decoder gives each a value, then is asked for all of them
    min_gap: int = 32  # training gaps G are drawn uniformly from [min_gap, max_gap] (one per batch)
    max_gap: int = 160

    def output_length(self, gap: int) -> int:
        return self.listed + gap + 1 + 2 * self.listed + 1


@dataclass(frozen=True)
class ModelSize:
    d_model: int = 128
    heads: int = 2  # d_head 64: the memory of a head tells apart about d_head keys (SPEC §8)
    layers: int = 2  # encoder and decoder each
    ffn: int = 256
    max_distance: int = 64  # T5's relative positions: every distance >= 64 shares one bucket


def tokenizer():
    """A word-level tokenizer of the task's symbols (what `tc fit` tokenizes its texts with)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=4096)


def make_batch(task: Task, batch: int, gap: int, generator: torch.Generator):
    """(encoder ids [B, L], labels [B, T], answer positions [L] in labels).

    labels: for each of the input's L keys, in order, one token "k{i}={j}" giving it a random value j (the
    pairing exists only in the decoder's output); G random fillers; "?"; then every key again, in a new
    order, each followed by its value: the answers.
    """
    keys = torch.stack([torch.randperm(KEYS, generator=generator)[: task.listed] for _ in range(batch)])  # [B, L]
    values = torch.randint(0, VALUES, (batch, task.listed), generator=generator)  # [B, L]
    order = torch.rand(batch, task.listed, generator=generator).argsort(1)  # [B, L]: the order of the questions
    asked = torch.stack([keys.gather(1, order) + KEY0, values.gather(1, order) + VALUE0], dim=2).flatten(1)  # [B, 2L]
    fillers = torch.randint(0, FILLERS, (batch, gap), generator=generator) + FILLER0
    labels = torch.cat([PAIR0 + keys * VALUES + values, fillers, torch.full((batch, 1), ASK), asked,
                        torch.full((batch, 1), EOS)], dim=1)
    first = task.listed + gap + 2  # the first answer
    return keys + KEY0, labels, torch.arange(first, first + 2 * task.listed, 2)


def build_model(size: ModelSize):
    """A T5 (relative positions: outputs of any length, trained short, read long)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=len(WORDS), d_model=size.d_model, d_kv=size.d_model // size.heads, num_heads=size.heads,
        d_ff=size.ffn, num_layers=size.layers, num_decoder_layers=size.layers, dropout_rate=0.0,
        relative_attention_max_distance=size.max_distance, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    return T5ForConditionalGeneration(config)


def decoder_inputs(labels: torch.Tensor) -> torch.Tensor:
    """Teacher forcing as `tc fit` does it: the start token, then the labels but the last."""
    return torch.cat([torch.full_like(labels[:, :1], PAD), labels[:, :-1]], dim=1)


def train(task: Task, size: ModelSize, steps: int, batch: int, seed: int, log_every: int):
    """The full-cache model: next-token loss over every output token (what `tc fit`'s loss also covers), the
    answers weighted 4x (they are 8 tokens of hundreds). The gaps grow during the first half (from 4 tokens
    to ``max_gap``: the retrieval is learned on short ones first), then are drawn from the task's range."""
    torch.manual_seed(seed)
    model = build_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(seed + 1)
    history = []
    model.train()
    for step in range(steps):
        grown = min(1.0, step / (steps / 2))
        low, high = (0, int(4 + (task.max_gap - 4) * grown)) if grown < 1 else (task.min_gap, task.max_gap)
        gap = int(torch.randint(low, high + 1, (1,), generator=generator))
        keys, labels, answers = make_batch(task, batch, gap, generator)
        logits = model(input_ids=keys, attention_mask=torch.ones_like(keys), decoder_input_ids=decoder_inputs(labels)).logits
        every = nn.functional.cross_entropy(logits.transpose(1, 2), labels)
        loss = every + 4 * nn.functional.cross_entropy(logits[:, answers].transpose(1, 2), labels[:, answers])
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            accuracy = float((logits[:, answers].argmax(-1) == labels[:, answers]).float().mean())
            history.append({"step": step + 1, "gap": gap, "loss": loss.item(), "answer_accuracy": accuracy})
            print(f"  [train] step {step + 1}/{steps} gap {gap} loss {loss.item():.3f} answers {accuracy:.3f}", flush=True)
    model.eval()
    return model, history


def trained_model(task: Task, size: ModelSize, steps: int, batch: int, seed: int, folder: Path, retrain: bool):
    """The frozen model: loaded from ``folder`` when it was trained with these settings, else trained and saved."""
    from transformers import T5ForConditionalGeneration
    from transformers.utils import logging

    logging.disable_progress_bar()
    recipe = {"task": asdict(task), "size": asdict(size), "steps": steps, "batch": batch, "seed": seed, "words": WORDS,
              "training": TRAINING}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    stamp = folder / "recipe.json"
    if not retrain and stamp.is_file() and json.loads(stamp.read_text()).get("digest") == digest:
        print(f"loading the trained model from {folder}", flush=True)
        saved = json.loads(stamp.read_text())
        return T5ForConditionalGeneration.from_pretrained(folder).eval(), saved["history"], saved["train_seconds"]
    started = time.perf_counter()
    model, history = train(task, size, steps, batch, seed, max(1, steps // 10))
    seconds = time.perf_counter() - started
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    stamp.write_text(json.dumps({"digest": digest, "recipe": recipe, "history": history, "train_seconds": seconds}, indent=2))
    return model, history, seconds


def texts(task: Task, count: int, gap: int, seed: int) -> list[str]:
    """Examples as `tc fit` reads texts: the encoder's N keys, then the decoder's output."""
    keys, labels, _ = make_batch(task, count, gap, torch.Generator().manual_seed(seed))
    return [" ".join(WORDS[i] for i in row) for row in torch.cat([keys, labels], dim=1).tolist()]


# the fits compared: name -> (tie_projection, query_map, write_gate), i.e. `tc fit --tie-projection --no-query-map
# --no-write-gate`, `tc fit --no-query-map --no-write-gate`, `tc fit --no-write-gate` and `tc fit` (its defaults)
FITS = {"tc_tied": (True, False, False), "tc_own": (False, False, False), "tc_own_map": (False, True, False),
        "tc_own_map_gate": (False, True, True)}


def fit(model, task: Task, window: int, gaps: list[int], examples: int, steps: list[int], name: str, seed: int):
    """`tc fit` in stages, shortest outputs first: each stage fits on texts of its gap for its steps, continuing
    from the stage before (`tc fit --start`). Returns the last stage's report, its "stages" listing every stage."""
    from unlimisum.tensor_cache.fit import FitSettings, fit_tensor_cache

    tie, query_map, write_gate = FITS[name]
    report, stages = None, []
    for stage, (gap, stage_steps) in enumerate(zip(gaps, steps)):
        settings = FitSettings(window=window, context=task.output_length(gap), steps=stage_steps,
                               encoder_tokens=task.listed, tie_projection=tie, query_map=query_map,
                               write_gate=write_gate, seed=seed + stage)
        started = time.perf_counter()
        report = fit_tensor_cache(model, tokenizer(), texts(task, examples, gap, seed=1000 + seed + stage),
                                  settings=settings, architecture=model.config.model_type,
                                  model_name="tc_decoder bench model", start=report.params if report else None)
        stages.append({"gap": gap, "context": report.context, "steps": stage_steps, "seconds": round(report.seconds, 1),
                       "chunk": report.chunk, "nll_held_out": report.nll, "final_loss": report.losses[-1]})
        print(f"  [fit {name}, stage {stage + 1}: {report.context} tokens] {time.perf_counter() - started:.0f}s, "
              "held-out far NLL: " + ", ".join(f"{k} {v['far']:.4f}" for k, v in report.nll.items()), flush=True)
    report.stages = stages
    return report


def _fit_saved_model(folder: Path, threads: int, **fit_settings):
    """``fit`` in a worker process, on the model saved in ``folder`` (what --jobs runs)."""
    from transformers import T5ForConditionalGeneration

    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = T5ForConditionalGeneration.from_pretrained(folder).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return fit(model, **fit_settings)


def fit_all(model, folder: Path, names: list[str], jobs: int, threads: int, **fit_settings) -> dict:
    """Every fit in ``names``: here, or with ``jobs`` > 1 in that many worker processes (the fits are independent)."""
    if jobs <= 1:
        return {name: fit(model, name=name, **fit_settings) for name in names}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(_fit_saved_model, folder, threads, name=name, **fit_settings) for name in names}
        return {name: future.result() for name, future in futures.items()}


def caches(model, mode: str, window: int, params):
    """A context manager yielding a maker of fresh caches for ``mode``: "full" (DynamicCache), "swa_transformers"
    (transformers' sliding-window layers, model unwrapped), else a TensorCache of ``params`` (None: gate closed)."""
    from contextlib import contextmanager

    from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer, EncoderDecoderCache

    from unlimisum.tensor_cache import TensorCacheSettings, tensor_cache

    @contextmanager
    def plain(make):
        yield make

    if mode == "full":
        return plain(lambda: EncoderDecoderCache(DynamicCache(), DynamicCache()))
    if mode == "swa_transformers":
        layers = getattr(model.config, "num_decoder_layers", None) or model.config.decoder_layers
        return plain(lambda: EncoderDecoderCache(Cache(layers=[DynamicSlidingWindowLayer(window) for _ in range(layers)]), DynamicCache()))

    @contextmanager
    def bounded():
        with tensor_cache(model, model.config.model_type, TensorCacheSettings(window=window, params=params)) as session:
            yield session.new_cache

    return bounded()


@torch.no_grad()
def evaluate(model, task: Task, mode: str, window: int, params, gap: int, sequences: int, batch: int, chunk: int = 64) -> dict:
    """Answer accuracy and retained bytes per sequence after the whole output, decoding ``chunk`` tokens per call."""
    from unlimisum.models import compat
    from unlimisum.models.compat import encoder_outputs
    from unlimisum.tensor_cache import retained_bytes

    generator = torch.Generator().manual_seed(777 + gap)
    correct, total, retained = 0, 0, 0
    with caches(model, mode, window, params) as new_cache:
        for _ in range(0, sequences, batch):
            keys, labels, answers = make_batch(task, batch, gap, generator)
            mask = torch.ones_like(keys)
            states = encoder_outputs(model.get_encoder()(input_ids=keys, attention_mask=mask).last_hidden_state)
            inputs, cache, logits = decoder_inputs(labels), new_cache(), []
            for start in range(0, inputs.shape[1], chunk):
                out = model(encoder_outputs=states, attention_mask=mask, decoder_input_ids=inputs[:, start:start + chunk],
                            **{compat.cache_argument(model): cache}, use_cache=True)
                logits.append(out.logits)
            predicted = torch.cat(logits, dim=1)[:, answers].argmax(-1)  # [B, Q]
            correct += int((predicted == labels[:, answers]).sum())
            total += predicted.numel()
            retained = retained_bytes(cache) // batch
    return {"accuracy": correct / total, "retained_bytes": retained, "output_tokens": task.output_length(gap)}


@torch.no_grad()
def step_times(model, modes: dict, window: int, encoder_states, inputs: torch.Tensor, steps: int, rounds: int) -> dict:
    """Seconds of one decoding step (one token, batch 1) after a prefill of all but the last ``steps`` tokens of
    ``inputs`` [1, T]: per mode the median over the steps of a round, the least over ``rounds`` rounds (the
    machine is shared: a busy moment only adds time). Modes are interleaved within each round."""
    from unlimisum.models import compat
    from unlimisum.models.compat import encoder_outputs

    states = encoder_outputs(encoder_states)
    mask = torch.ones(encoder_states.shape[:2], dtype=torch.long)
    argument = compat.cache_argument(model)
    prefill = inputs.shape[1] - steps
    medians = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode, params in modes.items():
            with caches(model, mode, window, params) as new_cache:
                cache, times = new_cache(), []
                model(encoder_outputs=states, attention_mask=mask, decoder_input_ids=inputs[:, :prefill], use_cache=True, **{argument: cache})
                for t in range(prefill, inputs.shape[1]):
                    started = time.perf_counter()
                    model(encoder_outputs=states, attention_mask=mask, decoder_input_ids=inputs[:, t:t + 1], use_cache=True, **{argument: cache})
                    times.append(time.perf_counter() - started)
            medians[mode].append(statistics.median(times))
    return {mode: min(values) for mode, values in medians.items()}


def real_size_step_times(size: str, window: int, output_tokens: int, steps: int, rounds: int) -> dict:
    """The same timing on BART of a real size with random weights (speed does not depend on them), gate open."""
    from bench.common import random_model
    from unlimisum.tensor_cache import TensorCacheParams

    loaded = random_model(size)
    model, config = loaded.model, loaded.model.config
    tied = TensorCacheParams.initial(config.decoder_layers, config.decoder_attention_heads, window, gate_logit=0.0)
    own = replace(tied, memory_projection=torch.stack([layer.self_attn.out_proj.weight.detach() for layer in model.get_decoder().layers]))
    heads, head_dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
    mapped = replace(own, memory_query_map=torch.eye(head_dim).expand(config.decoder_layers, heads, head_dim, head_dim).clone())
    gated = replace(mapped, memory_write_gate=torch.randn(config.decoder_layers, heads, head_dim + 1, generator=torch.Generator().manual_seed(1)))
    generator = torch.Generator().manual_seed(0)
    encoder_states = torch.randn(1, 512, config.d_model, generator=generator)
    inputs = torch.randint(4, config.vocab_size, (1, output_tokens), generator=generator)
    modes = {"swa_transformers": None, "sliding_window": None, "full": None, "tc_tied": tied, "tc_own": own,
             "tc_own_map": mapped, "tc_own_map_gate": gated}
    return step_times(model, modes, window, encoder_states, inputs, steps, rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--gaps", default="100,200,400,800", help="output lengths are gap + 26")
    parser.add_argument("--fit-gap", default="200,800",
                        help="the gaps of the texts tc fit learns on, one per stage, shortest first (the last: the longest)")
    parser.add_argument("--fit-examples", type=int, default=200)
    parser.add_argument("--fit-steps", default="2000,2000", help="optimizer steps of each stage")
    parser.add_argument("--eval-sequences", type=int, default=256)
    parser.add_argument("--timing-steps", type=int, default=32)
    parser.add_argument("--timing-rounds", type=int, default=5)
    parser.add_argument("--real-size", default="bart-base", help="also time a random model of this size ('' to skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1, help="fit in this many processes at once (each --threads)")
    parser.add_argument("--fits", default=",".join(FITS), help="the fits to compare, of " + ", ".join(FITS))
    parser.add_argument("--retrain", action="store_true", help="train the model even when a cached one fits the recipe")
    parser.add_argument("--quick", action="store_true", help="smoke run: 150 training steps, short outputs, few sequences")
    args = parser.parse_args(argv)
    task, size = Task(), ModelSize()
    folder = CACHE / "tc_decoder_model"
    if args.quick:
        task = Task(min_gap=16, max_gap=48)
        args.train_steps, args.batch, args.gaps, args.fit_gap, args.fit_examples = 150, 16, "48,80", "32,64", 24
        args.fit_steps, args.eval_sequences, args.timing_steps, args.timing_rounds, args.real_size = "5,5", 32, 8, 2, ""
        folder = CACHE / "tc_decoder_model_quick"
    torch.set_num_threads(args.threads)
    gaps = [int(g) for g in args.gaps.split(",")]
    fit_gaps = [int(g) for g in args.fit_gap.split(",")]
    fit_steps = [int(s) for s in args.fit_steps.split(",")]
    if len(fit_steps) == 1:
        fit_steps *= len(fit_gaps)
    if len(fit_steps) != len(fit_gaps):
        parser.error(f"--fit-steps gives {len(fit_steps)} stages, --fit-gap {len(fit_gaps)}")

    model, history, train_seconds = trained_model(task, size, args.train_steps, args.batch, args.seed, folder, args.retrain)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    names = [name for name in args.fits.split(",") if name]
    unknown = set(names) - set(FITS)
    if unknown:
        parser.error(f"unknown --fits {', '.join(sorted(unknown))}; choose from {', '.join(FITS)}")
    reports = fit_all(model, folder, names, args.jobs, args.threads, task=task, window=args.window, gaps=fit_gaps,
                      examples=args.fit_examples, steps=fit_steps, seed=args.seed)
    modes = {"full": None, "sliding_window": None, **{name: report.params for name, report in reports.items()}}

    results = {"task": asdict(task), "size": asdict(size), "window": args.window, "train_steps": args.train_steps,
               "train_seconds": round(train_seconds, 1), "train_history": history, "fit_gaps": fit_gaps,
               "fit_steps": fit_steps, "fit_examples": args.fit_examples,
               "fit": {name: {**report.summary(), "stages": report.stages} for name, report in reports.items()},
               "accuracy": {}, "machine": machine()}
    for gap in gaps:
        row = results["accuracy"][str(task.output_length(gap))] = {}
        for mode, params in modes.items():
            row[mode] = evaluate(model, task, mode, args.window, params, gap, args.eval_sequences, batch=32)
        full, window = row["full"]["accuracy"], row["sliding_window"]["accuracy"]
        for mode in reports:
            row[mode]["share_of_gap_recovered"] = (row[mode]["accuracy"] - window) / (full - window) if full > window else None
        print(f"T={task.output_length(gap)}: " + ", ".join(f"{m} {r['accuracy']:.3f} ({r['retained_bytes']} B)" for m, r in row.items()), flush=True)

    timed = {"swa_transformers": None, "sliding_window": None, "full": None, **modes}
    keys, labels, _ = make_batch(task, 1, max(gaps), torch.Generator().manual_seed(5))
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=keys, attention_mask=torch.ones_like(keys)).last_hidden_state
    times = step_times(model, timed, args.window, encoded, decoder_inputs(labels), args.timing_steps, args.timing_rounds)
    results["step_seconds"] = {"frozen model": times}
    if args.real_size:
        results["step_seconds"][f"random {args.real_size}"] = real_size_step_times(
            args.real_size, args.window, task.output_length(max(gaps)), args.timing_steps, args.timing_rounds)
    path = RESULTS / ("tc_decoder_quick.json" if args.quick else "tc_decoder.json")
    path.write_text(json.dumps(results, indent=2))

    print(f"\nfrozen T5 {size.layers}+{size.layers} layers, d_model {size.d_model}, {size.heads} heads; W={args.window}; "
          f"answer accuracy on {args.eval_sequences} sequences (chance {1 / VALUES:.1%}), retained self-attention bytes per sequence")
    names = list(modes)
    print_table(["output tokens", *names, *[f"{m} share of gap" for m in reports]],
                [[t, *[f"{row[m]['accuracy']:.1%} / {row[m]['retained_bytes']:,} B" for m in names],
                  *[f"{row[m]['share_of_gap_recovered']:.0%}" if row[m]["share_of_gap_recovered"] is not None else "-" for m in reports]]
                 for t, row in results["accuracy"].items()])
    for model_name, times in results["step_seconds"].items():
        print(f"\none decoding step of the {model_name} at T={task.output_length(max(gaps))}, W={args.window} "
              f"(batch 1; median of {args.timing_steps} steps, least of {args.timing_rounds} rounds):")
        print_table(["mode", "ms / step", "vs sliding window (ours)", "vs transformers' sliding window"],
                    [[m, f"{1000 * t:.3f}", f"{t / times['sliding_window'] - 1:+.1%}", f"{t / times['swa_transformers'] - 1:+.1%}"]
                     for m, t in times.items()])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
