"""Each built-in handler's argument rules: part of the job contract, checked at submission.

Pure functions ``check(args) -> reason | None``. The API and the scheduler's validation
(``dagfold.jobspec.validation``) call them at submission (so ``sleep {secs: 1}`` is refused at once,
and an upstream producer's SubmitJob is rejected), and the worker calls them again before it runs an
attempt (``dagfold.services.worker.capabilities`` re-exports them). Cost: a few dict lookups per task,
no allocation beyond the args already decoded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ArgsCheck = Callable[[Mapping[str, Any]], "str | None"]

MAX_SLEEP_S = 7 * 24 * 3600.0
MAX_CMD_CHARS = 64 * 1024
MAX_ENV_VARS = 256
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
# Set by the worker for every attempt; a spec cannot override them.
RESERVED_ENV_PREFIX = "DAGFOLD_"


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _unknown(args: Mapping[str, Any], allowed: Iterable[str], handler: str) -> str | None:
    extra = sorted(set(args) - set(allowed))
    if extra:
        return f"{handler}: unknown argument {extra[0]!r} (allowed: {', '.join(sorted(allowed))})"
    return None


def check_noop(args: Mapping[str, Any]) -> str | None:
    """``noop`` ignores its arguments (DAG plumbing, benchmarks carry labels there)."""
    return None


def check_sleep(args: Mapping[str, Any]) -> str | None:
    """``sleep``: ``seconds`` (a finite number 0..7 days, default 0), nothing else."""
    bad = _unknown(args, ("seconds",), "sleep")
    if bad:
        return bad
    s = args.get("seconds", 0)
    if not _number(s) or not 0 <= s <= MAX_SLEEP_S:
        return f"sleep: args.seconds must be a number 0..{MAX_SLEEP_S:g}, got {s!r}"
    return None


def check_shell(args: Mapping[str, Any]) -> str | None:
    """``shell``: ``cmd`` (required), ``env`` (names to strings), ``cwd``, ``kill_grace_s``."""
    bad = _unknown(args, ("cmd", "env", "cwd", "kill_grace_s"), "shell")
    if bad:
        return bad
    cmd = args.get("cmd")
    if not isinstance(cmd, str) or not cmd.strip():
        return "shell: args.cmd must be a non-empty string"
    if len(cmd) > MAX_CMD_CHARS or "\x00" in cmd:
        return f"shell: args.cmd must be at most {MAX_CMD_CHARS} characters without NUL"
    env = args.get("env", {})
    if not isinstance(env, dict):
        return "shell: args.env must be an object of NAME: string"
    if len(env) > MAX_ENV_VARS:
        return f"shell: args.env has {len(env)} variables, limit {MAX_ENV_VARS}"
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            return f"shell: args.env name {str(k)[:40]!r} must match [A-Za-z_][A-Za-z0-9_]*"
        if k.startswith(RESERVED_ENV_PREFIX):
            return f"shell: args.env cannot set {k}: DAGFOLD_* variables are set by the worker"
        if isinstance(v, bool) or not isinstance(v, str | int | float) or "\x00" in str(v):
            return f"shell: args.env.{k} must be a string or a number"
    cwd = args.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd or "\x00" in cwd
                            or cwd.startswith("/") or ".." in cwd.split("/")):
        return "shell: args.cwd must be a relative path inside the attempt's work folder (no '..')"
    grace = args.get("kill_grace_s", 2.0)
    if not _number(grace) or not 0 <= grace <= 3600:
        return "shell: args.kill_grace_s must be a number 0..3600"
    return None


BUILTIN_ARGS: dict[str, ArgsCheck] = {"noop": check_noop, "sleep": check_sleep, "shell": check_shell}


def check_builtin_args(handler: str, args: Mapping[str, Any]) -> str | None:
    """The reason ``args`` are wrong for a built-in ``handler``; None if fine or not a built-in."""
    check = BUILTIN_ARGS.get(handler)
    return None if check is None else check(args)
