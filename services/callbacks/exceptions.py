"""Errors of the callback notifier."""

from __future__ import annotations

from dagfold.exceptions import DagfoldError


class CallbackError(DagfoldError):
    """Base of the callback notifier's errors."""


class CallbackConfigError(CallbackError):
    """A ``DAGFOLD_CALLBACK_*`` setting is malformed, or the secret cannot be read or created."""
