"""Producing commands onto the commands topic: one place for the API, the CLI and tests.

Every command is keyed by its job ID so it lands on the job's partition.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS
from dagfold.log import Log


def now_ms() -> int:
    return int(time.time() * 1000)


def job_id_of(command: Record) -> str:
    """The job a command belongs to, which is also its record key (KeyError: not a job command)."""
    if command["type"] == "dagfold.command.SubmitJob":
        return str(command["spec"]["job_id"])
    return str(command["job_id"])


def submit_job(spec: dict[str, Any], source: str = "api") -> Record:
    return {"type": "dagfold.command.SubmitJob", "spec": spec, "submitted_at_ms": now_ms(), "source": source}


def cancel_job(job_id: str, reason: str = "cancelled by user") -> Record:
    return {"type": "dagfold.command.CancelJob", "job_id": job_id, "reason": reason, "requested_at_ms": now_ms()}


def redrive_job(job_id: str) -> Record:
    return {"type": "dagfold.command.RedriveJob", "job_id": job_id, "requested_at_ms": now_ms()}


class CommandSender:
    """Thread-safe producer of commands; ``send`` returns once the record is durable."""

    def __init__(self, log: Log, client_id: str = "dagfold-client") -> None:
        self._producer = log.producer(client_id)
        self._codec = default_codec()
        self._lock = threading.Lock()

    def send(self, record: Record) -> None:
        job_id = job_id_of(record)
        value = self._codec.encode(record, validate_record=True)
        with self._lock:
            self._producer.send(COMMANDS, job_id.encode(), value)
            self._producer.flush()

    def close(self) -> None:
        self._producer.close()
