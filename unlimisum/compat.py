"""Differences between transformers releases, kept in one place.

Supported range: see ``transformers`` in pyproject.toml. Anything version-specific that
the rest of the package needs goes here.
"""

from __future__ import annotations


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers: the CLI draws its own on stderr."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def encoder_outputs(last_hidden_state):
    """The object generate() accepts as precomputed ``encoder_outputs``."""
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=last_hidden_state)
