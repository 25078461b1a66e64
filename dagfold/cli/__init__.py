"""The ``dagfold`` command line: the top layer (nothing else imports it)."""

from dagfold.cli.main import app, main

__all__ = ["app", "main"]
