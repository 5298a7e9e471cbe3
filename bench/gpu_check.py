"""A GPU check in one run, under five minutes: exactness on CUDA, speed at 16k to 1M tokens, decoder-only, faiss-gpu.

    python -m bench.gpu_check [--dry-run] [--device cuda:0] [--budget 285]

Sections, each with its own share of the time budget (a case that would not finish in what is left of
it, or whose store would not fit in the GPU's free memory, is skipped and the table says why):

- exactness: a tiny random BART (built from a config, as tests/tiny_models.py does) encodes a document
  of many windows and reads it with k >= N on the device, in float32 and in bfloat16 (weights and store);
  its decoder logits, teacher-forced, are compared with the CPU reference, the unmodified float32 model
  reading every kept state (the same weights: rounded to bfloat16 first for the bfloat16 case), with
  torch.testing.assert_close at each dtype's tolerance; the max abs difference is reported, and whether
  greedy generation gave the same tokens. A tiny Llama's chunked prefill with k >= N on the device
  against its plain forward on the CPU, likewise.
- seq2seq: random bart-base (bench/common.py) in the dtype ``--dtype auto`` gives on the device; a document
  of N random words (one token each) encoded through the Summarizer into an exact store on the device
  (encode tokens/s), then greedy decode at k=1,024 and k=N (s/token, bench/decode_speed.py), N = 16k, 300k
  and 1M; the truncated baseline (the model's own generate() over the first 1,024 states) once.
- decoder-only: a generation step after a store of N random keys and values (bench/decoder_only.py) for a
  tiny Llama and a Qwen2.5-0.5B-shaped random model at 32k, in bf16 on the device, beside the plain
  model's own KV cache of N tokens.
- faiss: where faiss-gpu is installed, its flat inner-product index against torch's exact search on the
  device over the same states, at k=1,024 and k=16,384: search time per call and the top-k ids both find
  (faiss-gpu caps k at 2,048: that case is reported as not possible).

``--dry-run`` runs the same code paths with tiny sizes in seconds, on the CPU (tests/test_gpu_check.py, so
the script cannot rot while no GPU is lent) or, with ``--device cuda``, as a smoke run on the GPU before the
real one. Prints one table and writes bench/results/gpu_check.json (a dry run: gpu_check_dry_run.json; or
--json PATH) with the machine described: GPU name and memory, torch and CUDA versions. Exits 1 when an
exactness check fails or a section errs (the other sections still run).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import machine as machine_facts
from bench.common import print_table, random_model, random_text, write_result

# Seconds of each section at most; the whole run's deadline is --budget (285 s: under 5 minutes with the
# interpreter's start and the model builds before the first section's clock).
SECTION_BUDGETS = {"exactness": 40.0, "seq2seq": 140.0, "decoder-only": 60.0, "faiss": 30.0}
# Free GPU memory a seq2seq case needs beyond its store: the model, one encoder pass of 32 windows, the
# scores of a step (fp32), with room to spare.
SEQ2SEQ_MARGIN_BYTES = 6 * 2**30
FAISS_GPU_MAX_K = 2048  # faiss-gpu's k-selection limit (GPU_MAX_SELECTION_K in faiss/gpu/utils/DeviceDefs.cuh)


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the real sizes, or tiny ones for --dry-run."""

    exact_words: int  # words of the exactness document (many windows of the tiny model)
    exact_window: int  # the tiny model's encoder window
    seq2seq_size: str  # bench.common.SIZES key
    seq2seq_tokens: tuple[int, ...]  # input lengths N of the encode and decode cases
    new_tokens: int  # greedy tokens per decode timing
    decoder_models: tuple[tuple[str, str, str, int], ...]  # (label, bench.decoder_only size, model type, N)
    decoder_window: int  # decoder-only exact local window (at most a quarter of the model's positions)
    decoder_k: int  # decoder-only far tokens per KV head and step
    faiss_tokens: int  # states in the faiss and torch indexes
    faiss_ks: tuple[int, ...]  # k of the faiss comparison (above 2,048: beyond faiss-gpu's limit)
    faiss_dim: int  # width of those states


