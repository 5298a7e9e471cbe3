"""Evidence on the trained needle: is the top-1 source of the answer's sentence the needle, and what the pass costs.

    python -m bench.evidence [--quick] [--trials 10] [--lengths 1,50,100,200] [--top-k 16] [--model tests/fixtures/needle]

The model is the tiny BART of bench/train_needle.py (a 64-token window). Each input is filler words with
one span ``<needle> d d d d </needle>`` at a relative position of the text; the input length is given in
windows. Per trial the summary is generated (greedy, 10 new tokens at most) and read once more by the
evidence pass; it counts as:

- copied: the summary is the span's digits exactly (as bench/needle_eval.py);
- top-1 is the needle: the first source of the summary's sentence covers the span's digits (its
  character range in the text holds them);
- cost: the evidence pass's seconds over generate()'s, summed over the cell's trials. The needle's
  summaries are 5-8 tokens, where the pass's fixed cost (one decoder forward) weighs most; a second table
  forces summaries of 60 tokens (the decoder's 64 positions allow no more) to show how it scales with length.

With ``--decoder-only``, instead: what evidence adds to generation for a decoder-only model of Qwen2.5-0.5B's
shape (random weights; ``--decoder-layers`` of its 24), greedy summaries forced to 32 and 128 tokens after a
prompt of ``--decoder-tokens`` tokens, read with a 1,024-token window and k=1,024 (bfloat16 weights):
recorded while generating (greedy search and sampling) and by the reread pass (beam search; forced here).

With ``--support``, instead: is support (the answer sentence read again with its passages hidden) what it claims,
on the trained needle: the answer's support against a control that hides as many random tokens of the same
text (outside the passages), and how often attention's first passage is the one whose removal alone hurts most;
by hiding the passages from retrieval and by removing them from the input (their windows encoded again), with the
weights in float32 and bfloat16 (``--dtypes``). Writes bench/results/evidence_support.json.

With ``--real``, instead: what the evidence pass and its support (each sentence read again with its passages
hidden) cost at real sizes, against generate() on the same store (greedy: the reading recorded while
generating, whose cost is generation with recording against without; beams: the summary read again):
bart-base and bart-large shapes (random weights in ``--dtype``, float32 unless asked), exact stores of ``--tokens``
synthetic states, summaries forced to ``--new-tokens`` (default 64), greedy and 4 beams. The summary is cut into
sentences of 16 tokens, each with three 33-token passages, as the pass finds them. The store is built directly
(encoding costs the same with any weights: bench/time_to_summary.py has it). Writes bench/results/evidence_real.json
(``--name``: another name).

Writes bench/results/evidence.json.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from bench.common import print_position_table, print_table, write_result
from bench.needle_eval import GENERATION, POSITIONS
from bench.train_needle import FIXTURE, document
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer


def needle_cited(summary, text: str, content: str) -> bool:
    """The first source of the first sentence holds the needle's digits."""
    if not summary.evidence or not summary.evidence[0].sources:
        return False
    first = summary.evidence[0].sources[0]
    at = text.index(content, text.index("<needle>"))
    return first.start_char <= at and at + len(content) <= first.end_char


