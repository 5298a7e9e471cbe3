"""Differences between transformers (and huggingface_hub) releases, kept in one place.

Supported range: see ``transformers`` in pyproject.toml. Anything version-specific that
the rest of the package needs goes here.
"""

from __future__ import annotations

import importlib
import inspect


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers: the CLI draws its own on stderr."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def quiet_hub(verbose: bool = False) -> None:
    """huggingface_hub's own log lines (retries, resumed downloads) only when ``verbose`` (the CLI's -vv):
    otherwise they would scroll under the live display; what went wrong is reported as one error line."""
    from huggingface_hub.utils import logging

    if verbose:
        logging.set_verbosity_warning()
    else:
        logging.set_verbosity_error()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it: no request may be made."""
    from huggingface_hub import constants

    is_offline = getattr(constants, "is_offline_mode", None)
    return bool(is_offline() if callable(is_offline) else constants.HF_HUB_OFFLINE)


def hub_connection_errors() -> tuple[type[Exception], ...]:
    """What huggingface_hub raises when the hub cannot be reached or does not answer in time: its HTTP
    client's errors (httpx2 from 2.x, httpx in 1.x, requests before) and its offline-mode error."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[Exception]] = [OfflineModeIsEnabled]
    for module, names in (("httpx2", ("ConnectError", "TimeoutException", "ProxyError")),
                          ("httpx", ("ConnectError", "TimeoutException", "ProxyError")),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            client = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(client, name) for name in names if isinstance(getattr(client, name, None), type)]
    return tuple(errors)


def encoder_outputs(last_hidden_state):
    """The object generate() accepts as precomputed ``encoder_outputs``."""
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=last_hidden_state)


def cache_from_kwargs(kwargs: dict):
    """The Cache an attention module was called with: ``cache`` in 5.x, ``past_key_values`` before."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def self_attention_prefix(cache, length: int, row: int | None = None, copies: int = 1):
    """A new EncoderDecoderCache holding the first ``length`` positions of ``cache``'s self-attention keys and
    values (an EncoderDecoderCache of DynamicCache layers, as a forward with ``use_cache=True`` or generate()
    returns it; ``row``: of that batch row only, repeated ``copies`` times) and an empty cross-attention part;
    ``cache`` is left as it is. (Not ``crop``: its argument changed meaning within 5.x, and it changes the cache
    in place.)"""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    rows = slice(None) if row is None else slice(row, row + 1)
    prefix = DynamicCache()
    for index, layer in enumerate(cache.self_attention_cache.layers):
        keys, values = layer.keys[rows, :, :length], layer.values[rows, :, :length]
        if copies > 1:
            keys, values = keys.repeat(copies, 1, 1, 1), values.repeat(copies, 1, 1, 1)
        prefix.update(keys.clone(), values.clone(), index)
    return EncoderDecoderCache(prefix, DynamicCache())


def cache_argument(model) -> str:
    """The keyword under which this release's ``forward``/``generate`` take a Cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def rope_types(config) -> list[str]:
    """The rotary types of a decoder config ('default', 'dynamic', 'longrope', ...): one, or one per layer type
    (Gemma 3). 5.x keeps them in ``rope_parameters`` (a dict, or a dict of dicts per layer type); older configs
    in ``rope_scaling``."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return []
    if "rope_type" in parameters or "type" in parameters:
        return [parameters.get("rope_type", parameters.get("type"))]
    return [value.get("rope_type", value.get("type")) for value in parameters.values() if isinstance(value, dict)]


def rotary_takes_layer_type(rotary) -> bool:
    """The rotary embedding's forward is (x, position_ids, layer_type) rather than (x, position_ids)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters
