"""Loading a model: every expected failure is one line that says what is wrong, found before the weights load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.models import checkpoint
from unlimisum.cli import app
from unlimisum.config import GenerationOptions, ModelConfig
from unlimisum.errors import ModelError, ModelNotFoundError, TokenizerError
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def copy_model(tiny_model_dir, tmp_path: Path, name: str = "model") -> Path:
    folder = tmp_path / name
    shutil.copytree(tiny_model_dir("bart"), folder)
    return folder


def without_tokenizer(tiny_model_dir, tmp_path: Path) -> Path:
    folder = copy_model(tiny_model_dir, tmp_path)
    for file_name in TOKENIZER_FILE_NAMES:
        (folder / file_name).unlink(missing_ok=True)
    return folder


def load(name: str, **options):
    return load_model(ModelConfig(name=name, device="cpu", **options))


def test_a_folder_without_tokenizer_files_is_refused_naming_the_folder_and_option(tiny_model_dir, tmp_path):
    folder = without_tokenizer(tiny_model_dir, tmp_path)
    with pytest.raises(TokenizerError, match="has no tokenizer files.*--tokenizer") as caught:
        load(str(folder))
    assert str(caught.value) == (f"model folder '{folder}' has no tokenizer files; pass the tokenizer it was "
                                 "trained with: --tokenizer NAME_OR_DIR (a hub name or a folder)")


def test_the_same_folder_with_tokenizer_given_summarizes(tiny_model_dir, tmp_path):
    folder = without_tokenizer(tiny_model_dir, tmp_path)
    loaded = load(str(folder), tokenizer=str(tiny_model_dir("bart")))
    assert loaded.tokenizer_name == str(tiny_model_dir("bart"))
    summary = Summarizer(loaded, generation=GenerationOptions(max_new_tokens=8)).summarize(SAMPLE_TEXT * 3)
    assert summary.stats.input_tokens > 100


def test_cli_without_tokenizer_exits_1_with_one_line(tiny_model_dir, tmp_path):
    folder = without_tokenizer(tiny_model_dir, tmp_path)
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT * 10, encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", "-m", str(folder), "--device", "cpu", "--max-new-tokens", "8", str(book)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no tokenizer files" in lines[0] and "--tokenizer" in lines[0], result.stderr
    assert result.stdout == ""


def test_a_tokenizer_far_smaller_than_the_vocabulary_is_refused(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 50_000  # the tokenizer has a few hundred tokens
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError):  # the weights would not fit either; the tokenizer check comes first
        load(str(folder))
    with pytest.raises(TokenizerError, match="not the model's tokenizer"):
        load(str(folder))


def test_text_that_becomes_almost_no_tokens_or_unknown_tokens_is_refused():
    words = " ".join(["word"] * 2005)
    with pytest.raises(TokenizerError, match="2,005 words became 2 tokens"):
        checkpoint.check_encoding(4, 2, 0, words, source="book.txt")
    with pytest.raises(TokenizerError, match="unknown"):
        checkpoint.check_encoding(1000, 2, 900, words, source="book.txt")
    checkpoint.check_encoding(2600, 2, 3, words)  # an ordinary text passes
    checkpoint.check_encoding(3, 2, 1, "short")  # too short to judge


def test_known_checkpoints_without_tokenizer_name_their_base():
    location = checkpoint.Location("abertsch/unlimiformer-bart-booksum-alternating", None)
    assert checkpoint.base_tokenizer(location) == "facebook/bart-base"


def test_base_model_named_in_the_config_is_used_in_the_message(tiny_model_dir, tmp_path):
    folder = without_tokenizer(tiny_model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["_name_or_path"] = "some-org/base-model"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="base model's tokenizer 'some-org/base-model' is not available"):
        load(str(folder))


@pytest.mark.parametrize("name, message", [
    ("./no-such-folder", "model folder './no-such-folder' does not exist"),
    ("/no/such/folder", "model folder '/no/such/folder' does not exist"),
    ("models/v1/best", "model folder 'models/v1/best' does not exist"),
])
def test_missing_local_paths_are_missing_folders_not_hub_names(name, message):
    with pytest.raises(ModelNotFoundError) as caught:
        load(name)
    assert str(caught.value) == message


def test_missing_hub_name_gives_current_download_advice():
    with pytest.raises(ModelNotFoundError) as caught:
        load("no-such-org/no-such-model")
    message = str(caught.value)
    assert "`hf download no-such-org/no-such-model`" in message and "huggingface-cli" not in message
    assert "(OSError)" not in message


def test_folder_without_config_and_invalid_config(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load(str(empty))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelError, match="config.json is not valid JSON"):
        load(str(broken))


def test_missing_tokenizer_option_is_named(tiny_model_dir):
    with pytest.raises(TokenizerError, match=r"tokenizer './nope' \(--tokenizer\) does not exist"):
        load(str(tiny_model_dir("bart")), tokenizer="./nope")


def test_truncated_weights_are_one_line_without_traceback(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match="could not be loaded|cannot be read"):
        load(str(folder))
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT, encoding="utf-8")
    result = CliRunner().invoke(app, ["summarize", "-m", str(folder), "--device", "cpu", "--max-new-tokens", "8", str(book)])
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
