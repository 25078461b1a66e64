"""The notifier's durable ledger: which jobs want a callback, and each delivery's state.

A RocksDB store (``dagfold.projections.store.ReadModelStore``: msgpack values, atomic write
batches, reads safe from other threads) under ``<data>/callbacks``. Keys
(string parts escaped by ``dagfold.projections.keys.part``)::

    j  job                    -> {url, tenant, tier, accepted_ms, round, last_offset}   (from JobAccepted)
    d  job round(>I)          -> delivery {state, url, delivery_id, payload, attempts, next_attempt_ms,
                                           last_status, last_error, reason, created_ms, delivered_ms}
    q  due_ms(>Q) job round   -> b""   (the due-time index of pending deliveries)

Only jobs with a ``callback_url`` are recorded. ``round`` counts redrives: a
redriven job that ends again gets a new delivery (``delivery_id``
``<job_id>`` for the first, ``<job_id>/redrive/<n>`` after the n-th redrive).
``last_offset`` is the events-topic offset of the last event applied to the
job (all of a job's events share one partition), which makes re-reading
events after a crash a no-op.

Delivery states: ``pending`` (in the due index at ``next_attempt_ms``),
``delivered`` (a 2xx answer) and ``gave_up`` (a final 4xx, an unusable URL,
or ``max_attempts`` reached; ``reason`` says which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagfold.projections.keys import SEP, U32, U64, part, unpart
from dagfold.projections.store import ReadModelStore, ReadModelTxn, decode_value

PENDING = "pending"
DELIVERED = "delivered"
GAVE_UP = "gave_up"

_JOB = b"j" + SEP
_DELIVERY = b"d" + SEP
_DUE = b"q" + SEP

Record = dict[str, Any]


def job_key(job_id: str) -> bytes:
    return _JOB + part(job_id)


def delivery_key(job_id: str, round_: int) -> bytes:
    return _DELIVERY + part(job_id) + SEP + U32.pack(round_)


def due_key(due_ms: int, job_id: str, round_: int) -> bytes:
    return _DUE + U64.pack(max(due_ms, 0)) + part(job_id) + SEP + U32.pack(round_)


def parse_due_key(k: bytes) -> tuple[int, str, int]:
    """``(due_ms, job_id, round)`` of a due-index key."""
    body = k[len(_DUE):]
    return U64.unpack(body[:8])[0], unpart(body[8:-5]), U32.unpack(body[-4:])[0]


def delivery_id(job_id: str, round_: int) -> str:
    """The receiver's idempotency key (``X-Dagfold-Delivery``)."""
    return job_id if round_ == 0 else f"{job_id}/redrive/{round_}"


class CallbackLedger:
    """The ledger over its own store (a path opens one and owns it)."""

    def __init__(self, path: Path | ReadModelStore) -> None:
        self._owns = not isinstance(path, ReadModelStore)
        self.store = path if isinstance(path, ReadModelStore) else ReadModelStore(path)

    # -- reads (any thread) ------------------------------------------------------
    def job(self, job_id: str) -> Record | None:
        rec: Record | None = self.store.get(job_key(job_id))
        return rec

    def delivery(self, job_id: str, round_: int | None = None) -> Record | None:
        """A delivery of a job: of ``round_``, or of the latest round that has one."""
        if round_ is not None:
            rec: Record | None = self.store.get(delivery_key(job_id, round_))
            return rec
        for _, v in self.store.scan(_DELIVERY + part(job_id) + SEP, reverse=True):
            latest: Record = decode_value(v)
            return latest
        return None

    def status(self, job_id: str) -> Record | None:
        """What the API shows: the URL and the latest delivery (None: the job has no callback here)."""
        job = self.job(job_id)
        if job is None:
            return None
        d = self.delivery(job_id)
        out: Record = {"url": job["url"], "round": job["round"], "state": "awaiting_end"}
        if d is not None and d["round"] == job["round"]:
            out.update({k: d[k] for k in ("state", "delivery_id", "attempts", "next_attempt_ms", "last_status",
                                          "last_error", "reason", "delivered_ms")})
            if d["state"] != PENDING:
                out["next_attempt_ms"] = None
        return out

    def due(self, now_ms: int, limit: int) -> list[tuple[int, str, int]]:
        """Pending deliveries due at ``now_ms``, earliest first: ``(due_ms, job_id, round)``."""
        out: list[tuple[int, str, int]] = []
        for k, _ in self.store.scan(_DUE):
            due = parse_due_key(k)
            if due[0] > now_ms or len(out) >= limit:
                break
            out.append(due)
        return out

    def next_due_ms(self) -> int | None:
        for k, _ in self.store.scan(_DUE):
            return parse_due_key(k)[0]
        return None

    def pending(self) -> int:
        """Deliveries waiting in the due index (a scan: for tests and the CLI, not the hot path)."""
        return sum(1 for _ in self.store.scan(_DUE))

    # -- writes (the notifier's thread) ------------------------------------------
    def txn(self) -> ReadModelTxn:
        return self.store.txn()

    def commit(self, txn: ReadModelTxn) -> None:
        self.store.commit(txn)

    def close(self) -> None:
        if self._owns:
            self.store.close()
