"""`summarize --config FILE`: a run's options from a TOML file, checked before anything runs.

The file holds any option of the command (not its PATH arguments) under the long option's
name without the dashes, ``-`` written ``_`` (``max_new_tokens = 300``, ``model = "..."``,
``json = true``, ``output_dir = "summaries"``)::

    model = "abertsch/unlimiformer-bart-booksum-alternating"
    max_new_tokens = 300
    num_beams = 4
    per_chapter = true

The values become Click's ``default_map`` for the command, so the usual order holds: a flag on
the command line wins, then an environment variable (``UNLIMISUM_MODEL``, ``RAY_ADDRESS``...),
then the file, then the built-in default. Relative paths in the file are relative to the
current directory, as on the command line. An unknown key, a value of the wrong TOML type or
a value the option refuses is a usage error naming the file and the key.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

from unlimisum.errors import ConfigError

CONFIG_OPTION = "config"  # the parameter that names the file: it cannot be set from the file itself


def read_config_file(path: str | Path) -> dict:
    """The TOML table of ``path``; ConfigError (naming the file) when it cannot be read or parsed."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError("no such config file", source=path) from None
    except OSError as error:
        raise ConfigError(f"cannot read the config file ({error.strerror or error})", source=path) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"not valid TOML ({error})", source=path) from None


def option_keys(command, ctx) -> dict[str, object]:
    """``{"max_new_tokens": <the Click option>, "json": ..., ...}``: every option a config file may set."""
    keys = {}
    for param in command.get_params(ctx):
        if getattr(param, "param_type_name", "") != "option" or param.name in (CONFIG_OPTION, "help"):
            continue
        for name in param.opts:
            if name.startswith("--"):
                keys[name[2:].replace("-", "_")] = param
    return keys


def config_defaults(command, ctx, path: str | Path, data: dict) -> dict[str, object]:
    """Check ``data`` (read from ``path``) against ``command``'s options and return its ``default_map``.

    Raises ConfigError, naming the file and the key, for an unknown key, a TOML type that is
    not the option's (a string for a number, a number for a flag...) or a value the option
    itself refuses (out of range, not one of the choices).
    """
    keys = option_keys(command, ctx)
    defaults: dict[str, object] = {}
    for key, value in data.items():
        normalized = key.replace("-", "_")
        param = keys.get(normalized)
        if param is None:
            raise ConfigError(f"unknown key '{key}' (keys are summarize's long options without the dashes, "
                              "e.g. max_new_tokens)", source=path)
        expected = _expected_type(param)
        if not _has_type(value, expected):
            raise ConfigError(f"'{key}' must be {expected}, not {_toml_type(value)}", source=path)
        try:
            param.process_value(ctx, value)  # the option's own checks: ranges, choices, callbacks
        except Exception as error:  # noqa: BLE001  (Click's BadParameter and the callbacks' own errors)
            message = " ".join(str(getattr(error, "message", None) or error).replace("Value error, ", "").split())
            raise ConfigError(f"'{key}': {message}", source=path) from None
        defaults[param.name] = value
    return defaults


def _expected_type(param) -> str:
    bare_type = getattr(param, "bare_type", None)  # Typer >= 0.2x: its own parameters; older: Click's types
    kind = str(bare_type()).lower() if callable(bare_type) else type(getattr(param, "type", None)).__name__.lower()
    if getattr(param, "count", False) or "int" in kind:
        return "an integer"
    if "float" in kind:
        return "a number"
    if getattr(param, "is_flag", False) or "bool" in kind:
        return "true or false"
    return "a string"


def _has_type(value: object, expected: str) -> bool:
    if expected == "an integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "a number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "true or false":
        return isinstance(value, bool)
    return isinstance(value, str)


def _toml_type(value: object) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "a table"}
    return names.get(type(value), type(value).__name__)