def run(model: Path, lengths: list[int], trials: int, top_k: int, seed: int = 0) -> dict:
    loaded = load_model(ModelConfig(name=str(model), device="cpu"))
    window = loaded.max_source_length
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=top_k),
                            index=IndexConfig(kind="exact", device="cpu"))
    summarizer.summarize(document(window - 2, 0.5, random.Random(seed))[0])  # the kernels measured first
    started = time.perf_counter()
    cells = []
    for length in lengths:
        for p, position in enumerate(POSITIONS):
            rng = random.Random(seed * 1_000_003 + length * 1009 + p)
            cell = {"length": length, "position": position, "trials": trials, "copied": 0, "cited": 0,
                    "cited_when_copied": 0, "generate_seconds": 0.0, "evidence_seconds": 0.0}
            for _ in range(trials):
                text, content = document(length * window - 2, position, rng)
                summary = summarizer.summarize(text)
                copied = summary.text == content
                cited = needle_cited(summary, text, content)
                cell["copied"] += copied
                cell["cited"] += cited
                cell["cited_when_copied"] += copied and cited
                cell["generate_seconds"] += summary.stats.timings["generate"]
                cell["evidence_seconds"] += summary.stats.timings["evidence"]
            cells.append(cell)
    forced = []  # the pass's cost for summaries of a given length (the model made to write them)
    for new_tokens in (10, 60):
        long = Summarizer(loaded, generation=GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                               num_beams=1, do_sample=False),
                          retrieval=RetrievalConfig(retrieval_k=top_k), index=IndexConfig(kind="exact", device="cpu"))
        for length in lengths:
            rng = random.Random(seed + length)
            row = {"new_tokens": new_tokens, "length": length, "generate_seconds": 0.0, "evidence_seconds": 0.0}
            for _ in range(trials):
                summary = long.summarize(document(length * window - 2, rng.random(), rng)[0])
                row["generate_seconds"] += summary.stats.timings["generate"]
                row["evidence_seconds"] += summary.stats.timings["evidence"]
            forced.append(row)
    return {"window": window, "top_k": top_k, "trials": trials, "positions": list(POSITIONS), "cells": cells,
            "forced": forced, "seconds": time.perf_counter() - started}


def decoder_only_cost(n_tokens: int, layers: int, trials: int = 2) -> list[dict]:
    """What evidence adds to generation for a Qwen2.5-0.5B-shaped random model, greedy, per forced summary
    length: recorded while generating (what greedy search and sampling do), and by the reread pass (what beam
    search does, forced here on the same greedy summary); each against the same run without evidence."""
    from bench.common import VOCAB, random_text, word_tokenizer
    from bench.decoder_only import QWEN_05B, random_model as random_decoder
    from unlimisum.config import EncodingConfig, PromptConfig
    from unlimisum.decoder_only.summarize import DecoderOnlySummarizer
    from unlimisum.models import LoadedModel
    from unlimisum.models.architectures import architecture_for

    model = random_decoder(dict(QWEN_05B, num_hidden_layers=layers, vocab_size=VOCAB)).to(torch.bfloat16)
    loaded = LoadedModel(model=model, tokenizer=word_tokenizer(max_length=QWEN_05B["max_position_embeddings"]),
                         architecture=architecture_for(model.config), name="random qwen2.5-0.5b shape")
    text = random_text(n_tokens)
    original = DecoderOnlySummarizer._rereads
    rows = []
    for new_tokens in (32, 128):
        generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1,
                                       do_sample=False)
        row = {"new_tokens": new_tokens, "prompt_tokens": n_tokens, "layers": layers}
        ways = {name: (Summarizer(loaded, encoding=EncodingConfig(window=1024), prompt=PromptConfig(template="{text}"),
                                  retrieval=RetrievalConfig(retrieval_k=1024, evidence=name != "plain"),
                                  generation=generation), name == "reread")
                for name in ("plain", "recorded", "reread")}
        # in turns, so that a busy moment of the machine falls on all three alike; the prefill is not counted
        # (evidence changes only what follows it)
        for _ in range(trials):
            for name, (summarizer, reread) in ways.items():
                DecoderOnlySummarizer._rereads = (lambda self, kwargs: True) if reread else original
                timings = summarizer.summarize(text).stats.timings
                seconds = timings["generate"] + timings.get("evidence", 0.0)
                row[f"{name}_seconds"] = row.get(f"{name}_seconds", 0.0) + seconds
        DecoderOnlySummarizer._rereads = original
        for name in ("recorded", "reread"):
            row[f"{name}_cost"] = row[f"{name}_seconds"] / row["plain_seconds"] - 1
        print(f"  decoder-only, {new_tokens} tokens: recorded {row['recorded_cost']:+.1%}, "
              f"reread {row['reread_cost']:+.1%} over generate", flush=True)
        rows.append(row)
    return rows


