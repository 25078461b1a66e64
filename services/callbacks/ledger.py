"""The notifier's durable ledger: which jobs want a callback, and each delivery's state.

A RocksDB store (``dagfold.projections.store.ReadModelStore``: msgpack values, atomic write
batches, reads safe from other threads) under ``<data>/callbacks``. Keys
(string parts escaped by ``dagfold.projections.keys.part``)::

    j  job                    -> {url, tenant, tier, accepted_ms, round, last_offset}   (from JobAccepted)
    d  job round(>I)          -> delivery {state, url, delivery_id, payload, attempts, next_attempt_ms,
                                           last_status, last_error, reason, created_ms, delivered_ms}
    q  due_ms(>Q) job round   -> b""   (the due-time index of pending deliveries)
    u  tenant due_ms(>Q) job round -> b""   (the same, per tenant: each tenant's turn at the delivery slots)

Only jobs with a ``callback_url`` are recorded. ``round`` counts redrives: a
redriven job that ends again gets a new delivery (``delivery_id``
``<job_id>`` for the first, ``<job_id>/redrive/<n>`` after the n-th redrive).
``last_offset`` is the events-topic offset of the last event applied to the
job (all of a job's events share one partition), which makes re-reading
events after a crash a no-op.

Delivery states: ``pending`` (in the due indexes at ``next_attempt_ms``),
``delivered`` (a 2xx answer) and ``gave_up`` (a final 4xx, an unusable URL, a
refused destination, or ``max_attempts`` reached; ``reason`` says which, for
operators). ``failure`` is the coarse class of the last failed attempt
(``FAILURES``): all a tenant sees of it (``status``), never what answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dagfold.projections.keys import SEP, U32, U64, part, unpart
from dagfold.projections.store import ReadModelStore, ReadModelTxn, decode_value

PENDING = "pending"
DELIVERED = "delivered"
GAVE_UP = "gave_up"
# what a tenant is told about a failed attempt (the HTTP status or error text could map the network behind)
REFUSED_DESTINATION = "refused_destination"  # the resolved address or port is not allowed (services/callbacks/egress)
TIMEOUT = "timeout"  # the attempt's deadline passed (connect + send + answer together)
HTTP_ERROR = "http_error"  # an answer other than 2xx
UNREACHABLE = "unreachable"  # no connection (refused, reset, no route, no DNS answer)
INVALID_URL = "invalid_url"
FAILURES = (REFUSED_DESTINATION, TIMEOUT, HTTP_ERROR, UNREACHABLE, INVALID_URL)
TENANT_FIELDS = ("state", "delivery_id", "attempts", "next_attempt_ms", "delivered_ms", "failure")

_JOB = b"j" + SEP
_DELIVERY = b"d" + SEP
_DUE = b"q" + SEP
_TENANT_DUE = b"u" + SEP

Record = dict[str, Any]


def job_key(job_id: str) -> bytes:
    return _JOB + part(job_id)


def delivery_key(job_id: str, round_: int) -> bytes:
    return _DELIVERY + part(job_id) + SEP + U32.pack(round_)


def due_key(due_ms: int, job_id: str, round_: int) -> bytes:
    return _DUE + U64.pack(max(due_ms, 0)) + part(job_id) + SEP + U32.pack(round_)


def tenant_due_key(tenant: str, due_ms: int, job_id: str, round_: int) -> bytes:
    return _TENANT_DUE + part(tenant) + SEP + due_key(due_ms, job_id, round_)[len(_DUE):]


def tenant_of(delivery: Record) -> str:
    """The tenant a delivery counts against (older ledgers kept it in the payload only)."""
    tenant: str = delivery.get("tenant") or delivery["payload"].get("tenant") or "default"
    return tenant


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
            out.update({k: d.get(k) for k in TENANT_FIELDS})
            if d["state"] != PENDING:
                out["next_attempt_ms"] = None
            if d["state"] == DELIVERED:
                out["failure"] = None
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

    def due_tenants(self) -> list[str]:
        """Tenants with a pending delivery, in key order (one seek per tenant)."""
        out: list[str] = []
        after: bytes | None = None
        while True:
            key = next((k for k, _ in self.store.scan(_TENANT_DUE, after=after)), None)
            if key is None:
                return out
            tenant = key[len(_TENANT_DUE):].split(SEP, 1)[0]
            out.append(unpart(tenant))
            after = _TENANT_DUE + tenant + b"\x01"  # past this tenant's keys: part() escapes 0x00 and 0x01

    def tenant_due(self, tenant: str, now_ms: int) -> Iterator[tuple[int, str, int]]:
        """A tenant's pending deliveries due at ``now_ms``, earliest first (lazily)."""
        prefix = _TENANT_DUE + part(tenant) + SEP
        for k, _ in self.store.scan(prefix):
            due = parse_due_key(_DUE + k[len(prefix):])
            if due[0] > now_ms:
                return
            yield due

    def next_due_ms(self) -> int | None:
        for k, _ in self.store.scan(_DUE):
            return parse_due_key(k)[0]
        return None

    def pending(self) -> int:
        """Deliveries waiting in the due index (a scan: for tests and the CLI, not the hot path)."""
        return sum(1 for _ in self.store.scan(_DUE))

    # -- writes (the notifier's thread) ------------------------------------------
    @staticmethod
    def schedule(txn: ReadModelTxn, delivery: Record, due_ms: int) -> None:
        """Put a pending delivery in both due indexes at ``due_ms`` (and in its record)."""
        delivery["next_attempt_ms"] = due_ms
        job_id, rnd = delivery["job_id"], delivery["round"]
        txn.put(due_key(due_ms, job_id, rnd), 0)
        txn.put(tenant_due_key(tenant_of(delivery), due_ms, job_id, rnd), 0)

    @staticmethod
    def unschedule(txn: ReadModelTxn, delivery: Record, due_ms: int | None = None) -> None:
        """Take a delivery out of both due indexes (at ``due_ms``, default its ``next_attempt_ms``)."""
        due = delivery["next_attempt_ms"] if due_ms is None else due_ms
        if due is None:
            return
        job_id, rnd = delivery["job_id"], delivery["round"]
        txn.delete(due_key(due, job_id, rnd))
        txn.delete(tenant_due_key(tenant_of(delivery), due, job_id, rnd))

    def reindex(self) -> int:
        """Make the due indexes match the pending deliveries: add the per-tenant entries a ledger written
        before that index lacks, drop entries of deliveries no longer pending there; returns keys changed."""
        txn = self.txn()
        for k, _ in self.store.scan(_DUE):
            due_ms, job_id, rnd = parse_due_key(k)
            d = self.delivery(job_id, rnd)
            if d is None or d["state"] != PENDING or d["next_attempt_ms"] != due_ms:
                txn.delete(k)
                continue
            key = tenant_due_key(tenant_of(d), due_ms, job_id, rnd)
            if self.store.get_raw(key) is None:
                txn.put(key, 0)
        changed = len(txn)
        if changed:
            self.commit(txn)
        return changed

    def txn(self) -> ReadModelTxn:
        return self.store.txn()

    def commit(self, txn: ReadModelTxn) -> None:
        self.store.commit(txn)

    def close(self) -> None:
        if self._owns:
            self.store.close()
