"""``python -m dagfold.cli``."""

from dagfold.cli import main

main()
