"""The Typer application and the one place where errors become messages and exit codes."""

from __future__ import annotations

import sys

import typer

from unlimisum import __version__
from unlimisum.errors import UnlimisumError

app = typer.Typer(
    name="unlimisum",
    help="Summarize whole books and long files without truncating them.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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
    """Print a one-line error on stderr and return the Exit to raise."""
    typer.echo(f"unlimisum: error: {error}", err=True)
    return typer.Exit(code)


# Options whose value may be left out (`--tensor-cache` alone, or `--tensor-cache tc.safetensors`):
# Typer has no optional values, so a bare one becomes `--option=` and the next argument is its value
# only when it has the expected suffix.
OPTIONAL_VALUE_OPTIONS = {"--tensor-cache": ".safetensors"}


def expand_optional_values(args: list[str]) -> list[str]:
    """Rewrite bare optional-value options so Typer can parse them; nothing after `--` is touched."""
    expanded, index = [], 0
    while index < len(args):
        argument = args[index]
        if argument == "--":
            expanded.extend(args[index:])
            break
        suffix = OPTIONAL_VALUE_OPTIONS.get(argument)
        if suffix is None:
            expanded.append(argument)
        elif index + 1 < len(args) and args[index + 1].endswith(suffix):
            expanded.append(f"{argument}={args[index + 1]}")
            index += 1
        else:
            expanded.append(f"{argument}=")
        index += 1
    return expanded


def main(args: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        app(args=expand_optional_values(sys.argv[1:] if args is None else args))
    except UnlimisumError as error:  # commands should catch their own; this is the safety net
        typer.echo(f"unlimisum: error: {error}", err=True)
        sys.exit(EXIT_FAILURE)
    except KeyboardInterrupt:
        typer.echo("unlimisum: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
