"""Train the decoder-only needle model: a tiny Llama, from scratch, that copies one marked span out of filler text.

The task, as a prompt and its answer:

    <s> fumi zura ... <needle> 4 9 1 7 </needle> ... pogo mave <ask>    ->    <needle> 4 9 1 7 </needle> </s>

The prompt is filler words with one marked span anywhere in it, then the request ``<ask>``; the
answer is the span (the markers are special tokens, so the decoded summary is ``4 9 1 7``).
Training prompts are at most 200 tokens long, within the model's 256 positions; unlimisum then
has to find the span in prompts 50-200 times its 64-token local window (tests/test_decoder_needle.py),
where every far token is retrieved at a fixed distance of one window (README, "Positions").

Why it looks like this (see also bench/train_needle.py, the encoder-decoder needle):
- the content is 4-6 distinct random digits, the filler words share nothing with it: the model
  learns to copy by induction (the token after the one it just wrote), which distinct digits keep
  unambiguous, and the markers are part of the answer so every step is that one rule;
- a curriculum (``prompt_length``): short prompts first (the copying rule is learned there), then
  prompts of any length up to 200 tokens, so the span is seen at every distance from the request,
  the fixed distance of 64 included.

The model: Llama, hidden size 64, 2 layers, 4 query heads on 2 key-value heads (grouped-query
attention, as the checkpoints unlimisum reads), FFN 256, rotary positions (256), a word-level
vocabulary of specials + markers + digits + 512 made-up filler words. 0.2 M parameters.

Deterministic (fixed seeds, one thread): about 16 minutes (945 s) on one thread of two shared CPU cores;
the loss is below 0.01 from about step 1,300 of 3,000.

    nice -n 10 python -m bench.train_decoder_needle          # trains and writes tests/fixtures/needle_decoder/
    python -m bench.train_decoder_needle --steps 200 --out /tmp/needle   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from bench.common import save_model

from bench.train_needle import CLOSE, CONTENT_LENGTHS, DIGITS, FILLER, OPEN

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "needle_decoder"

POSITIONS = 256  # the model's max_position_embeddings
MAX_PROMPT = 200  # training prompts, <s> and <ask> included
ASK = "<ask>"
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
PROMPT_TEMPLATE = "{text} " + ASK  # unlimisum's --prompt for this model (it has no chat template)
MODEL_SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=256)


def build_tokenizer():
    """A word-level tokenizer: one token per whitespace-separated word, ``<s>`` before a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [OPEN, CLOSE, ASK] + DIGITS + FILLER
    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        extra_special_tokens=[OPEN, CLOSE, ASK], model_max_length=1_000_000,
    )


def build_model(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=POSITIONS, **MODEL_SIZE, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# -- data ------------------------------------------------------------------------------------


def example(n_words: int, rng: random.Random, vocab: dict) -> tuple[list[int], list[int]]:
    """(prompt ids: <s> filler with the span anywhere <ask>, answer ids: the span </s>) for ``n_words`` words."""
    content = rng.sample(DIGITS, rng.choice(CONTENT_LENGTHS))
    span = [vocab[w] for w in [OPEN, *content, CLOSE]]
    words = [vocab[rng.choice(FILLER)] for _ in range(n_words - len(span))]
    at = rng.randint(0, len(words))
    words[at:at] = span
    return [vocab["<s>"], *words, vocab[ASK]], span + [vocab["</s>"]]


def training_batch(batch_size: int, rng: random.Random, vocab: dict, low: int, high: int):
    """[B, L] input ids, attention mask and labels (-100 on the prompt and the padding)."""
    rows = [example(rng.randint(low, high), rng, vocab) for _ in range(batch_size)]
    length = max(len(prompt) + len(answer) for prompt, answer in rows)
    pad = vocab["<pad>"]
    ids, mask, labels = [], [], []
    for prompt, answer in rows:
        row = prompt + answer
        padding = length - len(row)
        ids.append(row + [pad] * padding)
        mask.append([1] * len(row) + [0] * padding)
        labels.append([-100] * len(prompt) + answer + [-100] * padding)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def prompt_length(step: int, steps: int) -> tuple[int, int]:
    """The curriculum: (fewest, most) words of a prompt. First 30% of the steps: 8-40 words (the copying rule);
    then any length up to the longest."""
    return (8, 40) if step < 0.3 * steps else (8, MAX_PROMPT - 2)


# -- training --------------------------------------------------------------------------------


def exact_match(model, rng: random.Random, vocab: dict, n: int = 64, n_words: int = MAX_PROMPT - 2) -> float:
    """Greedy answers to ``n`` prompts of ``n_words`` words: the fraction that is exactly the span + </s>."""
    model.eval()
    rows = [example(n_words, rng, vocab) for _ in range(n)]
    prompts = torch.tensor([prompt for prompt, _ in rows])
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max(CONTENT_LENGTHS) + 3,
                             do_sample=False, num_beams=1)
    model.train()
    return sum(out[i, prompts.shape[1]:prompts.shape[1] + len(answer)].tolist() == answer
               for i, (_, answer) in enumerate(rows)) / n


def train(steps: int, batch_size: int, lr: float, seed: int, log_every: int = 100):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    model = build_model(tokenizer, seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    started = time.perf_counter()
    for step in range(1, steps + 1):
        ids, mask, labels = training_batch(batch_size, rng, vocab, *prompt_length(step, steps))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            accuracy = exact_match(model, random.Random(seed + 1), vocab) if step % (5 * log_every) == 0 else float("nan")
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out exact {accuracy:.3f}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    model.eval()
    return model, tokenizer, exact_match(model, random.Random(seed + 1), vocab, n=256), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the result depends on it slightly)")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from unlimisum.models.compat import quiet_transformers

    quiet_transformers()
    model, tokenizer, accuracy, seconds = train(args.steps, args.batch_size, args.lr, args.seed)
    print(f"trained in {seconds:.0f}s; exact match on 256 held-out prompts of {MAX_PROMPT} tokens: {accuracy:.3f}")
    print(f"wrote {args.out} ({save_model(model, tokenizer, args.out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
