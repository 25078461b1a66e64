"""The worker process: runs dispatched task attempts and reports their outcomes.

``Worker`` (worker.py) consumes ``dispatch.<queue>``; handlers (handlers.py)
are what it runs; ``SideEffectLedger`` (sideeffects.py) deduplicates external
side effects across attempts.
"""

from services.worker.exceptions import (
    NonRetryableError,
    ProcessFailed,
    TaskCancelled,
    TaskError,
    TaskTimeout,
    UnknownHandlerError,
)
from services.worker.handlers import (
    Handler,
    HandlerRegistry,
    TaskContext,
    default_registry,
    register_handler,
)
from services.worker.sideeffects import SideEffectLedger
from services.worker.worker import Worker

__all__ = [
    "Handler",
    "HandlerRegistry",
    "NonRetryableError",
    "ProcessFailed",
    "SideEffectLedger",
    "TaskCancelled",
    "TaskContext",
    "TaskError",
    "TaskTimeout",
    "UnknownHandlerError",
    "Worker",
    "default_registry",
    "register_handler",
]
