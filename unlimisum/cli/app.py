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


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except UnlimisumError as error:  # commands should catch their own; this is the safety net
        typer.echo(f"unlimisum: error: {error}", err=True)
        sys.exit(EXIT_FAILURE)
    except KeyboardInterrupt:
        typer.echo("unlimisum: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
