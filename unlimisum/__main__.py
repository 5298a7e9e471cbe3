"""``python -m unlimisum``: the same as the ``unlimisum`` console script."""

from unlimisum.cli import main

if __name__ == "__main__":
    main()