def real_cost(sizes: list[str], n_values: list[int], new_tokens: int, beams: list[int], seed: int = 0,
              key_stores: tuple[str, ...] = ("shared",), dtype: str = "float32") -> list[dict]:
    """generate(), the evidence pass and its support, in seconds, per model size, store size, key store (the
    shared store, or per-layer keys built from it as the encoder builds them) and beam count, with the weights in
    ``dtype`` (``auto``: what ``--dtype auto`` chooses on this CPU)."""
    from bench.common import random_model
    from bench.index_choice import synthetic_store
    from unlimisum.evidence import Source
    from unlimisum.models.loading import resolve_dtype
    from unlimisum.search.keys import build_key_store, key_weights, value_weights
    from unlimisum.unlimiformer.reread import SummaryReader, end_tokens, returned_length, supports_of

    rows = []
    rng = random.Random(seed)
    for size in sizes:
        loaded = random_model(size)
        loaded.model.to(resolve_dtype(dtype, torch.device("cpu")))
        d = loaded.model.config.d_model
        for n, key_store in [(n, kind) for n in n_values for kind in key_stores]:
            store = synthetic_store(n, d, IndexConfig(kind="exact", device="cpu"))
            if key_store.startswith("per-layer"):  # k < N: the keys, as the encoder builds them (and "+values")
                values = value_weights(loaded.model, loaded.architecture) if key_store.endswith("+values") else None
                store.keys = build_key_store(store.states(), key_weights(loaded.model, loaded.architecture),
                                             value_weights=values)
            for num_beams in beams:
                generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                               num_beams=num_beams, do_sample=False)
                family = Summarizer(loaded, generation=generation).family
                plain = family.generate([store], coverage=False)  # generation alone, for the recording's cost
                run = family.generate([store], coverage=False, record=True)  # greedy: recorded; beams: not
                row_ids = run.token_ids[0].tolist()
                ids = row_ids[:returned_length(row_ids, end_tokens(loaded))]
                sentences = [list(range(start, min(start + 16, len(ids)))) for start in range(1, len(ids), 16)]
                started = time.perf_counter()
                with SummaryReader(loaded, family.retrieval_k()) as reader:
                    if run.recorder is not None:
                        reading = run.recorder.reading(0, reader, ids)
                    else:
                        reading = reader.read(store, ids, starts=[rows_[0] - 1 for rows_ in sentences])
                    read = time.perf_counter()
                    hidden = []  # each sentence's passages: three of 33 tokens at random
                    for rows_ in sentences:
                        peaks = [rng.randrange(16, n - 17) for _ in range(3)]
                        hidden.append((rows_, [Source(0, "", 0, 1, 1 / 3, "", peak - 16, peak + 17) for peak in peaks]))
                    supports_of(reader, reading, store, hidden)  # as a summary's, all at once
                finished = time.perf_counter()
                row = dict(size=size, dtype=str(loaded.dtype).removeprefix("torch."), n_tokens=n, key_store=key_store,
                           num_beams=num_beams, new_tokens=len(ids) - 1,
                           generate_seconds=run.seconds, plain_generate_seconds=plain.seconds,
                           recorded=run.recorder is not None, evidence_seconds=read - started,
                           support_seconds=finished - read, sentences=len(sentences))
                row["evidence_share"] = row["evidence_seconds"] / row["generate_seconds"]
                row["with_support_share"] = (row["evidence_seconds"] + row["support_seconds"]) / row["generate_seconds"]
                print(f"  {size} {row['dtype']} N={n:,} {key_store} beams={num_beams}: generate {run.seconds:.1f}s "
                      f"(without recording {plain.seconds:.1f}s), evidence "
                      f"{row['evidence_seconds']:.2f}s ({row['evidence_share']:.1%}), support "
                      f"{row['support_seconds']:.2f}s (with it {row['with_support_share']:.1%})", flush=True)
                rows.append(row)
            del store
    return rows


