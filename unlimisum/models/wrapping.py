"""Wrap, don't patch: put a wrapper module in place of every decoder attention of one kind.

A wrapper holds the original module as its child ``original``. Wrappers are installed and
removed with setattr, never stacked, and nothing else of the model is touched.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn

from unlimisum.models.architectures import Architecture, AttentionSite


class CrossAttentionWrapper(nn.Module):
    """A decoder cross-attention wrapped: the original is the child ``original`` and its projections
    are read through the architecture's row. Without a ``session`` it is the original module; with
    one, ``forward`` returns ``attend(hidden_states, session)`` in the original's return tuple."""

    def __init__(self, original: nn.Module, architecture: Architecture, layer_index: int):
        super().__init__()
        self.original = original
        self.architecture = architecture
        self.layer_index = layer_index
        self.session = None  # set by the context that installs the wrappers
        site = architecture.cross_attention
        self.num_heads = getattr(original, site.heads_attribute)
        self.head_dim = getattr(original, site.head_dim_attribute)
        self.scaling = float(getattr(original, "scaling", architecture.default_scaling(self.head_dim)))

    def _projection(self, role: str) -> nn.Linear:
        return getattr(self.original, getattr(self.architecture.cross_attention, role))

    def forward(self, hidden_states, *args, **kwargs):
        """The original module's call signature and return tuple; ``attend`` when a session is active."""
        if self.session is None:
            return self.original(hidden_states, *args, **kwargs)
        return self.architecture.pack_output(self.attend(hidden_states, self.session), kwargs)

    def attend(self, hidden_states, session):
        raise NotImplementedError


def _sites(model: nn.Module, architecture: Architecture, site: AttentionSite):
    for index, layer in enumerate(architecture.decoder_layers(model)):
        parent, attribute = site.locate(layer)
        yield index, parent, attribute


def installed(model: nn.Module, architecture: Architecture, site: AttentionSite, wrapper_type: type) -> list:
    """The ``wrapper_type`` modules now at ``site`` in every decoder layer (empty when none)."""
    modules = [getattr(parent, attribute) for _, parent, attribute in _sites(model, architecture, site)]
    return [module for module in modules if isinstance(module, wrapper_type)]


def install(model: nn.Module, architecture: Architecture, site: AttentionSite, wrapper_type: type,
            make: Callable[[nn.Module, int], nn.Module]) -> list:
    """Replace the module at ``site`` in every decoder layer by ``make(original, layer_index)``."""
    sites = list(_sites(model, architecture, site))
    if any(isinstance(getattr(parent, attribute), wrapper_type) for _, parent, attribute in sites):
        raise RuntimeError(f"{wrapper_type.__name__} is already installed on this model")
    wrappers = []
    for index, parent, attribute in sites:
        wrapper = make(getattr(parent, attribute), index)
        setattr(parent, attribute, wrapper)
        wrappers.append(wrapper)
    return wrappers


def uninstall(model: nn.Module, architecture: Architecture, site: AttentionSite, wrapper_type: type) -> None:
    """Put every original module at ``site`` back."""
    for _, parent, attribute in _sites(model, architecture, site):
        module = getattr(parent, attribute)
        if isinstance(module, wrapper_type):
            setattr(parent, attribute, module.original)


@contextmanager
def wrapped(model: nn.Module, architecture: Architecture, site: AttentionSite, wrapper_type: type,
            make: Callable[[nn.Module, int], nn.Module]) -> Iterator[list]:
    """Within the block the modules at ``site`` are wrapped; installed here (and removed after) if not yet there."""
    wrappers = installed(model, architecture, site, wrapper_type)
    installed_here = not wrappers
    if installed_here:
        wrappers = install(model, architecture, site, wrapper_type, make)
    try:
        yield wrappers
    finally:
        if installed_here:
            uninstall(model, architecture, site, wrapper_type)
