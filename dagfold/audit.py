"""A job's complete timeline from the log: every command and event, with its coordinates.

Reads the job's partition of ``commands`` and ``events`` (a job lives on one
partition) and keeps the records keyed by the job ID. Audits are offline reads;
the cost is one partition's records.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from dagfold.codec import default_codec
from dagfold.config import COMMANDS, EVENTS
from dagfold.exceptions import CodecError
from dagfold.log import Log
from dagfold.log.reader import read_key

COLUMNS = ("topic", "partition", "offset", "timestamp_ms", "type", "task_id", "attempt", "worker_id",
           "cause_offset", "reason")


def job_timeline(log: Log, job_id: str, partitions: int) -> list[dict[str, Any]]:
    codec = default_codec()
    rows: list[dict[str, Any]] = []
    for topic in (COMMANDS, EVENTS):
        for r in read_key(log, topic, job_id.encode(), partitions):
            try:
                rec = codec.decode(r.value)
            except CodecError as exc:
                rec = {"type": "undecodable", "reason": str(exc)}
            rows.append({
                "topic": topic, "partition": r.partition, "offset": r.offset, "timestamp_ms": r.timestamp_ms,
                "type": rec["type"], "task_id": rec.get("task_id"), "attempt": rec.get("attempt"),
                "worker_id": rec.get("worker_id"), "cause_offset": rec.get("cause_offset"),
                "reason": rec.get("reason") or rec.get("code"), "record": _jsonable(rec)})
    rows.sort(key=lambda r: (r["timestamp_ms"], r["topic"] != COMMANDS, r["offset"]))
    return rows


def _jsonable(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.hex() if isinstance(v, bytes) else v) for k, v in rec.items()}


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def to_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=1, default=str)
