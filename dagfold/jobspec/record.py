"""Facts of one accepted ``dagfold.common.JobSpec`` record (or task record) that every layer asks the same way."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from typing import Any

import fastavro

from dagfold.codec import Record, default_codec


def spec_hash(spec: Record) -> str:
    """SHA-256 of the spec's Avro encoding with job_id blanked: equal specs, equal hashes (a repeated
    submission is the same job; the same ID or idempotency key with another spec is refused)."""
    body = dict(spec, job_id="")
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, default_codec().schema("dagfold.common.JobSpec").parsed, body)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def is_gpu(t: Mapping[str, Any]) -> bool:
    """A task that asks for GPUs goes to its pool's allocator, not to a worker queue (a ``TaskSpec``, the
    fold's task record or the read model's: each carries ``resources``)."""
    res = t.get("resources")
    return bool(res and res.get("gpus", 0) > 0)