def support_check(model: Path, lengths: list[int], trials: int, top_k: int, seed: int = 0,
                  dtype: str = "float32", methods: tuple[str, ...] = ("hiding", "removal")) -> dict:
    """Per needle trial: the answer sentence's support, a same-size random control's, and each passage's own, by
    each method (``methods``: hiding from retrieval, removal from the input), with the weights in ``dtype``; and
    what the supports of the sentence cost against its generation."""
    from unlimisum import evidence
    from unlimisum.document import Document
    from unlimisum.unlimiformer.reread import SummaryReader, end_tokens, hidden_tokens, returned_length, support_hiding

    loaded = load_model(ModelConfig(name=str(model), device="cpu", dtype=dtype))
    window = loaded.max_source_length
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=top_k),
                            index=IndexConfig(kind="exact", device="cpu"))
    family = summarizer.family
    tokenizer = loaded.tokenizer
    special = set(tokenizer.all_special_ids)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(seed)
    cells = []
    for length in lengths:
        for trial in range(trials):
            text, content = document(window * length - 2, rng.random(), rng)
            doc = Document.from_text(text)
            encoded = family.encode(doc)
            run = family.generate([encoded.store], coverage=False, record=True)
            row = run.token_ids[0].tolist()
            ids = row[:returned_length(row, end_tokens(loaded))]
            summary = decode(ids).strip()
            with SummaryReader(loaded, family.retrieval_k()) as reader:
                reading = run.recorder.reading(0, reader, ids)
                records = evidence.build(summary, ids, decode, special, reading.token_mass, doc, encoded.token_ends,
                                         encoded.n_tokens)
                if not records or not records[0].sources:
                    continue
                _, members = evidence.sentence_rows(summary, ids, decode, special, len(ids))
                rows_ = [j for j in members[0] if j >= 1]
                sources = records[0].sources
                passages = hidden_tokens(sources, encoded.n_tokens)
                outside = (~passages).nonzero().squeeze(1).tolist()
                control = torch.zeros_like(passages)
                control[rng.sample(outside, int(passages.sum()))] = True
                part = type("Part", (), {"encoded": encoded, "start": 0})
                for method in methods:
                    removal = family._removal(part, encoded.store) if method == "removal" else None
                    drop = lambda hidden: support_hiding(reader, reading, encoded.store, rows_, hidden,  # noqa: E731
                                                         removal)
                    started = time.perf_counter()
                    support = drop(passages)
                    seconds = time.perf_counter() - started
                    alone = [drop(hidden_tokens([source], encoded.n_tokens)) for source in sources]
                    cells.append(dict(length=length, method=method, copied=summary == content, support=support,
                                      control=drop(control), alone=alone, seconds=seconds,
                                      generate_seconds=run.seconds,
                                      first_hurts_most=max(range(len(alone)), key=alone.__getitem__) == 0))
                    print(f"  {length}x trial {trial} {method}: support {support:.2f}, control "
                          f"{cells[-1]['control']:.2f} nats/token, {seconds:.2f} s", flush=True)
    return dict(cells=cells, window=window, top_k=top_k, trials=trials, dtype=dtype)


