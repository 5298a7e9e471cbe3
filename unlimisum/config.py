"""Frozen configuration of one summarize call. Every default says why it is what it is."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


# The Unlimiformer paper's BookSum model: BART-base fine-tuned *through* retrieval (alternating training), so it
# reads whole books the way unlimisum feeds them. Its 1,024-token window encodes ~6x faster on a CPU than LED's
# 16k (and its default k, the window, keeps decoding cheap); it ships without tokenizer files and uses
# facebook/bart-base's (checkpoint.KNOWN_BASE_TOKENIZERS). README "Choosing a model" has the comparison.
DEFAULT_MODEL = "abertsch/unlimiformer-bart-booksum-alternating"


@dataclass(frozen=True)
class EncodingConfig:
    """How the input is cut into windows and encoded."""

    # Fraction of each window shared with its neighbours; 0.5 keeps the middle half, as the paper.
    overlap: float = 0.5
    # Windows per encoder forward pass; None picks from the window length and the device.
    batch_size: int | None = None
    # The encoder's linear layers as dynamic int8 on a CPU (unlimisum/models/quantized.py): a book encoded ~1.2x
    # faster at bart-base size without 16-bit units (the linear layers 1.8x), states within ~3 % relative error.
    # Off: results then equal the float32 (or 16-bit) model's, and a quantized encoder is a choice the reader
    # makes knowingly.
    int8: bool = False
    # Window length in tokens; None reads the model's own maximum source length. For a decoder-only model it is
    # the exact local window (the end of the text, the request and everything generated): None is
    # decoder_only.plan.DEFAULT_WINDOW tokens, bounded by the model's positions.
    window: int | None = None


@dataclass(frozen=True)
class IndexConfig:
    """Which nearest-neighbour index holds the encoded input, and where it lives."""

    # "auto" | "exact" | "ivf" | "hnsw"; auto is exact up to `exact_max_tokens`, then approximate (CPU only:
    # on the GPU auto is always exact).
    kind: str = "auto"
    # "auto" | "cpu" | "gpu"; auto uses the GPU when CUDA is present and the store fits in free memory.
    device: str = "auto"
    # Above this many input tokens `auto` may switch to an approximate index on the CPU (the GPU stays exact),
    # and only when IVF would scan fewer states per step than one exact pass (see placement.plan_index).
    # An exact step streams the store once per decoder layer for all heads and beams (bench/decoding.py:
    # see BENCHMARKS.md), while IVF at the default scan factor keeps only 95-97% of the attention mass
    # at 200k-500k tokens: below a million tokens exactness is worth its cost.
    exact_max_tokens: int = 1_000_000
    # Storage of the encoded states: "auto" is bfloat16 (2 bytes per number, never overflows, read natively by
    # CPUs with AVX512-BF16/AMX and by GPUs; one copy serves search and values); "float16" has 3 more mantissa
    # bits but overflows beyond +-65504; "float32" doubles memory and exists for exactness checks.
    storage_dtype: str = "auto"
    # Fraction of free GPU memory the store may take when placement is automatic.
    gpu_memory_fraction: float = 0.5
    # The approximate index `auto` uses above exact_max_tokens: "ivf" | "hnsw". IVF, measured: at 200k tokens
    # IVF keeps 97% of the attention mass, inner-product HNSW only 62-72% (efSearch k..2k), and HNSW takes
    # 2.5-4x longer to build (58 s vs 13 s); its one advantage is memory (2.35 vs 4.04 bytes per number).
    approximate_kind: str = "ivf"
    # IVF probes enough lists to scan about this many stored states per requested neighbour
    # (nprobe ~ factor * k / list length, capped by the list count). Measured attention mass kept at
    # 100k / 200k / 500k tokens: factor 16: 0.84 / 0.85 / -, 32: 0.94 / 0.92 / 0.91, 64: 0.99 / 0.97 / 0.95.
    ivf_scan_factor: float = 64.0
    # Where an exact search finds each head's top-k: "auto" | "shared" | "per-layer". "shared" is the paper's one
    # store of states for every layer (each head's query projected to d_model dimensions: 12 multiply-adds per
    # number read, compute-bound on CPUs); "per-layer" adds keys h_e W_k per decoder layer (L x the store's
    # memory), where each head scores its own d_head-dim query: the same bytes read per layer, H times fewer
    # multiply-adds. auto: per-layer when the index is exact, the input has at least KEY_STORE_MIN_TOKENS tokens,
    # the store and the keys fit the memory budget and the keys are measured faster on this machine
    # (unlimisum/search/placement.py, plan_key_store).
    key_store: str = "auto"


@dataclass(frozen=True)
class RetrievalConfig:
    """How many input tokens each cross-attention head attends to at every step."""

    # Retrieved input tokens per head and step (not sampling's top_k); None: the model's own window (the
    # paper's default), at most DEFAULT_RETRIEVAL_K, and capped by N.
    retrieval_k: int | None = None
    # After generate(), read each returned summary once more, teacher-forced with the same retrieval, to say
    # which passages each sentence drew on (Summary.evidence) and to count coverage over the returned sequence
    # only. False (--no-evidence): no evidence, and coverage counts every generation step of every row and beam.
    evidence: bool = True
    evidence_passages: int = 3  # passages of the book kept per summary sentence (--evidence-passages)
    # Read each sentence with passages again with them hidden (SentenceEvidence.support): the one check of
    # evidence by what removing it does; off (--no-support) saves two readings of each sentence.
    support: bool = True
    # How the passages are taken away for support (--support-by): "hiding" them from retrieval (the states around
    # them, encoded beside them, stay), or "removal": out of the input, every window that held them encoded again
    # (unlimisum/unlimiformer/removal.py; an encoder pass per such window, per sentence).
    support_by: str = "hiding"


# The default k for models with long windows (LED: 16,384). bench/decode_speed.py, LED-base shape at 100k
# tokens: a step at k=16,384 costs ~2x one at k=1,024 (BENCHMARKS.md), above the 1.5x we accept for a default;
# and bench/needle_eval.py finds fewer retrieved tokens dilute the attention less (k=16: 97 %, k=64: 67 %).
# Windows up to 1,024 (BART, PEGASUS, T5) keep the paper's default, their window.
DEFAULT_RETRIEVAL_K = 1024


DEFAULT_MAX_NEW_TOKENS = 256  # a few paragraphs; books want more, headlines less


@dataclass(frozen=True)
class GenerationOptions:
    """Options forwarded to the model's own ``generate()``; None leaves the model's default."""

    # None: DEFAULT_MAX_NEW_TOKENS, at most the positions the model's decoder has (``for_decoder``); a value
    # given is used as it is, and one the decoder cannot write is an error.
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None  # None: the model's own (summarization checkpoints often set one)
    num_beams: int | None = None  # None: the model's own (often 4 for summarization checkpoints)
    no_repeat_ngram_size: int | None = None  # None: the model's own
    length_penalty: float | None = None  # None: the model's own; >1 favours longer beams
    repetition_penalty: float | None = None  # None: the model's own (1.0 = no penalty)
    do_sample: bool | None = None  # None: the model's own (greedy or beam search for every listed checkpoint)
    temperature: float | None = None  # sampling only; None: the model's own (1.0)
    top_p: float | None = None  # sampling only; None: the model's own (1.0 = the whole distribution)
    top_k: int | None = None  # sampling top-k (not the retrieval top-k); None: the model's own
    seed: int | None = None  # same seed, same output; None: torch's current random state
    # Anything else generate() accepts, passed through untouched.
    extra: dict = field(default_factory=dict)

    def for_decoder(self, positions: int | None) -> "GenerationOptions":
        """These options with the default ``max_new_tokens`` resolved for a decoder of ``positions`` (None: no
        limit): DEFAULT_MAX_NEW_TOKENS, or ``positions`` when fewer."""
        if self.max_new_tokens is not None:
            return self
        default = DEFAULT_MAX_NEW_TOKENS if positions is None else min(DEFAULT_MAX_NEW_TOKENS, positions)
        return replace(self, max_new_tokens=default)

    def to_generate_kwargs(self) -> dict:
        """The keyword arguments for ``model.generate`` (unset options omitted)."""
        names = (
            "max_new_tokens", "min_new_tokens", "num_beams", "no_repeat_ngram_size", "length_penalty",
            "repetition_penalty", "do_sample", "temperature", "top_p", "top_k",
        )
        kwargs = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        kwargs.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        kwargs.update(self.extra)
        return kwargs


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how."""

    # Hub name or local folder.
    name: str = DEFAULT_MODEL
    # Tokenizer hub name or folder; None uses the model's own.
    tokenizer: str | None = None
    # "auto" | "cpu" | "cuda" | "cuda:N" | "mps"; auto is CUDA when available.
    device: str = "auto"
    # "auto" | "float32" | "float16" | "bfloat16"; auto is bf16 (else fp16) on GPUs, and on CPUs bf16 where a
    # matmul measured at load is >= 1.5x faster than in fp32 (AVX512-BF16/AMX), else fp32 (models/precision.py).
    dtype: str = "auto"
    # Off unless the user asks: remote code runs arbitrary Python from the hub.
    trust_remote_code: bool = False


