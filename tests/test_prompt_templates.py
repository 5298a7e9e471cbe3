"""User templates: ``{text}`` goes in the prompt template only; a system message holding it is refused up front.

``--system "You read {text} closely."`` used to fail every document with "too many values to unpack":
it is a usage error (exit 2, one line) before any model loads, from the command line or a config file,
and a ConfigError from the library.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.tiny_decoders import build_tiny_decoder_dir
from unlimisum.cli.app import app
from unlimisum.config import ModelConfig, PromptConfig
from unlimisum.decoder_only.prompting import build_prompt
from unlimisum.errors import ConfigError
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

SYSTEM = "You read {text} closely."


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_decoder_dir(tmp_path_factory.mktemp("chat"), "qwen2")


@pytest.fixture
def book(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("The keeper counted the ships. " * 20, encoding="utf-8")
    return path


def test_a_system_message_with_text_in_it_is_a_usage_error_before_any_work(chat_dir, book, loader):
    loads = loader.calls
    result = CliRunner().invoke(app, ["summarize", str(book), "-m", str(chat_dir), "--device", "cpu",
                                      "--system", SYSTEM])
    assert result.exit_code == 2, result.output
    assert "--system must not contain {text}" in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert loader.calls == loads  # refused before any model loads


def test_the_same_from_a_config_file(chat_dir, book, loader, tmp_path):
    loads = loader.calls
    config = tmp_path / "run.toml"
    config.write_text(f'system = "{SYSTEM}"\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", str(book), "-m", str(chat_dir), "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [  # named as the file gives it, not as a flag nobody typed
        f'unlimisum: error: system = "{SYSTEM}" in {config} must not contain {{text}}: the document goes where '
        "--prompt puts it"]
    assert loader.calls == loads


def test_the_library_refuses_it_when_the_summarizer_is_made(chat_dir):
    loaded = load_model(ModelConfig(name=str(chat_dir), device="cpu"))
    with pytest.raises(ConfigError, match=r"system message must not contain \{text\}"):
        Summarizer(loaded, prompt=PromptConfig(system=SYSTEM))
    with pytest.raises(ConfigError, match=r"system message must not contain \{text\}"):
        build_prompt(loaded.tokenizer, "One line.", PromptConfig(system=SYSTEM))
    # braces of other kinds are the user's own text, kept as written
    prompt = build_prompt(loaded.tokenizer, "One line.", PromptConfig(template="Sum up {x}: {text}", system="Be {brief}."))
    assert loaded.tokenizer.decode(prompt.ids) == \
        "<|begin|><|system|>Be {brief}.<|end|><|user|>Sum up {x}: One line.<|end|><|assistant|>"
