"""Frozen settings of one training run. Every default says why it is what it is."""

from __future__ import annotations

from dataclasses import dataclass

from unlimisum.errors import ConfigError

# The paper's training methods (section 3), in its order.
METHODS = ("truncated", "chunked", "random-encoded", "retrieval", "alternating")
# The methods that encode the whole example and train through k-state attention.
LONG_METHODS = ("random-encoded", "retrieval", "alternating")
# What the best checkpoint can be chosen by: the ROUGE F-measures of generated summaries, or the loss.
METRICS = ("rougeL", "rougeLsum", "rouge1", "rouge2", "loss")
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TrainConfig:
    """How to train: method, data columns, validation, optimisation, checkpoints."""

    # The paper's best book-summarization model was trained alternating (BookSum, Table 4).
    method: str = "alternating"
    # Column names of the data files (JSON Lines, CSV, Parquet).
    text_field: str = "text"
    summary_field: str = "summary"
    # Validation files; empty: none (or a fraction of the training data, below).
    validation: tuple[str, ...] = ()
    # Fraction of the training rows held out for validation when no validation file is given; 0: none.
    validation_fraction: float = 0.0
    # Optimizer steps; None: `epochs` passes over the data.
    max_steps: int | None = None
    # Passes over the data when max_steps is None; 3 is the transformers default.
    epochs: float = 3.0
    # AdamW learning rate; 5e-5 is the transformers default and usual for BART fine-tuning.
    learning_rate: float = 5e-5
    # Examples per device batch; long inputs make 1 the common choice (the paper used 1 with accumulation).
    batch_size: int = 1
    # Batches summed into one optimizer step (the effective batch is batch_size x this).
    gradient_accumulation_steps: int = 1
    # Seeds data order, initial random state and the random-encoded draws.
    seed: int = 0
    # Training inputs are cut to this many tokens (the paper used 16k for its GPU memory).
    max_input_tokens: int = 16_384
    # States each cross-attention head attends to in random-encoded and retrieval training, and k when
    # validating; None: the model's window (the paper's choice), at most unlimisum's default k (1,024).
    retrieval_k: int | None = None
    # Overlap of the encoder windows of long methods and of validation, the same as test time's default.
    overlap: float = 0.5
    # Recompute activations in the backward pass: less memory for long inputs, about a third more time.
    gradient_checkpointing: bool = False
    # "auto": bfloat16 mixed precision on CUDA GPUs that have it, float16 on older ones, float32 on CPU.
    precision: str = "auto"
    # "auto" | "cpu" | "cuda" | "cuda:N" | "mps": where to train; auto is CUDA when available.
    device: str = "auto"
    # Optimizer steps between checkpoints (and validations, when there is a validation set).
    save_steps: int = 500
    # Checkpoints kept besides the best one; older ones are deleted.
    save_total_limit: int = 2
    # Optimizer steps between progress reports (loss, learning rate).
    logging_steps: int = 10
    # The validation figure that chooses the checkpoint kept (with a validation set).
    metric: str = "rougeL"
    # Longest validation summary in tokens; capped by the decoder's positions.
    eval_max_new_tokens: int = 256
    # Beam width of validation generation; 1 (greedy) keeps validation cheap.
    eval_num_beams: int = 1
    # Continue the unfinished run into the same output folder from its last checkpoint.
    resume: bool = False
    # Replace an existing output folder (only once the new one is complete).
    overwrite: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"unknown training method '{self.method}'; use one of {', '.join(METHODS)}")
        if self.metric not in METRICS:
            raise ConfigError(f"unknown metric '{self.metric}'; use one of {', '.join(METRICS)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision '{self.precision}'; use one of {', '.join(PRECISIONS)}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"validation fraction must be in [0, 1), got {self.validation_fraction}")
        if self.validation and self.validation_fraction:
            raise ConfigError("give validation files or a validation fraction, not both")
        if not 0.0 <= self.overlap < 1.0:
            raise ConfigError(f"overlap must be in [0, 1), got {self.overlap}")
        positive = dict(epochs=self.epochs, learning_rate=self.learning_rate, batch_size=self.batch_size,
                        gradient_accumulation_steps=self.gradient_accumulation_steps,
                        max_input_tokens=self.max_input_tokens, save_steps=self.save_steps,
                        logging_steps=self.logging_steps, eval_max_new_tokens=self.eval_max_new_tokens,
                        eval_num_beams=self.eval_num_beams, save_total_limit=self.save_total_limit)
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name.replace('_', ' ')} must be positive, got {value}")
        for name in ("max_steps", "retrieval_k"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be at least 1, got {value}")

    @property
    def is_long(self) -> bool:
        """The method encodes whole examples and trains through k-state attention."""
        return self.method in LONG_METHODS

    @property
    def has_validation(self) -> bool:
        """Validation files or a held-out fraction were asked for."""
        return bool(self.validation) or self.validation_fraction > 0
