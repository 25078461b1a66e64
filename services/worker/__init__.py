"""The worker process: runs dispatched task attempts and reports their outcomes.

``Worker`` (worker.py) consumes ``dispatch.<queue>``; handlers (handlers.py)
are what it runs; ``SideEffectLedger`` (sideeffects.py) deduplicates external
side effects across attempts.
"""

from dagfold.services.worker.exceptions import (
    NonRetryableError,
    ProcessFailed,
    TaskCancelled,
    TaskError,
    TaskTimeout,
    UnknownHandlerError,
)
from dagfold.services.worker.handlers import (
    Handler,
    HandlerRegistry,
    TaskContext,
    default_registry,
    register_handler,
)
from dagfold.services.worker.sideeffects import SideEffectLedger
from dagfold.services.worker.worker import Worker

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
