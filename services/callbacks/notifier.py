"""The callback notifier: POSTs a signed JSON body once a job with a ``callback_url`` ends.

Data flow (one ``CallbackNotifier``: its reader, its ledger, a pool of HTTP threads)::

    events (every partition, from the positions in the ledger) --> _ingest: one ledger write batch
        JobAccepted with spec.callback_url   -> remember the URL (ledger ``j``)
        JobSucceeded | JobFailed | JobCancelled of a remembered job -> delivery ``pending``, due now
        JobRedriven, TaskReopened            -> the next end is a new delivery (``round`` + 1)
    ledger due index, tenant by tenant (due <= now, a tenant at most tenant_concurrency in flight)
        --> HTTP pool: resolve, check the address (egress), POST there within one deadline --> outcome
        --> ledger write batch
        2xx -> delivered;  408, 429, other non-2xx, connection error, timeout -> pending, due after a backoff;
        other 4xx, unusable URL, refused destination, or max_attempts reached -> gave_up (with the reason)

"Called once": the reader runtime (``dagfold.log.reader.Reader``) writes a polled
batch's ledger changes and the next positions in one write batch, and re-reading
events is a no-op anyway (the ledger keeps each job's last applied offset: a ledger
written before it held its positions reads the topic again from the start), so a
restart neither loses a job's end nor schedules its delivery twice; a delivered
callback is never sent again. A
delivery in flight when the process dies is still ``pending`` in the ledger
and is sent again after the restart (at least once): the receiver deduplicates
on ``X-Dagfold-Delivery``.

Pending retries never block anything: they wait in the ledger's due-time index
and the loop only polls (at most until the next due time); up to
``options.concurrency`` deliveries run at once on their own threads, at most
``options.tenant_concurrency`` of one tenant, taken tenant by tenant in turn
(round robin over the tenants with due deliveries), and each attempt ends by
its deadline (``options.timeout_s`` for all of it: ``egress.attempt_deadline``).
So a tenant whose receivers answer one byte at a time holds its own slots for
at most one deadline each and never the other tenants' (issue 24, recipe 6).

Where a callback may go is ``egress.EgressRules``: the client's only way to
connect is ``egress.GuardedBackend``, which resolves the host once, refuses a
denied address and connects to the address it checked. A tenant sees a
delivery's state and the coarse class of its last failure (``ledger.FAILURES``),
never the status or error text of what answered (recipe 5); operators have both
in the ledger and the log.

One notifier per deployment: the ledger is local to its data folder, and the
URL of a job is known only to the instance that read its JobAccepted (it reads
every partition itself, no consumer group).

Metrics (``dagfold.metrics``): callbacks delivered, retried, given up by
reason; consumer lag of the events topic.
"""

from __future__ import annotations

import concurrent.futures as cf
import email.utils
import json
import logging
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import httpcore
import httpx

from dagfold import metrics
from dagfold.clock import now_ms
from dagfold.codec import Codec, default_codec
from dagfold.config import EVENTS
from dagfold.exceptions import CodecError
from dagfold.lifecycle import JOB_ENDING_EVENTS, job_state_after
from dagfold.log.base import Log, LogRecord
from dagfold.log.reader import Reader
from dagfold.projections.store import ReadModelTxn
from dagfold.services.callbacks.egress import GuardedBackend, RefusedDestination, attempt_deadline
from dagfold.services.callbacks.ledger import (
    DELIVERED,
    GAVE_UP,
    HTTP_ERROR,
    INVALID_URL,
    PENDING,
    REFUSED_DESTINATION,
    TIMEOUT,
    UNREACHABLE,
    CallbackLedger,
    Record,
    delivery_id,
    delivery_key,
    job_key,
    tenant_of,
)
from dagfold.services.callbacks.options import CallbackOptions
from dagfold.services.callbacks.signing import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign

log = logging.getLogger("dagfold.callbacks")