def report_support(result: dict) -> None:
    print(f"support on the needle (k={result['top_k']}): the answer sentence read again with its passages hidden, "
          "against as many random tokens hidden, nats per token")
    rows = []
    for length, method in sorted({(cell["length"], cell.get("method", "hiding")) for cell in result["cells"]}):
        cells = [cell for cell in result["cells"] if cell["length"] == length and cell.get("method", "hiding") == method]
        supports = sorted(cell["support"] for cell in cells)
        controls = sorted(cell["control"] for cell in cells)
        seconds = sum(cell.get("seconds", 0.0) for cell in cells) / len(cells)
        rows.append([f"{length}x", method, len(cells), f"{sum(c['copied'] for c in cells)}",
                     f"{supports[len(cells) // 2]:.2f}", f"{supports[0]:.2f}", f"{controls[len(cells) // 2]:.3f}",
                     f"{max(controls, key=abs):.3f}", f"{sum(c['first_hurts_most'] for c in cells)}/{len(cells)}",
                     f"{seconds:.3f}"])
    print(f"weights in {result.get('dtype', 'float32')}")
    print_table(["length", "support by", "trials", "copied", "support median", "support min", "control median",
                 "control farthest from 0", "first passage hurts most", "s per support"], rows)


def report_real(result: dict) -> None:
    print(f"the evidence pass and its support against generate() at real sizes ({result['new_tokens']} summary tokens, "
          f"exact store, {result['threads']} threads):")
    print_table(["model", "tokens", "store", "beams", "generate s", "without recording s", "evidence s",
                 "evidence / generate", "support s", "both / generate"],
                [[f"{row['size']} {row['dtype']}", f"{row['n_tokens']:,}", row.get("key_store", "shared"),
                  row["num_beams"],
                  f"{row['generate_seconds']:.1f}",
                  f"{row['plain_generate_seconds']:.1f}" if row["recorded"] else "-",
                  f"{row['evidence_seconds']:.2f}" + (" (recorded)" if row["recorded"] else ""),
                  f"{row['evidence_share']:.1%}", f"{row['support_seconds']:.2f}",
                  f"{row['with_support_share']:.1%}"] for row in result["rows"]])


def report(result: dict) -> None:
    print(f"top-1 source is the needle, by needle position (rows) x input length in windows of {result['window']} "
          f"tokens (columns); k={result['top_k']}, {result['trials']} trials per cell; in brackets: copied exactly")
    print_position_table(result, lambda cell: f"{cell['cited'] / cell['trials']:.2f} "
                                              f"({cell['copied'] / cell['trials']:.2f})")
    print("\ncost of the evidence pass against generate(), all positions:")
    cost_rows = []
    for length in sorted({cell["length"] for cell in result["cells"]}):
        cells = [c for c in result["cells"] if c["length"] == length]
        generate = sum(c["generate_seconds"] for c in cells)
        evidence = sum(c["evidence_seconds"] for c in cells)
        trials = sum(c["trials"] for c in cells)
        cost_rows.append([f"{length}x", f"{1000 * generate / trials:.1f}", f"{1000 * evidence / trials:.1f}",
                          f"{evidence / generate:.1%}"])
    print_table(["length", "generate ms", "evidence ms", "evidence / generate"], cost_rows)
    print("\ncost against generate() for summaries forced to a length:")
    print_table(["summary tokens", "length", "generate ms", "evidence ms", "evidence / generate"],
                [[row["new_tokens"], f"{row['length']}x", f"{1000 * row['generate_seconds'] / result['trials']:.1f}",
                  f"{1000 * row['evidence_seconds'] / result['trials']:.1f}",
                  f"{row['evidence_seconds'] / row['generate_seconds']:.1%}"] for row in result["forced"]])
    print(f"\n{result['seconds']:.0f}s")


