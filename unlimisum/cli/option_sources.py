"""Where each option of a command came from, and how to name it in a message.

A check between two options (``--quiet`` and ``--verbose``, ``--skip-existing`` without
``--output-dir``) must name them as the user gave them: a flag typed on the command line, a
line of the ``--config`` file (``quiet = true in run.toml``) or an environment variable.
Options given at the same level (both typed, both in the file) that contradict each other are
an error; otherwise the higher level wins, as it does for one option: the command line over
the environment, the environment over the file, the file over the defaults.
"""

from __future__ import annotations

import json

COMMAND_LINE, ENVIRONMENT, CONFIG, DEFAULT = "commandline", "environment", "config", "default"
_RANK = {DEFAULT: 0, CONFIG: 1, ENVIRONMENT: 2, COMMAND_LINE: 3}  # which source wins over which


def option_source(ctx, name: str) -> str:
    """``commandline``, ``environment``, ``config`` (a ``--config`` file) or ``default`` for parameter ``name``."""
    source = ctx.get_parameter_source(name)
    if source is None:
        return DEFAULT
    return CONFIG if source.name == "DEFAULT_MAP" else source.name.lower()


def rank(ctx, name: str) -> int:
    """How strongly ``name`` was given: higher wins (command line > environment > config file > default)."""
    return _RANK.get(option_source(ctx, name), 0)


def describe(ctx, name: str, *, value: bool = False, in_file: bool = True, typed: bool = False) -> str:
    """Option ``name`` as the user gave it: ``--num-beams`` (with ``value``: ``--num-beams 4``; with
    ``typed``: ``... on the command line``), ``num_beams = 4 in run.toml`` (without ``in_file``: not naming
    the file) or ``UNLIMISUM_CACHE_DIR in the environment``."""
    param = _param(ctx, name)
    given = ctx.params.get(name)
    source = option_source(ctx, name)
    if source == CONFIG:
        raw = (ctx.default_map or {}).get(name, given)
        line = f"{_config_key(param)} = {_toml(raw)}"
        return f"{line} in {ctx.params.get('config')}" if in_file else line
    if source == ENVIRONMENT and isinstance(param.envvar, str):
        return f"{param.envvar} in the environment"
    flag = _flag(param, given)
    if value and not getattr(param, "is_flag", False) and not getattr(param, "count", False):
        flag = f"{flag} {given}"
    return f"{flag} on the command line" if typed and source == COMMAND_LINE else flag


def describe_all(ctx, *names: str, value: bool = False) -> list[str]:
    """``describe`` for each of ``names``, saying where each came from only where it tells something:
    ``--quiet``, ``--verbose`` (both typed); ``quiet = true``, ``verbose = 1 in run.toml`` (both from the
    file); ``quiet = true in run.toml``, ``--verbose on the command line``."""
    sources = {option_source(ctx, name) for name in names}
    mixed = len(sources) > 1
    last = len(names) - 1
    return [describe(ctx, name, value=value, in_file=mixed or index == last, typed=mixed)
            for index, name in enumerate(names)]


def from_command_line(ctx, name: str) -> bool:
    """Whether ``name`` was typed (so a message may show its value after its flag)."""
    return option_source(ctx, name) == COMMAND_LINE


def _param(ctx, name: str):
    for param in ctx.command.get_params(ctx):
        if param.name == name:
            return param
    raise KeyError(name)


def _flag(param, value) -> str:
    """The option's long name; ``--no-sample`` for the off side of an on/off flag that is off."""
    names = [*getattr(param, "secondary_opts", [])] if value is False else []
    names = names or list(param.opts)
    return max(names, key=lambda name: (name.startswith("--"), len(name)))


def _config_key(param) -> str:
    long = [name for name in param.opts if name.startswith("--")] or list(param.opts)
    return long[0].lstrip("-").replace("-", "_")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string
