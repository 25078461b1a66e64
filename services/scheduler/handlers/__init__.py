"""The scheduler's command handlers, one per command type, by family; ``HANDLERS`` is their index.

| family | module |
|---|---|
| a job's life | ``jobs`` |
| an operator's decision on a task | ``actions`` |
| a worker's report on its attempt | ``reports`` |
| a due timer | ``timers`` |
| the allocator's word on a GPU attempt | ``gpu`` |
| a tenant's settings | ``tenants`` |

Each handler names its command where it is defined (``@handles("dagfold.command.X")``, ``registry``); a
module's docstring lists its commands, and ``listing()`` prints the whole index from the registrations.
A handler decides in a ``context.Ctx``; what follows a task's outcome is in ``outcomes``, and every task
let run goes through ``runnable.make_runnable``.
"""

from __future__ import annotations

from dagfold.services.scheduler.handlers import actions, gpu, jobs, reports, tenants, timers  # noqa: F401  (register)
from dagfold.services.scheduler.handlers.registry import HANDLERS, Handler, handles, listing

__all__ = ["HANDLERS", "Handler", "handles", "listing"]
