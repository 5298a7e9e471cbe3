"""Plain-text help that fits the terminal: every option name and default shown whole.

Layout (``COLUMNS`` or the terminal decides the width, at most ``MAX_WIDTH``)::

    Usage: unlimisum summarize [OPTIONS] PATH...

    Summarize books and long files whole: ...

    Model:
      -m, --model NAME_OR_DIR   Hub name or local folder ... [env var: UNLIMISUM_MODEL]
                                [default: abertsch/unlimiformer-bart-booksum-alternating]
      --dtype auto|float32|float16|bfloat16
                                Model weights dtype ...

Option names are never cut: one that does not fit the name column gets a line of its own,
and on narrow terminals every help text goes under its option. Words are never broken
(a hub name stays whole). Flags show no value; counted options (``-v``) say they repeat.
Options are grouped by their ``rich_help_panel``.
"""

from __future__ import annotations

import inspect
import shutil
import textwrap

MAX_WIDTH = 100  # wider help is harder to read
TWO_COLUMNS_MIN_WIDTH = 60  # below this, help text goes under its option
NAME_COLUMN_MAX = 28  # names longer than this get a line of their own
INDENT = 2
NARROW_HELP_INDENT = 6

_TYPE_METAVARS = {"int": "N", "int range": "N", "float": "F", "float range": "F", "str": "TEXT",
                  "list[str]": "TEXT", "path": "PATH", "file": "FILE", "dir": "DIR"}


def help_width() -> int:
    """The width to render for: the terminal's (or ``COLUMNS``), at most MAX_WIDTH."""
    return max(20, min(shutil.get_terminal_size((80, 24)).columns, MAX_WIDTH))


def render_help(command, ctx, width: int | None = None) -> str:
    """The help of a command or group as plain text, ending with a newline."""
    width = width or help_width()
    usage = f"Usage: {ctx.command_path} {' '.join(usage_pieces(command, ctx))}".rstrip()
    lines = _wrap(usage, width, "", " " * len("Usage: ")) + [""]
    description = (command.help or "").strip()
    if description:
        for paragraph in description.split("\n\n"):
            lines += _wrap(" ".join(paragraph.split()), width, "", "") + [""]
    parts = sections(command, ctx)
    fitting = [len(term) for _, rows in parts for term, _ in rows if len(term) <= NAME_COLUMN_MAX]
    column = INDENT + (max(fitting) if fitting else NAME_COLUMN_MAX) + 2  # one help column for all sections
    for title, rows in parts:
        lines.append(f"{title}:")
        lines += _definition_list(rows, width, column)
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def usage_pieces(command, ctx) -> list[str]:
    """``[OPTIONS]``, the arguments, and ``COMMAND [ARGS]...`` for groups."""
    pieces = ["[OPTIONS]"]
    for param in command.get_params(ctx):
        if param.param_type_name == "argument":
            pieces.append(_argument_name(param) if param.required else f"[{_argument_name(param)}]")
    if hasattr(command, "list_commands"):
        pieces.append("COMMAND [ARGS]...")
    return pieces


def sections(command, ctx) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(term, help)]) in order: arguments, options without a panel, each panel, commands."""
    arguments, grouped = [], {"Options": []}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            arguments.append((_argument_name(param), _help_text(param, ctx)))
            continue
        panel = getattr(param, "rich_help_panel", None) or "Options"
        grouped.setdefault(panel, []).append((option_term(param, ctx), _help_text(param, ctx)))
    result = [("Arguments", arguments)] if arguments else []
    result += [(title, rows) for title, rows in grouped.items() if rows]
    if hasattr(command, "list_commands"):
        commands = []
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                commands.append((name, " ".join((sub.short_help or sub.help or "").split("\n\n")[0].split())))
        if commands:
            result.append(("Commands", commands))
    return result


def option_term(param, ctx) -> str:
    """``-m, --model NAME_OR_DIR``; flags and counted options have no value."""
    names = sorted(param.opts, key=lambda name: (name.startswith("--"), len(name)))
    term = ", ".join(names)
    if param.secondary_opts:
        term += " / " + ", ".join(param.secondary_opts)
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return term
    return f"{term} {option_metavar(param, ctx)}"


def option_metavar(param, ctx) -> str:
    """The value's name: the option's metavar, the choices (``auto|cpu|gpu``), or one from the type."""
    if param.metavar:
        return param.metavar
    display_type = getattr(param, "display_type", None)
    if display_type is None:  # Typer on Click itself
        return param.make_metavar(ctx) if _takes_ctx(param.make_metavar) else param.make_metavar()
    name = display_type(ctx).strip("<>")
    return name if "|" in name else _TYPE_METAVARS.get(name, name.upper() or "VALUE")


def _takes_ctx(method) -> bool:
    return "ctx" in inspect.signature(method).parameters


def _argument_name(param) -> str:
    name = param.metavar or param.name.upper()
    return f"{name}..." if param.nargs == -1 and not name.endswith("...") else name


def _help_text(param, ctx) -> str:
    text = " ".join((getattr(param, "help", None) or "").split())
    extras = []
    if getattr(param, "count", False) or getattr(param, "multiple", False):
        extras.append("[repeatable]")
    envvar = getattr(param, "envvar", None)
    if envvar and getattr(param, "show_envvar", False):
        extras.append(f"[env var: {envvar if isinstance(envvar, str) else ', '.join(envvar)}]")
    default = _default_text(param)
    if default is not None:
        extras.append(f"[default: {default}]")
    if param.required and param.param_type_name == "option":
        extras.append("[required]")
    return " ".join([text, *extras]).strip()


def _default_text(param) -> str | None:
    if param.param_type_name != "option" or not getattr(param, "show_default", False):
        return None
    if getattr(param, "is_flag", False) or getattr(param, "count", False) or param.multiple:
        return None
    default = param.default
    if default is None or default == "" or callable(default):
        return None
    return str(getattr(default, "value", default))


def _definition_list(rows: list[tuple[str, str]], width: int, column: int) -> list[str]:
    lines = []
    if width < TWO_COLUMNS_MIN_WIDTH:
        for term, text in rows:
            lines.append(" " * INDENT + term)
            if text:
                lines += _wrap(text, width, " " * NARROW_HELP_INDENT, " " * NARROW_HELP_INDENT)
        return lines
    for term, text in rows:
        if INDENT + len(term) + 2 <= column:
            first = (" " * INDENT + term).ljust(column)
            lines += _wrap(text, width, first, " " * column) if text else [first.rstrip()]
        else:
            lines.append(" " * INDENT + term)
            if text:
                lines += _wrap(text, width, " " * column, " " * column)
    return lines


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    """Wrap at spaces only: hub names, paths and option names are never broken."""
    wrapped = textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest,
                            break_long_words=False, break_on_hyphens=False)
    return wrapped or [first.rstrip()]