REAL = Sizes(exact_words=600, exact_window=64, seq2seq_size="bart-base", seq2seq_tokens=(16_384, 300_000, 1_000_000),
             new_tokens=16, decoder_models=(("tiny llama", "TINY", "llama", 4_096),
                                            ("qwen2.5-0.5b shape", "QWEN_05B", "qwen2", 32_768)),
             decoder_window=1024, decoder_k=1024, faiss_tokens=300_000, faiss_ks=(1024, 16_384), faiss_dim=768)
DRY = Sizes(exact_words=300, exact_window=64, seq2seq_size="bart-tiny", seq2seq_tokens=(2_048, 3_000, 6_000),
            new_tokens=3, decoder_models=(("tiny llama", "TINY", "llama", 512), ("qwen2.5-0.5b shape (tiny)", "TINY",
                                                                                 "qwen2", 1_024)),
            decoder_window=128, decoder_k=64, faiss_tokens=4_096, faiss_ks=(64, 2_048 + 512), faiss_dim=64)

# assert_close tolerances of the logits per dtype: float32 differs from the CPU by summation order only;
# bfloat16 rounds every activation to 8 bits of mantissa (2^-8 = 0.4 %), through 2 + 2 layers (the CPU's
# bf16 run of --dry-run differs by 0.006 on logits up to 1.2).
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@dataclass
class Report:
    """The table's rows and the run's clock."""

    deadline: float
    rows: list[dict] = field(default_factory=list)
    sections: dict = field(default_factory=dict)

    def add(self, section: str, case: str, status: str, metric: str = "", value=None, unit: str = "", note: str = ""):
        row = dict(section=section, case=case, status=status, metric=metric, value=value, unit=unit, note=note)
        self.rows.append(row)
        shown = f"{value:.4g} {unit}" if isinstance(value, float) else ("" if value is None else f"{value} {unit}")
        print(f"  [{section}] {case}: {status} {metric} {shown} {note}".rstrip(), flush=True)
        return row

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    @property
    def failed(self) -> bool:
        return any(row["status"] in ("FAIL", "error") for row in self.rows)


class Section:
    """A section's clock: ``allows(seconds)`` while the estimate fits its budget and the run's deadline."""

    def __init__(self, report: Report, name: str, budget: float):
        self.report, self.name = report, name
        self.started = time.perf_counter()
        self.deadline = min(self.started + budget, report.deadline)
        report.sections[name] = dict(budget_seconds=budget)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, estimate: float) -> bool:
        return estimate <= self.left()

    def close(self) -> None:
        self.report.sections[self.name]["seconds"] = time.perf_counter() - self.started


def run_section(report: Report, name: str, body, *args) -> None:
    """Run one section; an exception becomes an error row (the other sections still run)."""
    section = Section(report, name, SECTION_BUDGETS[name])
    print(f"\n{name} (budget {SECTION_BUDGETS[name]:.0f} s, {report.left():.0f} s left in the run)", flush=True)
    try:
        body(report, section, *args)
    except Exception as error:  # noqa: BLE001: recorded and the run goes on
        traceback.print_exc()
        report.add(name, "section", "error", note=_first_line(error))
    finally:
        section.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what a section (or its out-of-memory error) left cached


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _index_config(device: torch.device, storage: str):
    from unlimisum.config import IndexConfig

    return IndexConfig(kind="exact", device="gpu" if device.type == "cuda" else "cpu", storage_dtype=storage)


def auto_dtype(device: torch.device) -> torch.dtype:
    """The weights' dtype ``--dtype auto`` gives on ``device`` (bfloat16 on a GPU that has it)."""
    from unlimisum.models.precision import choose_auto_dtype

    return choose_auto_dtype(device).dtype


# --- exactness ---------------------------------------------------------------------------------------


