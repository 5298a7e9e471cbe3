"""What the same model writes without reading the whole book, for ``unlimisum evaluate`` to score beside it.

- ``truncated``: the model reading only its first window, as ``tokenizer(text, truncation=True)`` and
  ``generate()`` give it (the text tokenized as text: unlimisum/models/tokens.py);
- ``chunked``: the text cut into windows that do not overlap, each summarized alone, the summaries joined in
  order (the map step of map-reduce summarizers, textsum's way).

Both use the run's generation options (beams, lengths) and the model as it was loaded, without retrieval.
Encoder-decoder models only.
"""

from __future__ import annotations

import torch

from unlimisum.config import GenerationOptions
from unlimisum.document import Document
from unlimisum.errors import ConfigError
from unlimisum.models import LoadedModel
from unlimisum.models.tokens import encode_text

BASELINES = ("truncated", "chunked")


def check_baselines(names, loaded: LoadedModel | None = None) -> None:
    """ConfigError for a baseline unlimisum does not know, or asked of a decoder-only model (``loaded``)."""
    for name in names:
        if name not in BASELINES:
            raise ConfigError(f"unknown baseline '{name}'; use {' or '.join(BASELINES)}")
    if names and loaded is not None and loaded.is_decoder_only:
        raise ConfigError("the baselines (truncated, chunked) are for encoder-decoder models; "
                          f"'{loaded.name}' is decoder-only")


def summarize_baseline(name: str, loaded: LoadedModel, generation: GenerationOptions, document: Document) -> str:
    """The summary of ``document`` by baseline ``name`` (``BASELINES``)."""
    tokenizer, window = loaded.tokenizer, loaded.max_source_length
    if name == "truncated":
        ids = encode_text(tokenizer, document.text, add_special_tokens=True, max_length=window).ids
        return _generate(loaded, generation, [ids])[0]
    text_ids = encode_text(tokenizer, document.text).ids
    prefix, suffix = _special_tokens_around(tokenizer)
    step = max(1, window - len(prefix) - len(suffix))
    chunks = [prefix + text_ids[start:start + step] + suffix for start in range(0, max(1, len(text_ids)), step)]
    return " ".join(summary for summary in _generate(loaded, generation, chunks) if summary)


def _special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The tokens the tokenizer puts before and after a text (BART: <s> and </s>; T5: </s> after)."""
    plain = encode_text(tokenizer, "a").ids
    full = encode_text(tokenizer, "a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


def _generate(loaded: LoadedModel, generation: GenerationOptions, inputs: list[list[int]]) -> list[str]:
    """One summary per input (token ids with their special tokens), generated one input at a time."""
    summaries = []
    with torch.inference_mode():
        for ids in inputs:
            input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)
            output = loaded.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                           **generation.to_generate_kwargs())
            summaries.append(loaded.tokenizer.decode(output[0], skip_special_tokens=True).strip())
    return summaries
