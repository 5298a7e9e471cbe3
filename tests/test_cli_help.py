"""Help and usage errors as a user meets them: readable at 80 and 40 columns, one plain line per error."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from unlimisum.cli import app
from unlimisum.config import DEFAULT_MODEL

COMMANDS = [[], ["summarize"], ["ingest"], ["info"], ["tc"], ["tc", "fit"]]


def render_help(command: list[str], columns: int, flag: str = "--help"):
    return CliRunner().invoke(app, [*command, flag], env={"COLUMNS": str(columns), "UNLIMISUM_MODEL": None})


def visible_options(command: list[str]) -> list:
    """The options (and their names) each command offers, read from the command itself."""
    import typer.main

    group = typer.main.get_command(app)
    context = group.make_context("unlimisum", [], resilient_parsing=True)
    target = group
    for name in command:
        target = target.get_command(context, name)
        context = target.make_context(name, [], parent=context, resilient_parsing=True)
    return [param for param in target.get_params(context) if param.param_type_name == "option"]


@pytest.mark.parametrize("columns", [80, 40])
@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command) or "unlimisum")
def test_help_shows_every_option_name_whole(command, columns):
    result = render_help(command, columns)
    assert result.exit_code == 0, result.output
    text = result.stdout
    for param in visible_options(command):
        for name in param.opts:
            whole = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
            assert bool(whole) != param.hidden, f"{name} in the help of {command} at {columns} columns:\n{text}"
    for line in text.splitlines():  # nothing is cut; only an unbreakable word may overflow
        assert len(line) <= columns or len(line.split()) == 1 or line.strip().startswith("-"), line
    assert "<bool>" not in text and "<int>" not in text and "…" not in text


@pytest.mark.parametrize("columns", [80, 40])
def test_summarize_help_shows_the_default_model_and_a_repeatable_verbose_flag(columns):
    text = render_help(["summarize"], columns).stdout
    assert DEFAULT_MODEL in text
    verbose = text[text.index("-v, --verbose"):]
    verbose = verbose[: verbose.index("\n\n")] if "\n\n" in verbose else verbose
    assert "[repeatable]" in verbose and "default" not in verbose and "<int>" not in verbose
    assert "--top-k K" in text and "--retrieval-k K" in text and "--tc-params FILE" in text
    assert "--topk" not in text  # the old alias works but is not offered


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command) or "unlimisum")
def test_dash_h_is_help_everywhere(command):
    short, long = render_help(command, 80, "-h"), render_help(command, 80, "--help")
    assert short.exit_code == 0, short.output
    assert short.stdout == long.stdout and short.stdout.startswith("Usage: unlimisum")


@pytest.mark.parametrize("group", [[], ["tc"], ["cache"]], ids=lambda group: " ".join(group) or "unlimisum")
def test_a_group_without_a_command_prints_its_help_and_exits_0(group):
    bare = CliRunner().invoke(app, group, env={"COLUMNS": "80"})
    assert bare.exit_code == 0, bare.output
    assert bare.stderr == "" and bare.stdout == render_help(group, 80).stdout


@pytest.mark.parametrize(
    "args",
    [
        ["tc", "fit", "--gate", "foo", "--text", "x.txt", "--out", "x.safetensors"],
        ["summarize", "--no-such-option", "x.txt"],
        ["summarize", "--index", "kd-tree", "x.txt"],
        ["summarize"],
        ["summarize", "--skip-existing", "x.txt"],
        ["info", "--tokens", "0"],
        ["ingest", "--nope"],
        ["no-such-command"],
        ["tc", "fit", "--window", "0", "--text", "x.txt", "--out", "x.safetensors"],
    ],
)
def test_every_usage_error_is_one_plain_line_and_exit_2(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("unlimisum: error: ") and "╭" not in line and "Usage:" not in line


def test_a_file_named_like_an_option_gets_a_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-dash.txt").write_text("text", encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", "-dash.txt"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "unlimisum: error: no such option: -dash.txt; to summarize a file whose name starts with '-', "
        "put '--' before it"
    )
