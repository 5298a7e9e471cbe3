"""The prompt a decoder-only model summarizes from: its chat template around the instruction and the text.

With a chat template: the user message is the template with ``{text}`` replaced by the document
(after an optional system message), rendered by ``apply_chat_template`` with the generation prompt
(the assistant's turn begins). Without one, the prompt is the template with ``{text}`` substituted,
after the special tokens the tokenizer puts before a text (a BOS, say; an EOS it appends at the end is
dropped: the model is to go on).

The template's pieces keep their added tokens, special or not (the chat template's roles, Qwen3's
``<think>``, or those the user wrote in ``--prompt``); the document never gets any: a book holding
``<|im_end|><|system|>`` must not close the user's turn. So the prompt is tokenized in three parts: the
template up to its last added token before the text; the run from there to its first added token after
the text, which holds the document and the template's plain text beside it (tokenized together, as one
pass over the prompt would, but with no added token matched: unlimisum/models/tokens.py); and the rest of
the template. The text's token range is found from the character offsets, so the sinks (the prompt up to
the text) and the chapters (their token ranges within the text) are known.

A chat template whose turns end in plain text (Mistral v0.1's ``[INST] ... [/INST]``) cannot be protected
that way: a document holding ``[/INST]`` reads to the model as the end of the user's turn, whatever the
tokenizer does. ``unprotected_turn_end`` names such a template, for a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unlimisum.config import PromptConfig
from unlimisum.errors import ConfigError
from unlimisum.models import checkpoint
from unlimisum.models.tokens import added_around, added_ids, encode_text, special_ids
from unlimisum.coverage import token_char_ends

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


class UnprotectedPromptWarning(UserWarning):
    """The model's chat template ends the user's turn in plain text: a document holding it can end the turn."""


def unprotected_turn_end(tokenizer) -> str | None:
    """The warning for a chat template that ends the user's turn in plain text, no added token between a
    user's message and the assistant's turn (Mistral v0.1's ``[/INST]``); None for other templates and
    for a tokenizer without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (a template that refuses is reported when the prompt is rendered)
        return None
    if rendered.count(_SENTINEL) != 1:
        return None
    after = rendered.split(_SENTINEL)[1]
    added = added_ids(tokenizer)
    if after and any(token in added for token in _template_part(tokenizer, after)[0]):
        return None
    marker = " ".join(after.split())
    shown = repr(marker) if marker else "nothing"
    return (f"the model's chat template ends the user's turn with plain text ({shown}), not a token of its own: "
            "a document holding that text can end the turn early, and no tokenization can keep it from doing so")


def check_template(config: PromptConfig) -> None:
    """ConfigError unless the template holds ``{text}`` exactly once and the system message not at all."""
    count = config.template.count(PLACEHOLDER)
    if count != 1:
        raise ConfigError(f"the prompt template must contain {PLACEHOLDER} exactly once (found {count})")
    if config.system is not None and PLACEHOLDER in config.system:
        raise ConfigError(f"the system message must not contain {PLACEHOLDER}: the document goes in the prompt "
                          "template (--prompt) only")


def render(tokenizer, config: PromptConfig) -> tuple[str, str, bool]:
    """(the prompt before the text, after it, whether it came from a chat template)."""
    check_template(config)
    if not getattr(tokenizer, "chat_template", None):
        if config.system is not None:
            raise ConfigError("--system needs a model with a chat template; this tokenizer has none")
        before, after = config.template.split(PLACEHOLDER)
        return before, after, False
    user = config.template.replace(PLACEHOLDER, _SENTINEL)
    messages = ([{"role": "system", "content": config.system}] if config.system is not None else [])
    messages.append({"role": "user", "content": user})
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001  (templates raise what they like, e.g. on a system message)
        raise ConfigError(f"the model's chat template refused the prompt: {checkpoint.first_line(error)}") from None
    if rendered.count(_SENTINEL) != 1:
        raise ConfigError("the model's chat template does not keep the prompt's text as given")
    before, after = rendered.split(_SENTINEL)
    return before, after, True


def build_prompt(tokenizer, text: str, config: PromptConfig, source: str | None = None) -> Prompt:
    """Tokenize the prompt around ``text``, the strings of the tokenizer's added tokens in it as text;
    TokenizerError when the tokenizer cannot encode the text."""
    before, after, chat = render(tokenizer, config)
    try:
        head, head_offsets = _template_part(tokenizer, before)
        tail, tail_offsets = _template_part(tokenizer, after)
    except NotImplementedError:  # slow tokenizers have no offsets: the three parts are tokenized apart
        return _build_without_offsets(tokenizer, before, text, after, chat, source)
    added = added_ids(tokenizer)
    # the run: from the end of the template's last added token before the text to its first one after it
    last = max((i for i, token in enumerate(head) if token in added), default=-1)
    run_start = head_offsets[last][1] if last >= 0 else 0
    first_after = next((i for i, token in enumerate(tail) if token in added), len(tail))
    run_stop = len(before) + len(text) + (tail_offsets[first_after][0] if first_after < len(tail) else len(after))
    full = before + text + after
    run, run_offsets = _run_tokens(tokenizer, full[run_start:run_stop], after_added=run_start > 0)
    leading, trailing = ([], []) if chat else added_around(tokenizer)
    trailing = [token for token in trailing if token != tokenizer.eos_token_id]  # the answer comes next
    shift = len(before) + len(text)
    ids = leading + head[: last + 1] + run + tail[first_after:] + trailing
    offsets = ([(0, 0)] * len(leading) + head_offsets[: last + 1]
               + [(a + run_start, b + run_start) for a, b in run_offsets]
               + [(a + shift, b + shift) for a, b in tail_offsets[first_after:]] + [(0, 0)] * len(trailing))
    text_begin, text_stop = len(before), len(before) + len(text)
    first = next((i for i, (a, b) in enumerate(offsets) if b > text_begin and b > a), len(ids))
    stop = next((i for i, (a, b) in enumerate(offsets) if i >= first and a >= text_stop and b > a), len(ids))
    ends = [min(max(end - text_begin, 0), len(text)) for end in token_char_ends(offsets[first:stop])]
    _check(tokenizer, ids[first:stop], text, source)
    return Prompt(torch.tensor(ids, dtype=torch.long), first, stop, ends)


def _template_part(tokenizer, part: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The template's own tokens (its added tokens parsed) and their offsets in ``part``."""
    if not part:
        return [], []
    encoding = tokenizer(part, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(encoding["input_ids"]), [tuple(pair) for pair in encoding["offset_mapping"]]


def _run_tokens(tokenizer, run: str, *, after_added: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The run's tokens, added tokens' strings as text, and their offsets in ``run``.

    Tokenized alone, a run would be a text's start, which some tokenizers mark (SentencePiece's prefix
    space) where the same run after an added token in one pass over the prompt is not: the tokenizer
    shows which by a probe, and a run after an added token is then tokenized after a newline that is
    dropped again (as transformers' own ``sanitize_control_tokens`` does).
    """
    if not run:
        return [], []
    if after_added and _marks_text_starts(tokenizer):
        newline = encode_text(tokenizer, "\n").ids
        encoding = encode_text(tokenizer, "\n" + run, offsets=True)
        ids, offsets = encoding.ids, encoding.offsets
        if newline and ids[: len(newline)] == newline and all(a >= 1 for a, _ in offsets[len(newline):]):
            return ids[len(newline):], [(a - 1, b - 1) for a, b in offsets[len(newline):]]
    encoding = encode_text(tokenizer, run, offsets=True)
    return encoding.ids, encoding.offsets


def _marks_text_starts(tokenizer) -> bool:
    """Whether a word tokenizes otherwise at a text's start than right after a special token."""
    marker = next((token for token in tokenizer.all_special_tokens if token != tokenizer.unk_token), None)
    if marker is None:
        return False
    word = "Summary"
    after = tokenizer(marker + word, add_special_tokens=False)["input_ids"]
    alone = tokenizer(word, add_special_tokens=False)["input_ids"]
    return after[1:] != alone


def _build_without_offsets(tokenizer, before: str, text: str, after: str, chat: bool, source) -> Prompt:
    head = tokenizer(before, add_special_tokens=False, verbose=False)["input_ids"] if before else []
    body = encode_text(tokenizer, text).ids if text else []
    tail = tokenizer(after, add_special_tokens=False, verbose=False)["input_ids"] if after else []
    leading = added_around(tokenizer)[0] if not chat else []  # what the tokenizer puts before a text (a BOS)
    ids = leading + head + body + tail
    start = len(leading) + len(head)
    _check(tokenizer, body, text, source)
    return Prompt(torch.tensor(ids, dtype=torch.long), start, start + len(body), None)


def _check(tokenizer, text_ids: list[int], text: str, source) -> None:
    unknown, special = tokenizer.unk_token_id, special_ids(tokenizer)
    checkpoint.check_encoding(len(text_ids), sum(i in special for i in text_ids),
                              sum(i == unknown for i in text_ids) if unknown is not None else 0, text, source=source)
