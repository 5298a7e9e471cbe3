"""The prompt a decoder-only model summarizes from: its chat template around the instruction and the text.

With a chat template: the user message is the template with ``{text}`` replaced by the document
(after an optional system message), rendered by ``apply_chat_template`` with the generation prompt
(the assistant's turn begins), and tokenized as rendered (the template writes the special tokens).
Without one, the prompt is the template with ``{text}`` substituted, tokenized with the tokenizer's
special tokens (a BOS, say; an EOS it appends at the end is dropped: the model is to go on).

The text's token range is found from the tokenizer's character offsets, so the sinks (the prompt
up to the text) and the chapters (their token ranges within the text) are known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unlimisum.config import PromptConfig
from unlimisum.errors import ConfigError
from unlimisum.models import checkpoint
from unlimisum.unlimiformer.encoded import token_char_ends

PLACEHOLDER = "{text}"
_SENTINEL = "\u2063unlimisum-text\u2063"  # stands for the text while the chat template renders


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt and where the text lies in it."""

    ids: torch.Tensor  # [N] int64, special tokens included
    text_start: int  # the text's first token
    text_end: int  # one past its last token
    text_token_ends: list[int] | None  # per text token, its end character in the text (None: no offsets)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])


def check_template(config: PromptConfig) -> None:
    """ConfigError unless the template holds ``{text}`` exactly once."""
    count = config.template.count(PLACEHOLDER)
    if count != 1:
        raise ConfigError(f"the prompt template must contain {PLACEHOLDER} exactly once (found {count})")


def render(tokenizer, config: PromptConfig) -> tuple[str, bool]:
    """(the prompt with ``{text}`` still in it, whether it came from a chat template)."""
    check_template(config)
    user = config.template.replace(PLACEHOLDER, _SENTINEL)
    if not getattr(tokenizer, "chat_template", None):
        if config.system is not None:
            raise ConfigError("--system needs a model with a chat template; this tokenizer has none")
        return config.template, False
    messages = ([{"role": "system", "content": config.system}] if config.system is not None else [])
    messages.append({"role": "user", "content": user})
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001  (templates raise what they like, e.g. on a system message)
        raise ConfigError(f"the model's chat template refused the prompt: {checkpoint.first_line(error)}") from None
    if rendered.count(_SENTINEL) != 1:
        raise ConfigError("the model's chat template does not keep the prompt's text as given")
    return rendered.replace(_SENTINEL, PLACEHOLDER), True


def build_prompt(tokenizer, text: str, config: PromptConfig, source: str | None = None) -> Prompt:
    """Tokenize the prompt around ``text``; TokenizerError when the tokenizer cannot encode the text."""
    template, chat = render(tokenizer, config)
    before, after = template.split(PLACEHOLDER)
    full = before + text + after
    text_begin, text_stop = len(before), len(before) + len(text)
    try:
        encoding = tokenizer(full, add_special_tokens=not chat, return_offsets_mapping=True, verbose=False)
        ids, offsets = list(encoding["input_ids"]), list(encoding["offset_mapping"])
    except NotImplementedError:  # slow tokenizers have no offsets: the three parts are tokenized apart
        return _build_without_offsets(tokenizer, before, text, after, chat, source)
    eos = tokenizer.eos_token_id
    if not chat and len(ids) > 1 and eos is not None and ids[-1] == eos and offsets[-1] == (0, 0):
        ids, offsets = ids[:-1], offsets[:-1]  # appended by the post-processor: the answer comes next
    first = next((i for i, (a, b) in enumerate(offsets) if b > text_begin and b > a), len(ids))
    stop = next((i for i, (a, b) in enumerate(offsets) if i >= first and a >= text_stop and b > a), len(ids))
    ends = [min(max(end - text_begin, 0), len(text)) for end in token_char_ends(offsets[first:stop])]
    _check(tokenizer, ids[first:stop], text, source)
    return Prompt(torch.tensor(ids, dtype=torch.long), first, stop, ends)


def _build_without_offsets(tokenizer, before: str, text: str, after: str, chat: bool, source) -> Prompt:
    parts = [tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"] if part else []
             for part in (before, text, after)]
    specials = tokenizer.build_inputs_with_special_tokens([]) if not chat else []
    eos = tokenizer.eos_token_id
    leading = [t for t in specials if t != eos]  # what the tokenizer puts before a text (a BOS), not after
    ids = leading + parts[0] + parts[1] + parts[2]
    start = len(leading) + len(parts[0])
    _check(tokenizer, parts[1], text, source)
    return Prompt(torch.tensor(ids, dtype=torch.long), start, start + len(parts[1]), None)


def _check(tokenizer, text_ids: list[int], text: str, source) -> None:
    unknown = tokenizer.unk_token_id
    special = set(tokenizer.all_special_ids) - {unknown}
    checkpoint.check_encoding(len(text_ids), sum(i in special for i in text_ids),
                              sum(i == unknown for i in text_ids) if unknown is not None else 0, text, source=source)
