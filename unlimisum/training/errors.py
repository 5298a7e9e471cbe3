"""Errors of training, and the check that the optional training packages are installed."""

from __future__ import annotations

import importlib.util

from unlimisum.errors import InputError, UnlimisumError, install_hint

# import name -> distribution name, as the `train` extra in pyproject.toml lists them
TRAIN_PACKAGES = {"datasets": "datasets", "accelerate": "accelerate", "rouge_score": "rouge-score"}


class TrainingDataError(InputError):
    """A data file cannot be read, lacks a column, or has a row that cannot be trained on."""


class MissingExtraError(UnlimisumError):
    """A package of an optional extra is not installed."""


def require_training_extras() -> None:
    """MissingExtraError naming the extra when a training package is missing."""
    missing = [dist for module, dist in TRAIN_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtraError(f"training needs {', '.join(missing)}: {install_hint('train')}")
