"""Handlers as capabilities: which handlers are safe by default, and each built-in's argument rules.

A handler name in a job spec asks for a capability of the worker that runs
it. ``noop``, ``sleep`` and handlers registered in Python are safe: they run
the code the operator installed. ``shell`` runs whatever command the job
carries, as the worker's user: it is never enabled by default (a worker or
stack enables it with ``--handlers ...,shell``) and, where tenants are
configured, only tenants granted it may name it (``handlers: [..., shell]``
in the auth file or the admin API).

Argument rules are part of the job contract (``dagfold.jobspec.args``, re-exported
here): the API and the scheduler's validation call them at submission, and the
worker calls them again before it runs an attempt.
"""

from __future__ import annotations

from collections.abc import Iterable

from dagfold.jobspec.args import (
    BUILTIN_ARGS,
    MAX_CMD_CHARS,
    MAX_ENV_VARS,
    MAX_SLEEP_S,
    RESERVED_ENV_PREFIX,
    ArgsCheck,
    check_builtin_args,
    check_noop,
    check_shell,
    check_sleep,
)
from dagfold.tenants import UNSAFE_HANDLERS

__all__ = ["BUILTIN_ARGS", "MAX_CMD_CHARS", "MAX_ENV_VARS", "MAX_SLEEP_S", "RESERVED_ENV_PREFIX", "UNSAFE_HANDLERS",
           "ArgsCheck", "check_builtin_args", "check_noop", "check_shell", "check_sleep", "parse_handler_list"]


def parse_handler_list(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"noop,sleep,shell"`` (or a list of such) as a tuple of names, in order, without repeats."""
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        for name in (s.strip() for s in item.split(",")):
            if name and name not in out:
                out.append(name)
    return tuple(out)