def report_decoder_only(result: dict) -> None:
    print("decoder-only (Qwen2.5-0.5B's shape, random weights): generation with evidence against without it")
    print_table(["summary tokens", "prompt tokens", "layers", "without s", "recorded s", "cost", "reread s", "cost"],
                [[row["new_tokens"], f"{row['prompt_tokens']:,}", row["layers"], f"{row['plain_seconds']:.2f}",
                  f"{row['recorded_seconds']:.2f}", f"{row['recorded_cost']:+.1%}", f"{row['reread_seconds']:.2f}",
                  f"{row['reread_cost']:+.1%}"] for row in result["decoder_only"]])
    print(f"\n{result['seconds']:.0f}s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials and lengths (about a minute)")
    parser.add_argument("--trials", type=int, default=None, help="trials per cell (default 10; quick 3)")
    parser.add_argument("--lengths", default=None, help="input lengths in windows (default 1,50,100,200; quick 1,50,200)")
    parser.add_argument("--top-k", type=int, default=16, help="retrieved tokens per head (16: the needle's best)")
    parser.add_argument("--model", type=Path, default=FIXTURE)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decoder-only", action="store_true",
                        help="instead: evidence's cost for a decoder-only model (writes evidence_decoder_only.json)")
    parser.add_argument("--decoder-tokens", type=int, default=4096, help="prompt tokens of the decoder-only table")
    parser.add_argument("--decoder-layers", type=int, default=24, help="layers of the decoder-only model")
    parser.add_argument("--real", action="store_true",
                        help="instead: the pass's cost at real sizes (writes evidence_real.json)")
    parser.add_argument("--sizes", default="bart-base,bart-large", help="model shapes of --real")
    parser.add_argument("--tokens", default="4096,16384,300000", help="store sizes of --real")
    parser.add_argument("--beams", default="1,4", help="beam counts of --real")
    parser.add_argument("--new-tokens", type=int, default=64, help="summary tokens of --real")
    parser.add_argument("--key-stores", default="shared,per-layer",
                        help="stores of --real: shared (the encoded states), per-layer (keys built from them) and/or "
                             "per-layer+values (each layer's values too, summed at top-k steps)")
    parser.add_argument("--dtype", default="float32",
                        help="the weights of --real: float32, bfloat16 or auto (what --dtype auto chooses here)")
    parser.add_argument("--name", default=None, help="the result file's name (bench/results/NAME.json)")
    parser.add_argument("--support", action="store_true",
                        help="instead: support against a random control on the needle, by hiding and by removal "
                        "(writes evidence_support.json)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the needle model's weights in --support")
    args = parser.parse_args(argv)
    if args.support:
        torch.set_num_threads(args.threads)
        started = time.perf_counter()
        lengths = [int(n) for n in (args.lengths or ("50" if args.quick else "50,200")).split(",")]
        results = {}
        for dtype in args.dtypes.split(","):
            results[dtype] = support_check(args.model, lengths, args.trials or (3 if args.quick else 10), args.top_k,
                                           dtype=dtype)
            report_support(results[dtype])
        result = dict(by_dtype=results, seconds=time.perf_counter() - started)
        print(f"wrote {write_result(args.name or 'evidence_support', result)}")
        return
    if args.real:
        threads = args.threads if "--threads" in (argv or __import__("sys").argv) else torch.get_num_threads()
        torch.set_num_threads(threads)
        started = time.perf_counter()
        result = dict(rows=real_cost(args.sizes.split(","), [int(n) for n in args.tokens.split(",")], args.new_tokens,
                                     [int(b) for b in args.beams.split(",")],
                                     key_stores=tuple(args.key_stores.split(",")), dtype=args.dtype),
                      new_tokens=args.new_tokens, threads=threads)
        result["seconds"] = time.perf_counter() - started
        report_real(result)
        print(f"wrote {write_result(args.name or 'evidence_real', result)}")
        return
    torch.set_num_threads(args.threads)
    trials = args.trials or (3 if args.quick else 10)
    lengths = [int(n) for n in (args.lengths or ("1,50,200" if args.quick else "1,50,100,200")).split(",")]
    if args.decoder_only:
        started = time.perf_counter()
        result = {"decoder_only": decoder_only_cost(args.decoder_tokens, args.decoder_layers)}
        result["seconds"] = time.perf_counter() - started
        report_decoder_only(result)
        print(f"wrote {write_result('evidence_decoder_only', result)}")
        return
    result = run(args.model, lengths, trials, args.top_k)
    result["quick"] = args.quick
    report(result)
    print(f"wrote {write_result('evidence', result)}")


if __name__ == "__main__":
    main()
