"""Errors a handler raises to shape the failure report its worker sends.

Any exception a handler raises fails the attempt with
``TaskFailed(error_type=type(exc).__name__, reason=str(exc), retryable=True)``.
The classes here refine that:

* ``NonRetryableError``: the failure is permanent (bad input, unknown handler);
  the report says ``retryable=False`` and the scheduler does not retry.
* ``ProcessFailed``: a process handler's command exited non-zero; the report
  carries ``exit_code`` and no Python error type.
* ``TaskTimeout``: the attempt ran past its ``start_to_close_s``.
* ``TaskCancelled``: the handler noticed ``ctx.cancelled`` and gave up.
"""

from __future__ import annotations

import signal

from dagfold.exceptions import DagfoldError


class TaskError(DagfoldError):
    """Base of the handler errors that carry report details."""

    retryable: bool = True

    def __init__(self, reason: str, *, retryable: bool | None = None, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if retryable is not None:
            self.retryable = retryable
        self.exit_code = exit_code

    def error_type(self) -> str | None:
        """The ``error_type`` of the report (the class name; None for process exits)."""
        return type(self).__name__


class NonRetryableError(TaskError):
    """Raise from a handler to fail the attempt for good (``retryable=False``)."""

    retryable = False


class UnknownHandlerError(NonRetryableError):
    """The dispatch record names a handler this worker does not have."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown handler {name!r}")
        self.name = name


class ProcessFailed(TaskError):
    """A process handler's command exited with a non-zero status (or was killed by a signal)."""

    def __init__(self, exit_code: int) -> None:
        if exit_code < 0:
            try:
                sig = signal.Signals(-exit_code).name
            except ValueError:
                sig = str(-exit_code)
            reason = f"killed by signal {sig}"
        else:
            reason = f"exit code {exit_code}"
        super().__init__(reason, exit_code=exit_code)

    def error_type(self) -> str | None:
        return None


class TaskTimeout(TaskError):
    """The attempt ran longer than its ``start_to_close_s``; reason ``start_to_close_timeout``."""

    def __init__(self, reason: str = "start_to_close_timeout") -> None:
        super().__init__(reason)


class TaskCancelled(TaskError):
    """The handler stopped because ``ctx.cancelled`` was set (StopTask, timeout, shutdown)."""
