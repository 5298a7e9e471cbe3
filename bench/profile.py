"""Where a decoding step's time goes: cProfile over generation at N input tokens.

    python -m bench.profile [--tokens 100000] [--kind exact] [--new-tokens 4] [--retrieval-k K]

Prints the functions with the most cumulative time and the shares of the exact step's parts
(the scores matmul, the top-k selection, the weighted sum of states: gathered or a dense pass; or the
one-pass dense attention at k >= N)
and everything else in generate(); writes bench/results/profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from bench.common import print_table, random_model, write_result
from bench.decoding import build_store
from bench.index_choice import synthetic_states
from unlimisum.config import GenerationOptions, RetrievalConfig
from unlimisum.summarizer import Summarizer

# (label, file fragment, function name) of the parts a step is made of
PARTS = [
    ("scores matmul", "kernels.py", "native_scores"),
    ("scores matmul", "kernels.py", "native_scores_tokens_major"),
    ("scores matmul", "kernels.py", "float32_scores"),
    ("scores matmul", "packed.py", "slice_scores"),  # the packed kernel (its ``scores`` reads these slices)
    ("top-k selection", "kernels.py", "top_k"),
    ("top-k selection", "kernels.py", "top_k_tokens_major"),
    ("weighted sum (gather)", "kernels.py", "gathered_attention"),
    ("weighted sum (dense pass)", "kernels.py", "dense_values"),
    ("weighted sum (dense pass)", "packed.py", "slice_values"),
    ("dense attention, one pass (k >= N)", "kernels.py", "dense_attention"),
    ("retrieval attention, total", "retrieval.py", "attend"),  # the wrapper: projections and the kernels
    ("generate, total", "summarizer.py", "generate"),
]  # none of the parts calls another, so their cumulative times add up


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 20k")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--kind", default="exact")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--size", default="bart-base")
    parser.add_argument("--retrieval-k", type=int, default=None, help="default: unlimisum's (the window, <= 1,024)")
    args = parser.parse_args(argv)
    n_tokens = args.tokens or (20_000 if args.quick else 100_000)
    loaded = random_model(args.size)
    store, _ = build_store(synthetic_states(n_tokens, loaded.model.config.d_model), args.kind)
    generation = GenerationOptions(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    retrieval_config = RetrievalConfig(retrieval_k=args.retrieval_k) if args.retrieval_k else RetrievalConfig()
    summarizer = Summarizer(loaded, generation=generation, retrieval=retrieval_config)
    summarizer.generate([store])  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    summarizer.generate([store])
    profiler.disable()
    stats = pstats.Stats(profiler)
    cumulative = {}
    for (filename, _, function), (_, _, _, total, _) in stats.stats.items():
        for label, fragment, name in PARTS:
            if filename.endswith(fragment) and function == name:
                cumulative[label] = cumulative.get(label, 0.0) + total
    total = cumulative.get("generate, total", 0.0)
    retrieval = cumulative.get("retrieval attention, total", 0.0)
    shares = {label: cumulative.get(label, 0.0) / total for label in dict.fromkeys(label for label, _, _ in PARTS)
              if "total" not in label}
    shares["other retrieval work (queries, masks, softmax, coverage)"] = (retrieval - sum(
        cumulative.get(label, 0.0) for label in shares)) / total
    shares["model (projections, decoder layers, logits)"] = (total - retrieval) / total
    top = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)[:15]
    print(f"profile: {args.size}, N={n_tokens:,}, {args.kind} index, {args.new_tokens} tokens, "
          f"{total / args.new_tokens:.3f} s/token")
    print_table(["part", "share of generate()"], [[label, f"{share:.0%}"] for label, share in shares.items()])
    print("\ntop functions by cumulative time:")
    print_table(["seconds", "function"],
                [[f"{item[1][3]:.3f}", f"{item[0][0].split('/')[-1]}:{item[0][2]}"] for item in top])
    result = dict(size=args.size, n_tokens=n_tokens, kind=args.kind, new_tokens=args.new_tokens,
                  retrieval_k=args.retrieval_k, seconds_per_token=total / args.new_tokens, shares=shares)
    print("wrote", write_result("profile", result))
    return result


if __name__ == "__main__":
    main()
