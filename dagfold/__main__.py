"""``python -m dagfold``: the same CLI as the ``dagfold`` console script."""

from dagfold.cli import main

main()
