"""Text from a document is tokenized as text: it never becomes a token the tokenizer added, special or not.

A book may hold ``<|im_end|>``, ``</s>``, ``<mask>``, ``<tool_call>`` or ``<think>``. Tokenized the usual
way, those strings become the tokens the tokenizer added: its special (control) tokens, and the added
tokens it does not mark special (Qwen3's ``<think>`` and ``<tool_call>``, which its chat template writes).
A document could then close the user's turn of a chat prompt and write a system message, end an
encoder's input early, or reach an id beyond the model's embedding. transformers' ``split_special_tokens``
only keeps the special ones from matching; its own way of keeping text literal (``apply_chat_template``'s
``sanitize_control_tokens``) runs the backend's normalizer, pre-tokenizer and model without the added
vocabulary, and so does ``encode_text`` here, keeping the character offsets the evidence needs, then the
backend's post-processor for the tokens a tokenizer adds around a text itself (BOS, EOS: those stay).
Slow (Python) tokenizers skip every added token with ``split_special_tokens``. Every tokenizer call on a
document's text (and on training data) goes through ``encode_text``; the tokens a chat template or the
user's own prompt template writes stay what they are. (A tokenizer whose plain vocabulary holds an added
token's string, as a word-level one may, still maps that word to it: that is its vocabulary.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextTokens:
    """A text's tokens, those the tokenizer adds around a text included when asked for."""

    ids: list[int]
    offsets: list[tuple[int, int]] | None  # per token, its (start, end) characters in the text; None: not asked


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = False, offsets: bool = False,
                max_length: int | None = None, target: bool = False) -> TextTokens:
    """``text``'s tokens, no added token of the tokenizer (special or not) matched in it.

    ``add_special_tokens``: with those the tokenizer puts around a text (BOS, EOS); ``offsets``: with each
    token's characters (NotImplementedError from slow tokenizers, as transformers raises); ``max_length``:
    at most this many tokens, the added ones included (the text cut on the tokenizer's truncation side);
    ``target``: tokenized as a summary (a label), as ``tokenizer(text_target=...)`` does (mBART's language codes).
    """
    if not getattr(tokenizer, "is_fast", False):
        return _encode_slow(tokenizer, text, add_special_tokens, offsets, max_length, target)
    if target and hasattr(tokenizer, "_switch_to_target_mode"):  # what tokenizer(text_target=...) does
        tokenizer._switch_to_target_mode()
    elif not getattr(tokenizer, "_in_target_context_manager", False) and hasattr(tokenizer, "_switch_to_input_mode"):
        tokenizer._switch_to_input_mode()  # what tokenizer(text) does
    try:
        encoding = _encode_fast(tokenizer, text, add_special_tokens, max_length)
    finally:
        if target and hasattr(tokenizer, "_switch_to_input_mode"):
            tokenizer._switch_to_input_mode()
    return TextTokens(list(encoding.ids), [tuple(pair) for pair in encoding.offsets] if offsets else None)


def _encode_fast(tokenizer, text: str, add_special_tokens: bool, max_length: int | None):
    """The backend's pipeline without its added vocabulary: normalizer, pre-tokenizer, model, post-processor
    (as ``Tokenizer.encode`` runs them; offsets are characters of the original text)."""
    from tokenizers import PreTokenizedString

    backend = tokenizer.backend_tokenizer
    pieces = PreTokenizedString(text)
    if backend.normalizer is not None:
        pieces.normalize(backend.normalizer.normalize)
    if backend.pre_tokenizer is not None:
        backend.pre_tokenizer.pre_tokenize(pieces)
    pieces.tokenize(backend.model.tokenize)
    encoding = pieces.to_encoding()
    processor = backend.post_processor
    if max_length is not None:
        added = processor.num_special_tokens_to_add(False) if add_special_tokens and processor is not None else 0
        encoding.truncate(max(max_length - added, 0), direction=getattr(tokenizer, "truncation_side", "right"))
    if processor is not None:
        encoding = processor.process(encoding, None, add_special_tokens)
    return encoding


def _encode_slow(tokenizer, text: str, add_special_tokens: bool, offsets: bool, max_length: int | None,
                 target: bool) -> TextTokens:
    options = dict(add_special_tokens=add_special_tokens, split_special_tokens=True, verbose=False,
                   return_offsets_mapping=offsets, truncation=max_length is not None, max_length=max_length)
    encoding = tokenizer(text_target=text, **options) if target else tokenizer(text, **options)
    pairs = [tuple(pair) for pair in encoding["offset_mapping"]] if offsets else None
    return TextTokens(list(encoding["input_ids"]), pairs)


def special_ids(tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens, its unknown token aside (text may well be unknown)."""
    return set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}


def added_ids(tokenizer) -> set[int]:
    """The ids of every token the tokenizer added, special or not (``<|im_end|>``, ``<tool_call>``), and of
    its special tokens, its unknown token aside: the tokens a document's text never becomes."""
    return (set(tokenizer.added_tokens_decoder) | special_ids(tokenizer)) - {tokenizer.unk_token_id}


def added_around(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) a text that the tokenizer adds itself: BART <s> ... </s>, T5 ... </s>."""
    probe = "a"
    content = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return full[:start], full[start + len(content) :]
    return [], []