def exactness(report: Report, section: Section, device: torch.device, sizes: Sizes) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        if not section.allows(5.0):
            report.add("exactness", f"bart tiny {_name(dtype)}", "skipped", note="section budget spent")
            continue
        seq2seq_exactness(report, device, dtype, sizes)
    if section.allows(5.0):
        decoder_exactness(report, device, sizes)
    else:
        report.add("exactness", "llama tiny float32", "skipped", note="section budget spent")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compare(report: Report, case: str, got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
             note: str = "") -> None:
    """assert_close at ``dtype``'s tolerance: a pass or FAIL row with the max abs difference."""
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    diff = float((got - expected).abs().max())
    tolerance = TOLERANCES[dtype]
    try:
        torch.testing.assert_close(got, expected, **tolerance)
        status, why = "pass", ""
    except AssertionError as error:
        status, why = "FAIL", "; " + " ".join(str(error).split())[:160]
    scale = float(expected.abs().max())
    report.add("exactness", case, status, "max abs diff", diff, "",
               f"logits up to {scale:.3g}; rtol {tolerance['rtol']:g}, atol {tolerance['atol']:g}{note}{why}")


def seq2seq_exactness(report: Report, device: torch.device, dtype: torch.dtype, sizes: Sizes) -> None:
    """A tiny BART at k >= N on ``device`` in ``dtype`` against the float32 model on the CPU reading all states."""
    from unlimisum.config import GenerationOptions, RetrievalConfig
    from unlimisum.document import Document
    from unlimisum.models import LoadedModel, compat
    from unlimisum.summarizer import Summarizer
    from unlimisum.unlimiformer.retrieval import RetrievalSession, retrieval

    reference = random_model("bart-tiny", window=sizes.exact_window)
    if dtype != torch.float32:  # the reference reads the very weights the device runs, in float32
        reference.model.to(dtype).float()
    ours = LoadedModel(copy.deepcopy(reference.model).to(device, dtype), reference.tokenizer, reference.architecture,
                       reference.name)
    document = Document.from_text(random_text(sizes.exact_words, seed=3))
    steps, k = 12, 10**9  # k >= N: every head attends to every input token
    generation = GenerationOptions(max_new_tokens=steps, min_new_tokens=steps, num_beams=1, do_sample=False)
    cpu = Summarizer(reference, index=_index_config(torch.device("cpu"), "float32"), generation=generation)
    states = cpu.encode(document).store.states()  # [N, d] float32: every kept state, in input order
    summarizer = Summarizer(ours, index=_index_config(device, _name(dtype)), generation=generation,
                            retrieval=RetrievalConfig(retrieval_k=k))
    encoded = summarizer.encode(document)
    n = encoded.n_tokens
    config = reference.model.config
    decoder_ids = torch.randint(4, config.vocab_size, (1, steps), generator=torch.Generator().manual_seed(5))
    decoder_ids[0, 0] = config.decoder_start_token_id
    mask = torch.ones(1, n, dtype=torch.long)
    with torch.inference_mode():
        expected = reference.model(encoder_outputs=compat.encoder_outputs(states.unsqueeze(0)), attention_mask=mask,
                                   decoder_input_ids=decoder_ids).logits
        expected_ids = reference.model.generate(encoder_outputs=compat.encoder_outputs(states.unsqueeze(0)),
                                                attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                                num_beams=1, do_sample=False)
        session = RetrievalSession(stores=[encoded.store], retrieval_k=k)
        stand_in = torch.zeros(1, 1, config.d_model, dtype=dtype, device=device)
        with retrieval(ours.model, ours.architecture, session):
            got = ours.model(encoder_outputs=compat.encoder_outputs(stand_in),
                             attention_mask=torch.ones(1, 1, dtype=torch.long, device=device),
                             decoder_input_ids=decoder_ids.to(device)).logits
    got_ids = summarizer.generate([encoded.store]).token_ids.cpu()
    state_diff = float((encoded.store.states().float().cpu() - states).abs().max())
    same = "same" if torch.equal(got_ids, expected_ids) else "other"
    _compare(report, f"bart tiny {_name(dtype)}, {n:,} tokens, {len(encoded.windows)} windows, store "
             f"{encoded.store.device}", got, expected, dtype,
             f"; states max abs diff {state_diff:.3g}; greedy tokens: {same}")


