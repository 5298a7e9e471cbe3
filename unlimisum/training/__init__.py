"""Unlimiformer training (paper section 3): fine-tune a checkpoint to read through retrieval.

    import unlimisum
    result = unlimisum.train("train.jsonl", model="facebook/bart-base", output_dir="bart-books",
                             method="alternating", validation=("dev.jsonl",), max_steps=2000)

- ``config``: TrainConfig, the methods and metrics;
- ``data``: reading and checking JSON Lines / CSV / Parquet files, tokenizing for a method;
- ``attention``: the training-time cross-attention (random or top-k states, with gradients);
- ``methods``: which attention each batch of a method uses;
- ``trainer``: the transformers Seq2SeqTrainer subclass, progress, validation with retrieval;
- ``run``: ``train()``, writing the output folder all at once.

Heavy packages (torch, transformers, datasets) load when ``train()`` runs; ``unlimisum.train`` is
this package's ``train``.
"""

from __future__ import annotations

from unlimisum.training.config import LONG_METHODS, METHODS, METRICS, TrainConfig
from unlimisum.training.errors import MissingExtraError, TrainingDataError, require_training_extras


def train(*args, **kwargs):
    """Fine-tune a checkpoint; see ``unlimisum.training.run.train``."""
    from unlimisum.training.run import train as run_train

    return run_train(*args, **kwargs)


__all__ = ["LONG_METHODS", "METHODS", "METRICS", "MissingExtraError", "TrainConfig", "TrainingDataError",
           "require_training_extras", "train"]
