"""The index of the scheduler's command handlers: each handler names its command next to it
(``@handles("dagfold.command.X")``), so a new command adds its handler and nothing elsewhere.

``HANDLERS`` (command type -> handler) is complete once ``dagfold.services.scheduler.handlers`` is
imported (it imports every family's module); ``listing()`` prints it as a table.
tests/test_handler_index.py checks that every command schema has exactly one handler.
"""

from __future__ import annotations

from collections.abc import Callable

from dagfold.codec import Record
from dagfold.services.scheduler.context import Ctx

Handler = Callable[[Ctx, Record], None]

HANDLERS: dict[str, Handler] = {}
"""Every scheduler command type and its handler (filled by ``handles`` as the handler modules load)."""


def handles(command: str) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``command`` (a schema's full name,
    ``dagfold.command.X``); a second handler for the same command is an error at import."""

    def register(handler: Handler) -> Handler:
        other = HANDLERS.setdefault(command, handler)
        if other is not handler:
            raise ValueError(f"{command} has two handlers: {other.__module__}.{other.__qualname__} and "
                             f"{handler.__module__}.{handler.__qualname__}")
        return handler

    return register


def listing() -> str:
    """The index as a Markdown table: each command and its handler, by module."""
    rows = sorted((h.__module__.rsplit(".", 1)[-1], kind.rsplit(".", 1)[-1], h.__name__)
                  for kind, h in HANDLERS.items())
    return "\n".join(["| module | command | handler |", "|---|---|---|"]
                     + [f"| ``{m}`` | {c} | ``{f}`` |" for m, c, f in rows])
