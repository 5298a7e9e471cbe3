"""The version of unlimisum (kept apart so that every unit can name it without importing the package)."""

__version__ = "0.1.0"
