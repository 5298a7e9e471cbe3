"""The glue between the paper's methods and the transformers Seq2SeqTrainer.

``UnlimiformerTrainer`` changes three things of the stock trainer:
- ``training_step``: for the long methods the decoder's cross-attentions are wrapped for the
  forward *and* backward pass of the batch (so a gradient-checkpointing recomputation sees the
  same attention) and unwrapped after it, so checkpoints hold the model's own parameter names;
- ``compute_loss``: the long methods encode the whole example in windows with gradients and
  attend to k states per head (unlimisum/training/attention.py);
- ``evaluate``: validation is the paper's early stopping with retrieval: each validation text is
  summarized at full length by unlimisum's test-time retrieval (exact search), scored with ROUGE,
  and the loss is the teacher-forced loss under the same retrieval attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import Seq2SeqTrainer, TrainerCallback

from unlimisum.models import compat
from unlimisum.models.architectures import Architecture
from unlimisum.training.attention import TrainingSession, encode_long, training_attention
from unlimisum.training.methods import attention_mode

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@dataclass(frozen=True)
class MethodSetup:
    """What the trainer needs besides the stock arguments."""

    method: str
    architecture: Architecture
    window: int  # the encoder's window in tokens
    overlap: float  # of the encoder windows, as at test time
    top_k: int  # states each head attends to (training and validation)
    max_input_tokens: int  # validation inputs are cut here too
    eval_max_new_tokens: int
    eval_num_beams: int
    seed: int
    name: str  # the model's name, for messages


@dataclass(frozen=True)
class TrainProgress:
    """One progress report: after ``step`` of ``total`` optimizer steps."""

    step: int
    total: int
    loss: float | None = None  # mean training loss since the previous report
    learning_rate: float | None = None
    metrics: dict = field(default_factory=dict)  # validation figures, when this report is a validation


class ProgressReporter(TrainerCallback):
    """Turns the trainer's logs into ``TrainProgress`` reports."""

    def __init__(self, report: Callable[[TrainProgress], None]):
        self.report = report

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        metrics = {key[len("eval_"):]: value for key, value in logs.items() if key.startswith("eval_")}
        if "loss" in logs or metrics:
            self.report(TrainProgress(state.global_step, state.max_steps, logs.get("loss"),
                                      logs.get("learning_rate"), metrics))


class UnlimiformerTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer with the paper's training-time attention and validation by retrieval."""

    def __init__(self, *args, setup: MethodSetup, validation_rows=None, **kwargs):
        super().__init__(*args, **kwargs)
        # The seq2seq models' losses are the mean over their own batch and ignore num_items_in_batch (BART, T5,
        # PEGASUS...), though their forward takes **kwargs; told otherwise, the Trainer would sum the mean
        # losses of accumulated batches (a loss and gradients gradient_accumulation_steps times too large).
        self.model_accepts_loss_kwargs = False
        self.setup = setup
        self.validation_rows = validation_rows  # rows with text and summary, or None
        self.modes: list[str | None] = []  # attention mode of every training batch, in order
        self._wrappers: list | None = None
        self._batch_index: int | None = None

    # -- training --------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if attention_mode(self.setup.method, 0) is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with training_attention(self.accelerator.unwrap_model(model), self.setup.architecture) as wrappers:
            self._wrappers = wrappers
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                for wrapper in wrappers:
                    wrapper.session = None
                self._wrappers = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._wrappers is None:  # truncated, chunked
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._batch_index is None:  # a resumed run continues the alternation where it stopped
            self._batch_index = self.state.global_step * self.args.gradient_accumulation_steps
        mode = attention_mode(self.setup.method, self._batch_index)
        generator = torch.Generator().manual_seed(self.setup.seed * 1_000_003 + self._batch_index)
        self._batch_index += 1
        self.modes.append(mode)
        session = long_session(self.accelerator.unwrap_model(model), self.setup, inputs["input_ids"],
                               inputs["attention_mask"], mode, generator)
        for wrapper in self._wrappers:
            wrapper.session = session
        long_inputs = {"encoder_outputs": compat.encoder_outputs(session.states),
                       "attention_mask": session.mask.long(), "labels": inputs["labels"]}
        if "decoder_input_ids" in inputs:
            long_inputs["decoder_input_ids"] = inputs["decoder_input_ids"]
        return super().compute_loss(model, long_inputs, return_outputs, num_items_in_batch)

    # -- validation ------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        if self.validation_rows is None:
            return {}
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            scores = validate(model, self.processing_class, self.setup, self.validation_rows)
        finally:
            model.train(was_training)
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in scores.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


def long_session(model, setup: MethodSetup, input_ids, attention_mask, mode: str, generator=None) -> TrainingSession:
    """Encode a batch in windows (with gradients when enabled) and make the session its attention reads."""
    states, mask = encode_long(model, setup.architecture, input_ids, attention_mask, setup.window, setup.overlap)
    return TrainingSession(states, mask, mode, setup.top_k, generator)


def validate(model, tokenizer, setup: MethodSetup, rows) -> dict:
    """Validation figures: ROUGE F-measures (x100) of full-length retrieval summaries, and the loss."""
    from rouge_score import rouge_scorer

    from unlimisum.config import EncodingConfig, GenerationOptions, IndexConfig, RetrievalConfig
    from unlimisum.models import LoadedModel
    from unlimisum.models.tokens import encode_text
    from unlimisum.summarizer import Summarizer

    loaded = LoadedModel(model=model, tokenizer=tokenizer, architecture=setup.architecture, name=setup.name)
    limit = loaded.max_target_length
    max_new = min(setup.eval_max_new_tokens, limit) if limit else setup.eval_max_new_tokens
    summarizer = Summarizer(
        loaded, encoding=EncodingConfig(overlap=setup.overlap, window=setup.window),
        index=IndexConfig(kind="exact"), retrieval=RetrievalConfig(retrieval_k=setup.top_k),
        generation=GenerationOptions(max_new_tokens=max_new, num_beams=setup.eval_num_beams, do_sample=False),
    )
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    losses = []
    device = next(model.parameters()).device
    for text, summary in zip(rows["text"], rows["summary"]):
        predicted = summarizer.summarize(text).text
        for name, score in scorer.score(summary, predicted).items():
            totals[name] += score.fmeasure
        ids = torch.tensor([encode_text(tokenizer, text, add_special_tokens=True,
                                        max_length=setup.max_input_tokens).ids])
        labels = torch.tensor([encode_text(tokenizer, summary, add_special_tokens=True, target=True).ids])
        with torch.no_grad(), training_attention(model, setup.architecture) as wrappers:
            session = long_session(model, setup, ids.to(device), torch.ones_like(ids).to(device), "retrieval")
            for wrapper in wrappers:
                wrapper.session = session
            outputs = model(encoder_outputs=compat.encoder_outputs(session.states),
                            attention_mask=session.mask.long(), labels=labels.to(device))
        losses.append(outputs.loss.item())
    n = len(losses)
    return {**{name: 100 * total / n for name, total in totals.items()}, "loss": sum(losses) / n}