LEDGER_DIR = "callbacks"
USER_AGENT = "dagfold-callbacks/0.1"
ACCEPTED = "dagfold.event.JobAccepted"
REDRIVEN = "dagfold.event.JobRedriven"
REOPENED = "dagfold.event.TaskReopened"  # an operator's task retry or mark-succeeded: an ended job runs again
TERMINAL = JOB_ENDING_EVENTS  # the state each leaves the job in: dagfold.lifecycle.job_state_after
SUCCEEDED = "dagfold.event.TaskSucceeded"  # its outputs go into the job's callback
RELEVANT = frozenset({ACCEPTED, REDRIVEN, REOPENED, SUCCEEDED, *TERMINAL})
MAX_CALLBACK_OUTPUTS = 100
RETRYABLE_4XX = frozenset({408, 429})
MAX_ERROR_CHARS = 500
LAG_CHECK_S = 5.0


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to: ``delivered``, ``retry`` or ``final`` (give up now).

    ``failure`` is the coarse class a tenant is shown (``ledger.FAILURES``); ``status`` and ``error``
    say what answered, for the ledger and the log only.
    """

    kind: str
    status: int | None = None
    error: str | None = None
    retry_after_s: float | None = None
    failure: str | None = None


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    v = value.strip()
    if v.isascii() and v.isdigit():  # isdigit alone accepts "²", which float() refuses
        return float(v)
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def _usable_url(url: str) -> str | None:
    """Why ``url`` cannot be called (None: it can)."""
    try:
        u = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        return f"invalid callback URL: {exc}"
    if u.scheme not in ("http", "https") or not u.host:
        return f"callback URL must be http(s)://host/...: {url[:200]!r}"
    return None


def classify(status: int, retry_after: str | None = None) -> Outcome:
    """The outcome of an HTTP answer: 2xx delivered; 408, 429 and every non-4xx retried; other 4xx final."""
    if 200 <= status < 300:
        return Outcome("delivered", status)
    if 400 <= status < 500 and status not in RETRYABLE_4XX:
        return Outcome("final", status, f"HTTP {status}", failure=HTTP_ERROR)
    return Outcome("retry", status, f"HTTP {status}", _retry_after(retry_after), HTTP_ERROR)


def guarded_transport(options: CallbackOptions) -> httpx.HTTPTransport:
    """httpx's transport whose connections go through ``egress.GuardedBackend`` (no keep-alive: every
    attempt resolves and checks its destination again).

    httpx.HTTPTransport takes no network backend, so its pool is rebuilt with one; the arguments are
    those HTTPTransport.__init__ passes to httpcore.ConnectionPool (httpx 0.28 ``_transports/default.py``),
    and a custom ``network_backend`` is httpcore's public extension point "for non-standard SSL or DNS
    requirements" (httpcore's docs/network-backends.md, "Custom network backends").
    """
    transport = httpx.HTTPTransport(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
    transport._pool = httpcore.ConnectionPool(  # noqa: SLF001 - see the docstring
        ssl_context=httpx.create_ssl_context(trust_env=False), max_keepalive_connections=0,
        network_backend=GuardedBackend(options.egress))
    return transport


class CallbackNotifier:
    """Tails the events topic and delivers job-end callbacks; ``run`` until stopped, then ``close``.

    ``options`` defaults to ``CallbackOptions.from_env(data_dir)``; ``own_ports`` adds the ports this
    process serves to the egress rules' closed ports. The ledger
    lives in ``data_dir / "callbacks"``; ``ledger`` may be read from other
    threads (the API shows delivery states from it).
    """

    def __init__(
        self,
        log: Log,
        data_dir: Path,
        options: CallbackOptions | None = None,
        *,
        batch_max_records: int = 2000,
        poll_timeout_s: float = 0.2,
        codec: Codec | None = None,
        transport: httpx.BaseTransport | None = None,
        own_ports: Iterable[int] = (),
    ) -> None:
        self.log = log
        opts = options if options is not None else CallbackOptions.from_env(data_dir)
        if own_ports:  # the ports this process serves (its API, its metrics): closed to callbacks
            opts = replace(opts, egress=replace(opts.egress, own_ports=opts.egress.own_ports | frozenset(own_ports)))
        self.options = opts
        self.ledger = CallbackLedger(data_dir / LEDGER_DIR)
        self._codec = codec or default_codec()
        self._relevant_fp: dict[bytes, bool] = {}  # writer fingerprint -> is it a type the notifier reads
        self._client = httpx.Client(timeout=self.options.timeout_s, follow_redirects=False, trust_env=False,
                                    transport=transport or guarded_transport(self.options),
                                    headers={"User-Agent": USER_AGENT})
        self._pool = cf.ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="callbacks-http")
        self._in_flight: dict[tuple[str, int], cf.Future[Outcome]] = {}
        self._tenant_in_flight: dict[tuple[str, int], str] = {}  # the tenant each attempt in flight counts against
        self._last_tenant = ""  # the tenant served last: the next round starts after it
        self.ledger.reindex()
        self._rng = random.Random()
        self._closed = False
        self.reader: Reader[ReadModelTxn] = Reader(
            log, "callbacks", (EVENTS,), self.ledger.store, self._ingest, batch_max_records=batch_max_records,
            poll_timeout_s=poll_timeout_s, lag_every_s=LAG_CHECK_S, client_id="dagfold-callbacks",
            tick=self._tick, wait_s=self._poll_wait_s)
        # counters of this instance (the Prometheus counters are process-wide)
        self.delivered = 0
        self.retried = 0
        self.gave_up = 0
        self.attempts = 0

    # -- the events side ------------------------------------------------------------
    def _relevant(self, rec: LogRecord) -> Record | None:
        """The decoded event if it is one the notifier reads (other types are skipped by fingerprint)."""
        fp = rec.value[2:10] if rec.value is not None else b""
        if self._relevant_fp.get(fp) is False:
            return None
        try:
            ev = self._codec.decode(rec.value)
        except CodecError as exc:
            log.warning("callbacks skip %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
            return None
        relevant = ev["type"] in RELEVANT
        self._relevant_fp[fp] = relevant
        return ev if relevant else None

    def _ingest(self, records: list[LogRecord], txn: ReadModelTxn) -> None:
        """The reader's handler: apply polled events to the ledger's write batch (the reader adds the positions)."""
        now = self._now_ms()
        for rec in records:
            ev = self._relevant(rec)
            if ev is not None:
                self._apply(txn, ev, rec.offset, now)

    def _apply(self, txn: ReadModelTxn, ev: Record, offset: int, now_ms: int) -> int:
        job_id: str = ev["job_id"]
        jk = job_key(job_id)
        kind = ev["type"]
        if kind == ACCEPTED:
            spec = ev["spec"]
            url = spec.get("callback_url")
            if url and txn.get(jk) is None:
                txn.put(jk, {"url": url, "tenant": spec.get("tenant", "default"), "tier": spec.get("tier"),
                             "accepted_ms": ev["ts_ms"], "round": 0, "last_offset": offset})
            return 0
        job = txn.get(jk)
        if job is None or offset <= job["last_offset"]:
            return 0  # no callback wanted, or read before (a re-read after a crash)
        job["last_offset"] = offset
        rnd = job["round"]
        dk = delivery_key(job_id, rnd)
        if kind in (REDRIVEN, REOPENED):
            if txn.get(dk) is not None:
                job["round"] = rnd + 1  # the job runs again: its next end is a new delivery
                job["outputs"] = []
            txn.put(jk, job)
            return 0
        if kind == SUCCEEDED:  # the outputs a task returned, for the job's callback (bounded)
            kept = [o for o in job.get("outputs", []) if o["task_id"] != ev["task_id"]]
            base = f"/v1/jobs/{job_id}/tasks/{ev['task_id']}/outputs/"
            kept += [{"task_id": ev["task_id"], **o, "download": base + o["name"]} for o in ev.get("outputs") or []]
            job["outputs"] = kept[:MAX_CALLBACK_OUTPUTS]
            if ev.get("result_json") is not None:
                job["result_json"] = ev["result_json"]
            txn.put(jk, job)
            return 0
        txn.put(jk, job)
        if txn.get(dk) is not None:
            return 0
        state = job_state_after(ev)
        partial = bool(ev.get("partial", False))
        did = delivery_id(job_id, rnd)
        payload = {"delivery_id": did, "job_id": job_id, "state": state, "reason": ev.get("reason"),
                   "partial": partial, "tenant": job["tenant"], "tier": job["tier"], "round": rnd,
                   "accepted_ms": job["accepted_ms"], "ended_ms": ev["ts_ms"],
                   "outputs": job.get("outputs", []), "result_json": job.get("result_json")}
        d = {"job_id": job_id, "round": rnd, "url": job["url"], "delivery_id": did, "state": PENDING,
             "tenant": job["tenant"], "payload": payload, "attempts": 0, "next_attempt_ms": now_ms,
             "created_ms": now_ms, "last_attempt_ms": None, "last_status": None, "last_error": None,
             "failure": None, "reason": None, "delivered_ms": None}
        CallbackLedger.schedule(txn, d, now_ms)
        txn.put(dk, d)
        return 1

    # -- the delivery side ------------------------------------------------------------
    def _attempt(self, delivery: Record) -> Outcome:
        """One POST (on a pool thread): never raises, says what came of it."""
        bad = _usable_url(delivery["url"])
        if bad is not None:
            return Outcome("final", None, bad, failure=INVALID_URL)
        sent_ms = self._now_ms()
        body = json.dumps({**delivery["payload"], "attempt": delivery["attempts"] + 1, "sent_ms": sent_ms},
                          separators=(",", ":"), sort_keys=True).encode()
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(self.options.secret, body),
            DELIVERY_HEADER: delivery["delivery_id"],
            TIMESTAMP_HEADER: str(sent_ms // 1000),
        }
        try:
            with attempt_deadline(self.options.timeout_s), \
                    self._client.stream("POST", delivery["url"], content=body, headers=headers) as resp:
                return classify(resp.status_code, resp.headers.get("retry-after"))  # the body is never read
        except RefusedDestination as exc:
            return Outcome("final", None, str(exc)[:MAX_ERROR_CHARS], failure=REFUSED_DESTINATION)
        except httpx.UnsupportedProtocol as exc:
            return Outcome("final", None, f"unusable callback URL: {exc}"[:MAX_ERROR_CHARS], failure=INVALID_URL)
        except httpx.TimeoutException as exc:
            return Outcome("retry", None, f"timeout after {self.options.timeout_s:g}s: {type(exc).__name__}",
                           failure=TIMEOUT)
        except httpx.HTTPError as exc:
            return Outcome("retry", None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS], failure=UNREACHABLE)
        except Exception as exc:  # a bug or a closed client: retried, never lost
            log.exception("callback attempt for %s failed unexpectedly", delivery["delivery_id"])
            return Outcome("retry", None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS], failure=UNREACHABLE)

    def backoff_s(self, attempts: int, retry_after_s: float | None = None) -> float:
        """Wait before the next attempt after ``attempts`` failed ones: exponential, half of it jitter."""
        o = self.options
        cap = min(o.max_backoff_s, o.base_backoff_s * 2.0 ** min(max(attempts - 1, 0), 62))
        delay = cap / 2 + self._rng.uniform(0, cap / 2)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, o.max_backoff_s))
        return delay

    def _record(self, txn: ReadModelTxn, job_id: str, rnd: int, outcome: Outcome, now_ms: int) -> str | None:
        """Write an attempt's outcome; returns the metric it counts for (delivered, retried, gave_up:<why>)."""
        dk = delivery_key(job_id, rnd)
        d = txn.get(dk)
        if d is None or d["state"] != PENDING:
            return None
        CallbackLedger.unschedule(txn, d)
        d["attempts"] += 1
        d.update(last_attempt_ms=now_ms, last_status=outcome.status, last_error=outcome.error,
                 failure=outcome.failure)
        counted: str
        if outcome.kind == "delivered":
            d.update(state=DELIVERED, delivered_ms=now_ms, next_attempt_ms=None, last_error=None)
            counted = "delivered"
            log.info("callback %s delivered to %s (HTTP %s, attempt %d)", d["delivery_id"], d["url"],
                     outcome.status, d["attempts"])
        elif outcome.kind == "final" or d["attempts"] >= self.options.max_attempts:
            if outcome.kind == "final":
                why = outcome.failure if outcome.status is None and outcome.failure else "rejected"
                reason = f"final answer: {outcome.error}"
            else:
                why = "max_attempts"
                reason = f"gave up after {d['attempts']} attempts; last: {outcome.error}"
            d.update(state=GAVE_UP, reason=reason, next_attempt_ms=None)
            counted = f"gave_up:{why}"
            log.warning("callback %s to %s given up: %s", d["delivery_id"], d["url"], reason)
        else:
            due = now_ms + int(self.backoff_s(d["attempts"], outcome.retry_after_s) * 1000)
            CallbackLedger.schedule(txn, d, due)
            counted = "retried"
            log.info("callback %s attempt %d failed (%s); next at %d", d["delivery_id"], d["attempts"],
                     outcome.error, due)
        txn.put(dk, d)
        return counted

    def _collect(self, wait_s: float | None = None) -> int:
        """Record the outcomes of finished attempts (waiting up to ``wait_s`` for those in flight)."""
        if not self._in_flight:
            return 0
        if wait_s:
            cf.wait(list(self._in_flight.values()), timeout=wait_s)
        done = [(k, f) for k, f in self._in_flight.items() if f.done()]
        if not done:
            return 0
        txn = self.ledger.txn()
        now = self._now_ms()
        counted = []
        for (job_id, rnd), fut in done:
            del self._in_flight[(job_id, rnd)]
            self._tenant_in_flight.pop((job_id, rnd), None)
            try:
                outcome = fut.result()
            except BaseException as exc:  # cancelled at shutdown, or a bug: still pending, tried again
                outcome = Outcome("retry", None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
            counted.append(self._record(txn, job_id, rnd, outcome, now))
        self.ledger.commit(txn)
        for c in counted:  # counted once the ledger holds them
            if c is None:
                continue
            self.attempts += 1
            if c == "delivered":
                self.delivered += 1
                metrics.CALLBACKS_DELIVERED.inc()
            elif c == "retried":
                self.retried += 1
                metrics.CALLBACKS_RETRIED.inc()
            else:
                self.gave_up += 1
                metrics.CALLBACKS_FAILED.labels(c.split(":", 1)[1]).inc()
        return len(done)

    def _dispatch_due(self) -> int:
        """Start due deliveries not in flight, as far as the pool has room: one of each tenant in turn (round
        robin, starting after the tenant served last), a tenant at most ``tenant_concurrency``; returns started."""
        room = self.options.concurrency - len(self._in_flight)
        if room <= 0 or self._closed:
            return 0
        now = self._now_ms()
        cap = self.options.tenant_concurrency
        held: dict[str, int] = {}
        for t in self._tenant_in_flight.values():
            held[t] = held.get(t, 0) + 1
        tenants = self.ledger.due_tenants()
        first = next((i for i, t in enumerate(tenants) if t > self._last_tenant), 0)
        turn = [t for t in tenants[first:] + tenants[:first] if held.get(t, 0) < cap]
        stale: list[Record] = []
        started = 0
        while turn and started < room:
            for tenant in list(turn):
                d = self._next_of(tenant, now, stale)
                if d is None:
                    turn.remove(tenant)
                    continue
                key = (d["job_id"], d["round"])
                self._in_flight[key] = self._pool.submit(self._attempt, d)
                self._tenant_in_flight[key] = tenant
                self._last_tenant = tenant
                held[tenant] = held.get(tenant, 0) + 1
                if held[tenant] >= cap:
                    turn.remove(tenant)
                started += 1
                if started >= room:
                    break
        if stale:
            txn = self.ledger.txn()
            for d in stale:
                CallbackLedger.unschedule(txn, d)
            self.ledger.commit(txn)
        return started

    def _next_of(self, tenant: str, now_ms: int, stale: list[Record]) -> Record | None:
        """A tenant's earliest due delivery that is not in flight; index entries that do not match a pending
        delivery go to ``stale`` (dropped rather than spun on)."""
        for due_ms, job_id, rnd in self.ledger.tenant_due(tenant, now_ms):
            if (job_id, rnd) in self._in_flight or any((s["job_id"], s["round"]) == (job_id, rnd) for s in stale):
                continue
            d = self.ledger.delivery(job_id, rnd)
            if d is None or d["state"] != PENDING or d["next_attempt_ms"] != due_ms or tenant_of(d) != tenant:
                stale.append({"job_id": job_id, "round": rnd, "next_attempt_ms": due_ms, "tenant": tenant,
                              "payload": {}})
                continue
            return d
        return None

    # -- the loop ------------------------------------------------------------------
    def _now_ms(self) -> int:  # a method: tests move this notifier's clock
        return now_ms()

    def _poll_wait_s(self, wait: float) -> float:
        """The reader's wait for this round: ``wait`` at most, until the next due delivery."""
        nxt = self.ledger.next_due_ms()
        if nxt is not None:
            until = (nxt - self._now_ms()) / 1000.0
            if until > 0:
                wait = min(wait, until)
        return max(wait, 0.0)

    def _tick(self) -> None:
        """The delivery side of a round (before each poll and after each batch): record finished
        attempts, start due deliveries."""
        self._collect()
        self._dispatch_due()

    def step(self, timeout_s: float | None = None) -> int:
        """One round: record finished attempts, poll and ingest one batch, start due deliveries; returns records."""
        return self.reader.step(timeout_s)

    def run(self, stop: threading.Event) -> None:
        """Notify until ``stop`` is set; then wait up to ``timeout_s`` (at most 5 s) for the attempts in flight."""
        log.info("callback notifier started (ledger %s)", self.ledger.store.path)
        try:
            self.reader.run(stop)
        finally:
            self._collect(wait_s=min(self.options.timeout_s, 5.0))
            log.info("callback notifier stopped: %d delivered, %d retried, %d given up", self.delivered,
                     self.retried, self.gave_up)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Step until no delivery is due or in flight (tests and one-shot tools); stops at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.step(0.05)
            if not self._in_flight and not self.ledger.due(self._now_ms(), 1):
                return

    def close(self) -> None:
        """Release the consumer, the HTTP threads and the ledger (after ``run`` returned).

        An attempt still in flight is abandoned: it stays pending in the ledger and is sent again by the
        next notifier over this data folder.
        """
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        self.reader.close()
        self.ledger.close()
