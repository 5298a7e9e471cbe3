"""Text from a document is tokenized as text: it never becomes a special (control) token.

A book may hold ``<|im_end|>``, ``</s>``, ``<mask>`` or ``[INST]``. Tokenized with special-token
parsing on, those strings become the model's own control tokens: a document could close the user's
turn of a chat prompt and write a system message, or end an encoder's input early. Every tokenizer
call on a document's text (and on training data) goes through ``encode_text``, which passes
``split_special_tokens=True``, so such strings are tokenized as the characters they are. The special
tokens a tokenizer adds around a text itself (BOS, EOS) and those a chat template or the user's own
prompt template writes stay special. (A tokenizer whose plain vocabulary holds a special token's string,
as a word-level one may, still maps that word to it: that is its vocabulary, not special-token parsing.)
"""

from __future__ import annotations


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = False, offsets: bool = False, **options):
    """``tokenizer(text)`` with the text's special-token strings tokenized as text (a BatchEncoding);
    ``offsets``: with the offset mapping (NotImplementedError from slow tokenizers, as transformers raises)."""
    return tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True, verbose=False,
                     return_offsets_mapping=offsets, **options)


def special_ids(tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens, its unknown token aside (text may well be unknown)."""
    return set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}


def added_around(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) a text that the tokenizer adds itself: BART <s> ... </s>, T5 ... </s>."""
    probe = "a"
    content = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return full[:start], full[start + len(content) :]
    return [], []