def decoder_exactness(report: Report, device: torch.device, sizes: Sizes) -> None:
    """A tiny Llama's chunked prefill with k >= N on ``device`` against its plain forward on the CPU (float32)."""
    from bench.decoder_only import TINY
    from bench.decoder_only import random_model as random_decoder
    from unlimisum.config import DecoderOnlyConfig
    from unlimisum.decoder_only import reading
    from unlimisum.decoder_only.plan import plan_retrieval
    from unlimisum.models.architectures import architecture_for

    reference = random_decoder(TINY, "llama")
    with torch.no_grad():  # weights spread wider than the init's, so that attention is far from uniform
        for name, parameter in reference.named_parameters():
            if parameter.dim() == 2 and "embed" not in name:
                parameter.normal_(0.0, 0.25, generator=torch.Generator().manual_seed(len(name)))
    model = copy.deepcopy(reference).to(device)
    n = 4 * sizes.exact_window + 7  # several chunks of the window, the last one partial
    ids = torch.randint(4, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(6))
    plan = plan_retrieval(prompt_tokens=n, text_start=0, max_new_tokens=0,
                          max_positions=TINY["max_position_embeddings"], window=sizes.exact_window,
                          retrieval_k=10**9, config=DecoderOnlyConfig(), storage_dtype=torch.float32,
                          keys_device=device, values_device=device)
    with torch.inference_mode():
        expected = reference(ids.unsqueeze(0)).logits[0]
        with reading.session(model, architecture_for(model.config), plan) as cache:
            got = reading.prefill(model, cache, ids, logits=True)
    _compare(report, f"llama tiny float32, prefill of {n:,} tokens in chunks of {sizes.exact_window}, store {device}",
             got, expected, torch.float32)


# --- seq2seq speed -------------------------------------------------------------------------------------


def seq2seq(report: Report, section: Section, device: torch.device, sizes: Sizes) -> None:
    from bench.decode_speed import truncated_seconds_per_token, unlimisum_seconds_per_token
    from unlimisum.config import GenerationOptions
    from unlimisum.document import Document
    from unlimisum.summarizer import Summarizer
    from unlimisum.search import kernels

    dtype = auto_dtype(device)
    loaded = random_model(sizes.seq2seq_size)
    loaded.model.to(device, dtype)
    d = loaded.model.config.d_model
    label = f"{sizes.seq2seq_size} {_name(dtype)}"
    summarizer = Summarizer(loaded, index=_index_config(device, "bfloat16"),
                            generation=GenerationOptions(max_new_tokens=2, min_new_tokens=2))
    kernels.kernel_for(device, torch.bfloat16, d)  # calibrated once here, outside the cases' clocks
    done: list[tuple[int, float]] = []  # (N, seconds the case took without the baseline): the next case's estimate
    for n in sizes.seq2seq_tokens:
        case = f"{label}, {n:,} tokens"
        store_bytes = n * d * 2
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            if store_bytes + SEQ2SEQ_MARGIN_BYTES > free:
                report.add("seq2seq", case, "skipped", note=f"store {store_bytes / 2**30:.1f} GiB + "
                           f"{SEQ2SEQ_MARGIN_BYTES / 2**30:.0f} GiB exceed {free / 2**30:.1f} GiB free")
                continue
        estimate = _estimate(done, n)
        if not section.allows(estimate):
            report.add("seq2seq", case, "skipped",
                       note=f"estimated {estimate:.0f} s, {max(section.left(), 0):.0f} s left in the section")
            continue
        started = time.perf_counter()
        document = Document.from_text(random_text(n, seed=n))
        encoded = summarizer.encode(document)
        _sync(device)
        seconds = encoded.seconds
        report.add("seq2seq", case, "ok", "encode", n / seconds["encode"], "tokens/s",
                   f"{len(encoded.windows)} windows; tokenize {seconds['tokenize']:.1f} s, store "
                   f"{encoded.store.kind} on {encoded.store.device}, {encoded.store.nbytes / 2**20:,.0f} MiB")
        baseline_seconds = 0.0
        if not done:
            baseline_started = time.perf_counter()
            baseline = truncated_seconds_per_token(loaded, encoded.store.states(), sizes.new_tokens)
            report.add("seq2seq", f"{label}, first 1,024 states", "ok", "truncated baseline", baseline, "s/token",
                       "the model's own generate(), plain cross-attention")
            baseline_seconds = time.perf_counter() - baseline_started
        for k in sorted({1024, n}):
            per_token, share = unlimisum_seconds_per_token(loaded, encoded.store, k, sizes.new_tokens)
            report.add("seq2seq", case, "ok", f"decode k={k:,}", per_token, "s/token", f"retrieval {share:.0%}")
        del encoded, document
        if device.type == "cuda":
            torch.cuda.empty_cache()
        done.append((n, time.perf_counter() - started - baseline_seconds))


