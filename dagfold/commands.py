"""Producing commands onto the commands topic: one place for the API, the CLI and tests.

Every command is keyed by its job ID so it lands on the job's partition.
"""

from __future__ import annotations

import threading
from typing import Any

from dagfold.clock import now_ms
from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS
from dagfold.log import Log, Producer


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
    """Thread-safe producer of commands; ``send`` returns once the record is durable.

    The one way dagfold's own clients write commands (API, CLI, stack, tests). The producer
    is made on the first send. Raises ``CodecError`` for an invalid record and ``LogError``
    when the log cannot take it; the API maps those to HTTP answers (``ApiSender``).
    """

    def __init__(self, log: Log, client_id: str = "dagfold-client") -> None:
        self._log = log
        self._client_id = client_id
        self._producer: Producer | None = None
        self._codec = default_codec()
        self._lock = threading.Lock()

    def send(self, record: Record, key: str | None = None) -> None:
        """Write ``record`` keyed by ``key`` (default: its job ID, see ``job_id_of``)."""
        job_id = key if key is not None else job_id_of(record)
        value = self._codec.encode(record, validate_record=True)
        with self._lock:
            if self._producer is None:
                self._producer = self._log.producer(self._client_id)
            self._producer.send(COMMANDS, job_id.encode(), value)
            self._producer.flush()

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                producer, self._producer = self._producer, None
                producer.close()
