"""Differences between transformers releases, kept in one place.

Supported range: see ``transformers`` in pyproject.toml. Anything version-specific that
the rest of the package needs goes here.
"""

from __future__ import annotations

import inspect


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers: the CLI draws its own on stderr."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def encoder_outputs(last_hidden_state):
    """The object generate() accepts as precomputed ``encoder_outputs``."""
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=last_hidden_state)


def cache_from_kwargs(kwargs: dict):
    """The Cache an attention module was called with: ``cache`` in 5.x, ``past_key_values`` before."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


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
