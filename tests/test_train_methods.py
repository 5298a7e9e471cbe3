"""`unlimisum.train`: every method learns a memorisable batch, alternation, resume, the output folder."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

import unlimisum
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.config import ModelConfig
from unlimisum.errors import ConfigError
from unlimisum.models import load_model
from unlimisum.training import METHODS, TrainConfig
from unlimisum.training.data import read_data, tokenize_rows
from unlimisum.training.run import REPORT_NAME, work_folder

SUMMARY = "the keeper counted ships"
FAST = dict(learning_rate=1e-2, logging_steps=1, save_steps=1000, batch_size=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two rows of about 150 tokens each (over two 64-token windows), the same short summary."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"text": (SAMPLE_TEXT * 3)[start:], "summary": SUMMARY} for start in (0, 40)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _losses(reports):
    return [report.loss for report in reports if report.loss is not None]


@pytest.mark.parametrize("method", METHODS)
def test_each_method_learns_a_memorisable_batch(tiny_model_dir, data, tmp_path, method):
    reports = []
    result = unlimisum.train(data, model=str(tiny_model_dir("bart")), output_dir=tmp_path / "out", method=method,
                             max_steps=8, progress=reports.append, **FAST)
    losses = _losses(reports)
    assert len(losses) == 8
    assert losses[-1] < 0.75 * losses[0], losses
    assert result.steps == 8 and result.report["method"] == method
    expected = {"random-encoded": {"random"}, "retrieval": {"retrieval"}, "alternating": {"random", "retrieval"}}
    assert set(result.modes) == expected.get(method, set())  # truncated and chunked train the model's own attention


def test_alternating_alternates_batches(tiny_model_dir, data, tmp_path):
    result = unlimisum.train(data, model=str(tiny_model_dir("bart")), output_dir=tmp_path / "out",
                             method="alternating", max_steps=3, gradient_accumulation_steps=2,
                             **{**FAST, "batch_size": 1})
    assert result.modes == ("random", "retrieval") * 3  # per batch, not per optimizer step


def test_truncated_and_chunked_shape_the_inputs(tiny_model_dir, data, tmp_path):
    loaded = load_model(ModelConfig(name=str(tiny_model_dir("bart")), device="cpu"))
    window = loaded.max_source_length
    for method in ("truncated", "chunked", "retrieval"):
        config = TrainConfig(method=method)
        rows, _ = read_data([data], config, tmp_path / "cache")
        features = tokenize_rows(rows, loaded.tokenizer, config, window, loaded.max_target_length)
        lengths = [len(ids) for ids in features["input_ids"]]
        full = [len(loaded.tokenizer(text)["input_ids"]) for text in rows["text"]]
        if method == "truncated":
            assert lengths == [window, window]
        elif method == "chunked":  # non-overlapping window-sized chunks covering every token, specials per chunk
            assert len(lengths) > 2 * 2 and max(lengths) == window
            assert sum(lengths) - 2 * len(lengths) == sum(full) - 2 * len(full)
        else:
            assert lengths == full and max(full) > 2 * window
        target = loaded.tokenizer(text_target=SUMMARY)["input_ids"]
        assert all(labels == target for labels in features["labels"])


class Crash(TrainerCallback):
    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise RuntimeError("simulated crash")


def test_resume_continues_from_the_saved_step(tiny_model_dir, data, tmp_path):
    out = tmp_path / "out"
    settings = dict(model=str(tiny_model_dir("bart")), output_dir=out, method="alternating", max_steps=5,
                    **{**FAST, "save_steps": 3})
    with pytest.raises(RuntimeError, match="simulated crash"):
        unlimisum.train(data, callbacks=[Crash(at=4)], **settings)
    assert not out.exists()  # nothing half-written where the model goes
    assert (work_folder(out) / "checkpoints" / "checkpoint-3").is_dir()
    with pytest.raises(ConfigError, match="--resume"):
        unlimisum.train(data, **settings)  # a fresh run does not silently discard the checkpoints
    result = unlimisum.train(data, resume=True, **settings)
    assert result.report["resumed_from_step"] == 3 and result.steps == 5
    assert result.modes == ("retrieval", "random")  # batches 3 and 4 of the alternation: it goes on where it was
    assert not work_folder(out).exists()
    with pytest.raises(ConfigError, match="nothing to resume"):
        unlimisum.train(data, resume=True, **{**settings, "output_dir": tmp_path / "other"})


def test_output_folder_loads_for_summarize_and_reports_validation(tiny_model_dir, data, tmp_path):
    out = tmp_path / "out"
    result = unlimisum.train(data, model=str(tiny_model_dir("bart")), output_dir=out, method="retrieval",
                             max_steps=4, validation=(str(data),), eval_max_new_tokens=6,
                             **{**FAST, "save_steps": 2})
    names = {path.name for path in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", REPORT_NAME} <= names
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in names)
    report = json.loads((out / REPORT_NAME).read_text())
    assert report == json.loads(json.dumps(result.report))
    assert report["settings"]["method"] == "retrieval" and report["steps"] == 4
    assert [entry["step"] for entry in report["validation"]] == [2, 4]
    assert {"rouge1", "rouge2", "rougeL", "loss"} <= set(report["final_validation"])
    assert report["best"]["metric"] == "rougeL" and report["best"]["step"] in (2, 4)
    loaded = load_model(ModelConfig(name=str(out), device="cpu"))  # what `unlimisum summarize -m out` does
    trained = dict(loaded.model.named_parameters())
    base = load_model(ModelConfig(name=str(tiny_model_dir("bart")), device="cpu")).model
    assert trained.keys() == dict(base.named_parameters()).keys()  # no wrapper left in the checkpoint
    assert not torch.equal(trained["model.encoder.layers.0.fc1.weight"], base.model.encoder.layers[0].fc1.weight)
    summary = unlimisum.summarize(SAMPLE_TEXT * 4, model=loaded, max_new_tokens=5, index="exact")
    assert summary.stats.windows > 1


def test_existing_output_is_refused_then_replaced_with_overwrite(tiny_model_dir, data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    settings = dict(model=str(tiny_model_dir("bart")), output_dir=out, method="truncated", max_steps=1, **FAST)
    with pytest.raises(ConfigError, match="exists"):
        unlimisum.train(data, **settings)
    assert (out / "keep.txt").exists()
    unlimisum.train(data, overwrite=True, **settings)
    assert (out / REPORT_NAME).exists() and not (out / "keep.txt").exists()


def test_unlimisum_train_is_the_training_function_even_after_the_package_is_imported():
    import unlimisum.training  # noqa: F401  (binds unlimisum.training, never unlimisum.train)
    from unlimisum import train as attribute

    assert unlimisum.train is attribute is unlimisum.training.train
    with pytest.raises(ConfigError, match="unknown training method 'nope'"):
        unlimisum.train("x.jsonl", model="m", output_dir="o", method="nope")


def test_gradient_checkpointing_recomputes_the_same_attention(tiny_model_dir, data, tmp_path):
    """The random picks are drawn once per batch and layer, so recomputing in the backward pass changes nothing."""
    runs = []
    for checkpointing in (False, True):
        reports = []
        unlimisum.train(data, model=str(tiny_model_dir("bart")), output_dir=tmp_path / f"out-{checkpointing}",
                        method="alternating", max_steps=3, gradient_checkpointing=checkpointing,
                        progress=reports.append, **FAST)
        runs.append(torch.tensor(_losses(reports)))
    torch.testing.assert_close(runs[1], runs[0])


@pytest.mark.parametrize("method", ["truncated", "retrieval"])
def test_gradient_accumulation_averages_the_loss_instead_of_summing_it(tiny_model_dir, tmp_path, method):
    """Two identical rows: one batch of 2 and two accumulated batches of 1 see the same examples, so the
    first step's loss is the same. (BART's loss ignores num_items_in_batch, and transformers' Trainer would
    then sum the accumulated batches' mean losses: a loss, and gradients, twice as large.)"""
    path = tmp_path / "same.jsonl"
    path.write_text(json.dumps({"text": SAMPLE_TEXT * 2, "summary": SUMMARY}) + "\n" +
                    json.dumps({"text": SAMPLE_TEXT * 2, "summary": SUMMARY}) + "\n")
    first = {}
    for accumulation, batch in ((1, 2), (2, 1)):
        reports = []
        unlimisum.train(path, model=str(tiny_model_dir("bart")), output_dir=tmp_path / f"out{accumulation}",
                        method=method, max_steps=1, gradient_accumulation_steps=accumulation,
                        **{**FAST, "batch_size": batch}, progress=reports.append)  # the loss before the update
        first[accumulation] = _losses(reports)[0]
    assert first[2] == pytest.approx(first[1], rel=1e-4)
