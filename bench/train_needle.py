"""Train the needle model: a tiny BART, from scratch, that copies one marked span out of filler text.

The task. The input is filler words with one marked span somewhere in it,

    ... fumi zura <needle> 4 9 1 7 </needle> pogo mave ...

and the target is the marked span, ``<needle> 4 9 1 7 </needle>``; the markers are special
tokens, so the decoded output (special tokens skipped) is the content, ``4 9 1 7``. The
encoder only ever sees one window of the model's own context (64 tokens), so the evidence
is always inside what the model reads at once. Unlimiformer then has to find it in inputs
50-200 windows long (bench/needle_eval.py, tests/test_needle.py).

What the training windows look like, and why:
- the needle sits anywhere in the window, edges included: at test time a needle token is
  encoded by whichever window keeps it, at any offset inside that window;
- windows are cut out of a longer document, so most have filler on both sides and no
  ``<s>`` or ``</s>``, like the middle windows Unlimiformer encodes; some are a document's
  first window (``<s>`` ...) or last one (... ``</s>``), and a few are both;
- filler words are drawn at random, each window afresh, from a vocabulary that shares no
  word with the needle content (digits), so the marker and digits are the only
  distinctive states and filler from other windows looks like the filler seen in training;
- the content is 4-6 distinct random digits (151,200 + 30,240 + 5,040 possible spans, so
  guessing is hopeless), so the model has to read where the span ends; distinct, because a
  tiny model learns to copy fast by finding "the word that follows the one I just wrote"
  (an induction head), which repeated digits would make ambiguous; the markers are part of
  the target for the same reason: every step, the first (after <needle>) and the last
  (</needle>, then </s>) included, is then that one rule. With the content alone as the
  target the model sat on a loss plateau for thousands of steps;
- a curriculum (``window_length``): 12-24 words at the window's start first (the copying
  rule is learned there, in ~900 steps), then 12-64 words anywhere in the window, then
  full windows, as at test time;
- in the full-window phase the decoder reads, besides its own window's encoder states, those
  of 7 other windows of the batch (each encoded on its own, their needles masked out):
  ``step_loss``. Trained on single windows only, the model copies perfectly within a window
  but fails at 50x with the default top-k (0/21 in a trial run): its cross-attention never
  had to ignore filler from other windows, and the top-64 of thousands of filler states
  swamp the needle. The encoder still never sees more than one window.

The model: BART, d_model 64, 2 encoder + 2 decoder layers, 4 heads, FFN 256, learned
positions (64), a word-level vocabulary of specials + markers + digits + 512 made-up
filler words (built here with ``tokenizers``). 0.28 M parameters; 1.1 MB as safetensors.

Deterministic (fixed seeds, one thread by default): about 4-8 minutes on two shared CPU cores.

    python -m bench.train_needle               # trains and writes tests/fixtures/needle/
    python -m bench.train_needle --steps 200 --out /tmp/needle   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from bench.common import save_model

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "needle"

WINDOW = 64  # the model's context: max_position_embeddings
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
OPEN, CLOSE = "<needle>", "</needle>"
DIGITS = [str(d) for d in range(10)]
CONTENT_LENGTHS = (4, 5, 6)
N_FILLER = 512
MODEL_SIZE = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256)


def filler_words(n: int = N_FILLER) -> list[str]:
    """``n`` made-up, pronounceable words (no digits): consonant-vowel syllables, 2-3 of them."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    rng = random.Random(1234)
    words: list[str] = []
    seen = set()
    while len(words) < n:
        word = "".join(rng.choice(syllables) for _ in range(rng.choice((2, 2, 3))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


FILLER = filler_words()


def build_tokenizer(max_length: int = WINDOW):
    """A word-level tokenizer: one token per whitespace-separated word, ``<s> text </s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [OPEN, CLOSE] + DIGITS + FILLER
    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        extra_special_tokens=[OPEN, CLOSE],  # decode(skip_special_tokens=True) gives the content alone
        model_max_length=max_length,
    )


def build_model(tokenizer, seed: int = 0):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(
        vocab_size=len(tokenizer), max_position_embeddings=WINDOW, **MODEL_SIZE,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id,
        forced_bos_token_id=None, forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(config)


# -- data ------------------------------------------------------------------------------------


def needle_text(rng: random.Random, lengths=CONTENT_LENGTHS) -> tuple[list[str], list[str]]:
    """(the marked span as words, its content)."""
    content = rng.sample(DIGITS, rng.choice(lengths))  # distinct digits: the span reads unambiguously
    return [OPEN, *content, CLOSE], content


def document(n_words: int, position: float, rng: random.Random) -> tuple[str, str]:
    """A text of ``n_words`` words (the tokenizer adds 2 specials) with the needle's first word at
    ``round(position * (n_words - span))``; returns (text, the content as text)."""
    span, content = needle_text(rng)
    at = round(position * (n_words - len(span)))
    words = [rng.choice(FILLER) for _ in range(n_words - len(span))]
    words[at:at] = span
    return " ".join(words), " ".join(content)


def training_batch(batch_size: int, rng: random.Random, vocab: dict, length: int = WINDOW, anywhere: bool = False,
                   label_bos: bool = False):
    """[B, WINDOW] inputs, their attention mask, and [B, 9] labels (the marked span + </s>, padded
    with -100). Each row shows ``length`` words, at the window's start or (``anywhere``) at a random
    offset, padding elsewhere (masked). ``label_bos``: the labels start with <s>, as the tokenizer
    writes targets (``unlimisum train`` and the usual BART fine-tuning); [B, 10] then."""
    filler_ids = [vocab[w] for w in FILLER]
    bos, eos, pad = vocab["<s>"], vocab["</s>"], vocab["<pad>"]
    inputs, masks, labels = [], [], []
    for _ in range(batch_size):
        span, content = needle_text(rng)
        kind = rng.random()
        starts_doc = kind < 0.25 or kind >= 0.9  # the document's first window: <s> ...
        ends_doc = 0.25 <= kind < 0.5 or kind >= 0.9  # its last window: ... </s>
        body = length - starts_doc - ends_doc
        at = rng.randint(0, body - len(span))  # anywhere, edges included
        words = [rng.choice(filler_ids) for _ in range(body - len(span))]
        words[at:at] = [vocab[w] for w in span]
        offset = rng.randint(0, WINDOW - length) if anywhere else 0
        inputs.append([pad] * offset + [bos] * starts_doc + words + [eos] * ends_doc + [pad] * (WINDOW - length - offset))
        masks.append([0] * offset + [1] * length + [0] * (WINDOW - length - offset))
        target = [bos] * label_bos + [vocab[w] for w in span] + [eos]
        labels.append(target + [-100] * (max(CONTENT_LENGTHS) + 3 + label_bos - len(target)))
    return torch.tensor(inputs), torch.tensor(masks), torch.tensor(labels)


# -- training --------------------------------------------------------------------------------


def exact_match(model, inputs: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> float:
    """Greedy decoding of whole windows; the fraction whose output is exactly the marked span + </s>."""
    model.eval()
    with torch.inference_mode():
        out = model.generate(input_ids=inputs, attention_mask=mask,
                             max_new_tokens=labels.shape[1], num_beams=1, do_sample=False)
    model.train()
    hits = 0
    for row, label in zip(out[:, 1:].tolist(), labels.tolist()):  # drop the decoder start token
        target = [t for t in label if t != -100]
        hits += row[: len(target)] == target
    return hits / len(labels)


def window_length(step: int, steps: int, rng: random.Random) -> tuple[int, bool]:
    """A curriculum: (visible words, whether they sit at a random offset of the window).

    First 30% of the steps: 12-24 words at the window's start (the copying rule is learned
    there, fast); up to 60%: 12-64 words anywhere in the window (every position embedding
    learns the rule); from there on every window is full, as at test time."""
    if step < 0.3 * steps:
        return rng.randint(12, 24), False
    if step < 0.6 * steps:
        return rng.randint(12, WINDOW), True
    return WINDOW, False


def step_loss(model, inputs, mask, labels, other_windows: int, needle_ids: torch.Tensor) -> torch.Tensor:
    """The loss of one batch. With ``other_windows`` > 0 the decoder reads, besides its own window's
    encoder states, those of ``other_windows`` other rows of the batch (each encoded on its own, its
    needle masked out): like Unlimiformer at test time, it then has to find the needle among the
    states of many windows. The encoder still never sees more than one window."""
    if other_windows == 0:
        return model(input_ids=inputs, attention_mask=mask, labels=labels).loss
    states = model.get_encoder()(input_ids=inputs, attention_mask=mask).last_hidden_state  # [B, W, d]
    filler_mask = mask * ~torch.isin(inputs, needle_ids)
    memory = torch.cat([states] + [states.roll(i, dims=0) for i in range(1, other_windows + 1)], dim=1)
    memory_mask = torch.cat([mask] + [filler_mask.roll(i, dims=0) for i in range(1, other_windows + 1)], dim=1)
    return model(encoder_outputs=(memory,), attention_mask=memory_mask, labels=labels).loss


def train(steps: int, batch_size: int, lr: float, seed: int, other_windows: int = 0, log_every: int = 100,
          label_bos: bool = False):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    model = build_model(tokenizer, seed)
    model.train()
    needle_ids = torch.tensor([vocab[w] for w in [OPEN, CLOSE, *DIGITS]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    held_out = training_batch(256, random.Random(seed + 1), vocab, label_bos=label_bos)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        inputs, mask, labels = training_batch(batch_size, rng, vocab, *window_length(step, steps, rng),
                                              label_bos=label_bos)
        loss = step_loss(model, inputs, mask, labels, other_windows if step >= 0.6 * steps else 0, needle_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            accuracy = exact_match(model, *held_out) if step % (log_every * 5) == 0 or step == steps else float("nan")
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out exact {accuracy:.3f}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    model.eval()
    return model, tokenizer, exact_match(model, *held_out), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the result depends on it slightly)")
    parser.add_argument("--other-windows", type=int, default=7,
                        help="in the full-window phase, the decoder also reads the states of this many other windows")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from unlimisum.models.compat import quiet_transformers

    quiet_transformers()
    model, tokenizer, accuracy, seconds = train(args.steps, args.batch_size, args.lr, args.seed, args.other_windows)
    print(f"trained in {seconds:.0f}s; exact match on 256 held-out windows: {accuracy:.3f}")
    print(f"wrote {args.out} ({save_model(model, tokenizer, args.out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