def _estimate(done: list[tuple[int, float]], n: int) -> float:
    """Seconds a case of N tokens should take: the last case's, scaled by N (encoding is linear in N, and so is
    a step's read of the store; a step's fixed cost makes this an over-estimate); 0 before any case ran."""
    if not done:
        return 0.0
    last_n, last_seconds = done[-1]
    return last_seconds * n / last_n


# --- decoder-only ----------------------------------------------------------------------------------------


def decoder_only(report: Report, section: Section, device: torch.device, sizes: Sizes) -> None:
    from bench import decoder_only as bench_decoder

    dtype = auto_dtype(device)
    for label, size_name, model_type, n in sizes.decoder_models:
        case = f"{label} {_name(dtype)}, {n:,} tokens"
        if not section.allows(10.0):
            report.add("decoder-only", case, "skipped", note=f"{max(section.left(), 0):.0f} s left in the section")
            continue
        model = bench_decoder.random_model(getattr(bench_decoder, size_name), model_type).to(device, dtype)
        window = min(sizes.decoder_window, model.config.max_position_embeddings // 4)
        bench_decoder.filled_store_seconds(model, 2 * window, 2, sizes.decoder_k, window)  # warm-up: calibration
        ours = bench_decoder.filled_store_seconds(model, n, sizes.new_tokens, sizes.decoder_k, window)
        report.add("decoder-only", case, "ok", f"step k={sizes.decoder_k:,}", ours["seconds_per_token"], "s/token",
                   f"window {window:,}, positions {ours['positions']}, search {ours['search_share']:.0%}, store "
                   f"{ours['store_bytes'] / 2**20:,.0f} MiB")
        if section.allows(10.0):
            plain = bench_decoder.plain_seconds(model, n, sizes.new_tokens)
            report.add("decoder-only", case, "ok", "plain KV cache step", plain, "s/token",
                       "the model's own generate() after a cache of N tokens")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- faiss ---------------------------------------------------------------------------------------------


def faiss_flat(report: Report, section: Section, device: torch.device, sizes: Sizes) -> None:
    import faiss

    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    on_gpu = device.type == "cuda"
    if on_gpu and (not hasattr(faiss, "StandardGpuResources") or gpus < 1):
        report.add("faiss", "flat index", "skipped", note="faiss-gpu is not installed (this faiss has no GPU)")
        return
    from bench.decode_speed import exact_store
    from bench.index_choice import synthetic_queries, synthetic_states

    states = synthetic_states(sizes.faiss_tokens, sizes.faiss_dim)
    store = exact_store(states, str(device) if on_gpu else "cpu")  # bf16, as the summarizer stores states
    vectors = store.states().float().cpu().numpy()  # the very numbers torch searches, in float32 for faiss
    index = faiss.IndexFlatIP(sizes.faiss_dim)
    if on_gpu:
        resources = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(resources, device.index or 0, index)
    index.add(vectors)
    queries = synthetic_queries(states, 12)  # one greedy step of a 12-head layer
    where = "faiss-gpu" if on_gpu else "faiss-cpu"
    for k in sizes.faiss_ks:
        case = f"{where} flat, {sizes.faiss_tokens:,} states, 12 queries, k={k:,}"
        if not section.allows(5.0):
            report.add("faiss", case, "skipped", note=f"{max(section.left(), 0):.0f} s left in the section")
            continue
        torch_seconds, (_, torch_ids) = _best(lambda: store.search(queries.to(store.states().device), k), device)
        try:
            faiss_seconds, (_, faiss_ids) = _best(lambda: index.search(queries.numpy(), k), device)
        except Exception as error:  # noqa: BLE001: faiss-gpu refuses k above its selection limit
            if on_gpu and k > FAISS_GPU_MAX_K:
                report.add("faiss", case, "not possible", note=f"faiss-gpu caps k at {FAISS_GPU_MAX_K:,} "
                           f"({_first_line(error)})")
                continue
            raise
        found = _shared_ids(torch_ids.cpu(), torch.from_numpy(faiss_ids))
        report.add("faiss", case, "ok", "faiss search", faiss_seconds * 1e3, "ms",
                   f"torch exact {torch_seconds * 1e3:.3g} ms; {found:.2%} of torch's top-k ids found by faiss")


def _best(run, device: torch.device, repeats: int = 3):
    """(best seconds of ``repeats`` runs after a warm-up, the last result)."""
    result = run()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        result = run()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best, result


def _shared_ids(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the share of ``a``'s ids [nq, k] that ``b``'s row holds too (order aside)."""
    shares = [len(set(x.tolist()) & set(y.tolist())) / a.shape[1] for x, y in zip(a, b)]
    return sum(shares) / len(shares)


# --- the run ---------------------------------------------------------------------------------------------


def describe(device: torch.device) -> dict:
    """The machine: GPU name and memory, torch and CUDA versions, faiss and its GPUs."""
    import transformers

    facts = dict(device=str(device), torch=torch.__version__, torch_cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                 transformers=transformers.__version__, python=platform.python_version(),
                 cpu=platform.processor() or platform.machine(), torch_threads=torch.get_num_threads())
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        facts.update(gpu=properties.name, gpu_memory_bytes=total, gpu_free_bytes=free,
                     gpu_capability=f"{properties.major}.{properties.minor}", gpu_count=torch.cuda.device_count(),
                     bf16_supported=torch.cuda.is_bf16_supported(),
                     tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    try:
        import faiss

        facts.update(faiss=faiss.__version__, faiss_gpus=faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0)
    except ImportError:
        facts.update(faiss=None)
    return facts


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU, tiny sizes, seconds")
    parser.add_argument("--device", default=None, help="the CUDA device (default cuda; cpu with --dry-run)")
    parser.add_argument("--budget", type=float, default=285.0, help="seconds for all sections together")
    parser.add_argument("--only", default=None, help="comma-separated sections: " + ", ".join(SECTION_BUDGETS))
    parser.add_argument("--json", default=None, type=Path,
                        help="where to write the JSON (default bench/results/gpu_check.json; "
                             "gpu_check_dry_run.json with --dry-run, so a dry run never overwrites a GPU's figures)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; --dry-run runs the check's code on the CPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = DRY if args.dry_run else REAL
    names = args.only.split(",") if args.only else list(SECTION_BUDGETS)
    unknown = set(names) - set(SECTION_BUDGETS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    machine = describe(device)
    print("machine:", ", ".join(f"{key} {value}" for key, value in machine.items()), flush=True)
    report = Report(deadline=started + args.budget)
    bodies = {"exactness": exactness, "seq2seq": seq2seq, "decoder-only": decoder_only, "faiss": faiss_flat}
    for name in names:
        run_section(report, name, bodies[name], device, sizes)
    total = time.perf_counter() - started
    print(f"\nGPU check on {machine.get('gpu', device)} ({'dry run, ' if args.dry_run else ''}{total:.0f} s):")
    print_table(["section", "case", "status", "measure", "value", "note"],
                [[r["section"], r["case"], r["status"], r["metric"], _shown(r), r["note"]] for r in report.rows])
    result = dict(dry_run=args.dry_run, device=str(device), gpu=machine, budget_seconds=args.budget,
                  seconds=total, sections=report.sections, passed=not report.failed, rows=report.rows)
    if args.json is None:
        path = write_result("gpu_check_dry_run" if args.dry_run else "gpu_check", result)
    else:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(result, machine=machine_facts()), indent=2))
        path = args.json
    print("wrote", path)
    return result


def _shown(row: dict) -> str:
    value = row["value"]
    if value is None:
        return "-"
    return f"{value:,.4g} {row['unit']}".strip() if isinstance(value, float) else f"{value} {row['unit']}".strip()


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
