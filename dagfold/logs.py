"""Process logs: plain text, or one JSON object a line for Loki / ELK (``--log-format json``,
``DAGFOLD_LOG_FORMAT=json``).

A JSON line carries ``ts``, ``level``, ``logger``, ``message`` and, where known, the fields of
``FIELDS`` (``trace_id``, ``job_id``, ``task_id``, ``attempt``, ``partition``, ``offset``, ``alloc_id``, ...;
``trace_id`` is the job's trace, ``dagfold.tracing``, so a log line joins its span in the backend): from the record's
``extra=`` or from ``log_context`` (a context variable, so a worker thread running a task or a
processor folding a record tags every line logged under it, its libraries' lines included).

The standard library's logging with a JSON formatter (json.dumps), not structlog: every module
already logs through ``logging.getLogger``; one formatter makes all of them structured.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

FIELDS = ("trace_id", "job_id", "task_id", "attempt", "partition", "offset", "topic", "queue", "worker", "tenant",
          "pool", "node", "alloc_id")
_CONTEXT: ContextVar[dict[str, Any]] = ContextVar("dagfold_log_context", default={})  # noqa: B039 (never mutated)
# extra= names some modules already use, and the field each one fills
ALIASES = {"worker_id": "worker"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _record_fields(record: logging.LogRecord) -> dict[str, Any]:
    found = dict(_CONTEXT.get())
    attrs = record.__dict__
    for name, field in ALIASES.items():
        if attrs.get(name) is not None:
            found[field] = attrs[name]
    for name in FIELDS:
        if attrs.get(name) is not None:
            found[name] = attrs[name]
    return found


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Tag every record logged in this block (this thread or task) with ``fields`` (None: left out)."""
    token = _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def context_fields() -> dict[str, Any]:
    return dict(_CONTEXT.get())


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC, ms), level, logger, message, the known fields, and
    the exception's traceback as ``exc`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        doc: dict[str, Any] = {"ts": ts, "level": record.levelname.lower(), "logger": record.name,
                               "message": record.getMessage()}
        doc.update(_record_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The plain format, with the known fields appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _record_fields(record)
        return line + ("".join(f" {k}={v}" for k, v in fields.items()) if fields else "")


def configure(level: int = logging.WARNING, fmt: str = "text") -> None:
    """Route the root logger to stderr in ``fmt`` (text or json) at ``level`` (replaces earlier handlers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
