"""The Typer application and the one place where errors become messages and exit codes.

Every usage error — ours (``fail(..., EXIT_USAGE)``) and Click's own (unknown option, bad
value, missing argument) — is one plain line on stderr, ``unlimisum: error: ...``, and exit
status 2. Help is plain text that fits the terminal (see ``unlimisum.cli.help``); ``-h`` and
``--help`` work everywhere, and a group given no command (``unlimisum``, ``unlimisum tc``) prints
the same help on stdout and exits 0, whichever Click release is installed.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any, Sequence

import typer
from typer.core import TyperCommand, TyperGroup

from unlimisum.version import __version__
from unlimisum.errors import UnlimisumError, UnlimisumWarning
from unlimisum.visible import visible

# Typer 0.2x parses with its own copy of Click (typer._click); older releases use Click itself.
_click = getattr(typer, "_click", None) or importlib.import_module("click")
_exceptions = _click.exceptions
_NO_ARGS_IS_HELP = getattr(_exceptions, "NoArgsIsHelpError", ())  # Click >= 8.2

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

HELP_OPTION_NAMES = ["-h", "--help"]


class UnlimisumCommand(TyperCommand):
    """A command whose help is unlimisum's plain, terminal-width help."""

    def format_help(self, ctx, formatter) -> None:
        from unlimisum.cli.help import render_help

        formatter.write(render_help(self, ctx))


class UnlimisumGroup(TyperGroup):
    """A group with unlimisum's help and, at the top, unlimisum's handling of errors and exit codes."""

    def format_help(self, ctx, formatter) -> None:
        from unlimisum.cli.help import render_help

        formatter.write(render_help(self, ctx))

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """Run the command line; with ``standalone_mode`` (the default) every outcome ends in ``sys.exit``."""
        arguments = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(arguments, prog_name, complete_var, standalone_mode=False, **extra)
        sys.exit(run_command_line(self, arguments, prog_name, complete_var, extra))


class UnlimisumTyper(typer.Typer):
    """A Typer whose commands use ``UnlimisumCommand`` unless told otherwise."""

    def command(self, name: str | None = None, *, cls: type | None = None, **options: Any):
        return super().command(name, cls=cls or UnlimisumCommand, **options)


app = UnlimisumTyper(
    name="unlimisum",
    cls=UnlimisumGroup,
    help="Summarize whole books and long files without truncating them.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": HELP_OPTION_NAMES},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"unlimisum {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Summarize whole books and long files without truncating them."""


def fail(error: UnlimisumError | str, code: int = EXIT_FAILURE) -> "typer.Exit":
    """Print a one-line error on stderr and return the Exit to raise (a file's name or a book's text in it shown
    with its control characters as symbols: unlimisum/visible.py)."""
    typer.echo(visible(f"unlimisum: error: {error}"), err=True)
    return typer.Exit(code)


def run_command_line(group, arguments: list[str], prog_name, complete_var, extra: dict) -> int:
    """Run ``group`` on ``arguments`` and return the exit status, turning every error into one line (and each of
    unlimisum's warnings into its own line, without the file and line Python adds)."""
    warnings.formatwarning = _warning_line
    try:
        result = TyperGroup.main(group, arguments, prog_name, complete_var, standalone_mode=False, **extra)
    except _NO_ARGS_IS_HELP as error:  # `unlimisum` or `unlimisum tc` alone: its help, as with --help
        typer.echo(error.ctx.get_help() if error.ctx is not None else error.format_message())
        return EXIT_OK
    except _exceptions.ClickException as error:
        typer.echo(visible(f"unlimisum: error: {usage_message(error, arguments)}"), err=True)
        return error.exit_code
    except typer.Abort:
        typer.echo("unlimisum: aborted", err=True)
        return EXIT_FAILURE
    except UnlimisumError as error:  # commands catch their own; this is the safety net
        typer.echo(visible(f"unlimisum: error: {error}"), err=True)
        return EXIT_FAILURE
    return result if isinstance(result, int) else EXIT_OK


_python_warning_format = warnings.formatwarning


def _warning_line(message, category, filename, lineno, line=None) -> str:
    if issubclass(category, UnlimisumWarning):
        return visible(f"{message}") + "\n"
    return visible(_python_warning_format(message, category, filename, lineno, line))


def usage_message(error, arguments: Sequence[str]) -> str:
    """One line for a Click error: its message, lower-cased like ours, with a hint for file names like options."""
    if isinstance(error, _exceptions.NoSuchOption):
        name = option_like_file(error.option_name, arguments)
        if name is not None:
            return (f"no such option: {name}; to summarize a file whose name starts with '-', "
                    "put '--' before it")
        message = _no_such_option(error)
    else:
        message = error.format_message()
    message = " ".join(message.replace("Value error, ", "").split()).removesuffix(".")
    if len(message) > 1 and message[0].isupper() and not message[1].isupper():
        message = message[0].lower() + message[1:]
    return message


def _no_such_option(error) -> str:
    """Click's message without the hidden options (old aliases) among its suggestions."""
    hidden = set()
    if error.ctx is not None:
        for param in error.ctx.command.get_params(error.ctx):
            if getattr(param, "hidden", False):
                hidden.update(param.opts)
    possibilities = [name for name in (error.possibilities or []) if name not in hidden]
    message = f"no such option: {error.option_name}"
    if len(possibilities) == 1:
        return f"{message}; did you mean {possibilities[0]}?"
    if possibilities:
        return f"{message} (possible options: {', '.join(possibilities)})"
    return message


def option_like_file(option_name: str, arguments: Sequence[str]) -> str | None:
    """The argument (before ``--``) that Click read as the unknown option ``option_name`` but names an existing file."""
    for argument in arguments:
        if argument == "--":
            break
        if len(argument) < 2 or not argument.startswith("-") or not os.path.exists(argument):
            continue
        short_cluster = not option_name.startswith("--") and option_name[1:] in argument[1:]
        if argument.split("=", 1)[0] == option_name or short_cluster:
            return argument
    return None


def silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(args: list[str] | None = None) -> None:
    """Console-script entry point."""
    app(args=args)