# What a decoder-only model is asked, when no --prompt is given: the instruction at the start (it is kept
# exactly, as sink tokens) and the request again at the end (in the exact local window, next to the answer).
DEFAULT_PROMPT = "Summarize the following text.\n\n{text}\n\nWrite a summary of the text above."


@dataclass(frozen=True)
class PromptConfig:
    """How a decoder-only model is asked for the summary: its chat template with this instruction."""

    # The user message, where {text} is the document; without a chat template, the whole prompt.
    template: str = DEFAULT_PROMPT
    # A system message for chat templates that take one; None: the template's own default.
    system: str | None = None


@dataclass(frozen=True)
class DecoderOnlyConfig:
    """How a decoder-only model reads a long prompt: which past tokens each query attends to exactly."""

    # Sink tokens attended exactly by every query: None is the prompt's start up to the text (the instruction),
    # at least 4 tokens (the first tokens draw attention mass whatever they say, as StreamingLLM found).
    sinks: int | None = None
    # Prefill selects far tokens by blocks of this many tokens (InfLLM's memory units, 128 there).
    block_size: int = 128
    # Keys per block that stand for it in the block search: those that drew the most attention while they were
    # in the exact window (InfLLM's representative tokens, 4 there).
    block_representatives: int = 4
    # "blocks": prefill selects whole blocks per chunk and key-value head, scoring block_representatives keys per
    # block_size far tokens (quadratic in the prompt, 32x less score work than "tokens" at the defaults);
    # "tokens": every prompt query selects its own top-k from all far tokens (exact reference, and it holds the
    # chunk's scores against every far token at once: for tests). Generation always selects tokens.
    prefill_selection: str = "blocks"
