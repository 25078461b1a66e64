"""Producing commands onto the commands topic: one place for the API, the CLI and tests.

Every command is keyed by its job ID so it lands on the job's partition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from dagfold.clock import now_ms
from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS
from dagfold.log import Log, Producer, partition_for


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


SETTINGS_KEY_PREFIX = "@settings."
"""Keys of settings commands: '@' is not allowed in job IDs, so a settings key never names a job."""


def settings_keys(partitions: int, partition_of: Callable[[bytes, int], int] = partition_for) -> list[str]:
    """One key per partition of the commands topic: the ``i``-th hashes to partition ``i``.

    Settings (tenant entitlements) must reach every scheduler partition, and a command's key must
    route it to its partition (the scheduler forwards misrouted ones), as Zeebe distributes a
    deployment to every partition. The smallest ``@settings.N`` per partition under the deployment's
    partitioner (``log.partition_for``); computed, never stored.
    """
    keys: list[str | None] = [None] * partitions
    left, n = partitions, 0
    while left:
        key = f"{SETTINGS_KEY_PREFIX}{n}"
        p = partition_of(key.encode(), partitions)
        if keys[p] is None:
            keys[p] = key
            left -= 1
        n += 1
    return [k for k in keys if k is not None]


def set_tenant_entitlements(tenant: str, entitlements: Record, partitions: int, source: str = "admin_api",
                            partition_of: Callable[[bytes, int], int] = partition_for) -> list[Record]:
    """The SetTenantEntitlements commands for every partition (send each with its own key)."""
    at = now_ms()
    return [{"type": "dagfold.command.SetTenantEntitlements", "job_id": key, "tenant": tenant,
             "entitlements": entitlements, "source": source, "requested_at_ms": at}
            for key in settings_keys(partitions, partition_of)]


def set_allocator_entitlements(tenant: str, entitlements: Record, partitions: int, source: str = "admin_api",
                               partition_of: Callable[[bytes, int], int] = partition_for) -> list[Record]:
    """The same settings for the GPU allocators: one ``dagfold.allocator.SetTenantEntitlements`` per partition
    of ``allocator.commands`` (``partitions`` of them), keyed by that partition's settings key, so that every
    pool's allocator folds them (weights and quotas change live; replay sees them). Send to that topic."""
    at = now_ms()
    return [{"type": "dagfold.allocator.SetTenantEntitlements", "pool": key, "tenant": tenant,
             "entitlements": entitlements, "source": source, "requested_at_ms": at}
            for key in settings_keys(partitions, partition_of)]


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

    def send(self, record: Record, key: str | None = None, topic: str = COMMANDS) -> None:
        """Write ``record`` keyed by ``key`` (default: its job ID, see ``job_id_of``) to ``topic``."""
        job_id = key if key is not None else job_id_of(record)
        value = self._codec.encode(record, validate_record=True)
        with self._lock:
            if self._producer is None:
                self._producer = self._log.producer(self._client_id)
            self._producer.send(topic, job_id.encode(), value)
            self._producer.flush()

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                producer, self._producer = self._producer, None
                producer.close()
