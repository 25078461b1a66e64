"""Submitting jobs and following them: over the REST API, or straight to Kafka.

Both clients have the same four calls: ``submit(job) -> Submission``, ``status(job_id) ->
JobStatus``, ``wait(job_id) -> JobStatus`` and ``close()``; the REST client also acts on jobs
(``cancel``, ``redrive``, ``retry_task``, ``mark_task_succeeded``). Submissions are idempotent: a
``Job`` carries its ID from construction (or from its idempotency key), so retrying a
``submit`` (both clients retry transient failures themselves) never makes a second job.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from dagfold.client.spec import Job
from dagfold.codec import default_codec, make
from dagfold.commands import CommandSender, now_ms
from dagfold.config import EVENTS, Config, Limits
from dagfold.exceptions import CodecError, DagfoldError
from dagfold.jobspec import SpecError, SpecRejected
from dagfold.lifecycle import JOB_ENDING_EVENTS, JOB_FINAL, job_state_after
from dagfold.log import TopicPartition, open_log
from dagfold.rules import path_segment
from dagfold.tracing import TRACEPARENT, clean_traceparent, current_traceparent, job_trace_id


class ClientError(DagfoldError):
    """A refused or failed call: ``status`` (HTTP status, or None), ``code`` and ``reason`` as the API says."""

    def __init__(self, status: int | None, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.status, self.code, self.reason = status, code, reason


class JobNotFound(ClientError):
    pass


class WaitTimeout(ClientError):
    pass


@dataclass(frozen=True)
class Submission:
    job_id: str
    created: bool | None  # False: the same job was submitted before; None: not known (sent to Kafka)
    trace_id: str | None = None  # the job's trace (dagfold.tracing): the submitter's, or derived from the job ID


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: str  # pending, running, succeeded, succeeded_partial, failed, cancelled, rejected (Kafka: + accepted)
    tenant: str | None = None
    reason: str | None = None
    counts: Mapping[str, int] = field(default_factory=dict)  # tasks by state (REST only)
    details: Mapping[str, Any] = field(default_factory=dict)  # the API's whole answer, or the last event

    @property
    def done(self) -> bool:
        return self.state in JOB_FINAL


class Client(Protocol):
    def submit(self, job: Job, traceparent: str | None = None) -> Submission: ...

    def status(self, job_id: str) -> JobStatus: ...

    def wait(self, job_id: str, timeout_s: float = 600.0) -> JobStatus: ...

    def close(self) -> None: ...


def _checked_record(job: Job, limits: Limits | None = None) -> dict[str, Any]:
    try:
        return job.to_record(limits)
    except SpecRejected as exc:
        raise ClientError(None, exc.rejection.code, exc.rejection.reason) from None
    except SpecError as exc:
        raise ClientError(None, "invalid_spec", str(exc)) from None


# -- REST --------------------------------------------------------------------------------

_RETRY_STATUS = frozenset({429, 502, 503, 504})


class RestClient:
    """The REST API (``dagfold up`` / ``dagfold api``): submit, status from the read model, wait by polling.

    ``api_key`` goes in ``Authorization: Bearer``; the key's tenant owns the jobs. Connection
    errors, 429 (after its Retry-After) and 502-504 are retried ``retries`` times.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 30.0,
                 retries: int = 5, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                  transport=transport)
        self.retries = retries

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One call (``path`` under the base URL; ``kw`` as ``httpx.Client.request`` takes it): the answer
        whatever its status, after the retries of transient failures. ``ClientError`` ``unreachable`` (its
        cause: the transport error) when no answer came."""
        delay = 0.2
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                if last:
                    raise ClientError(None, "unreachable", f"{self._http.base_url}: {exc}") from exc
            else:
                if r.status_code not in _RETRY_STATUS or last:
                    return r
                after = r.headers.get("retry-after", "")
                if after.isdigit():
                    delay = max(delay, float(after))
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    @staticmethod
    def _error(r: httpx.Response) -> ClientError:
        try:
            e = r.json()["error"]
            code, reason = str(e["code"]), str(e["reason"])
        except Exception:
            code, reason = "http_error", r.text[:500]
        cls = JobNotFound if r.status_code == 404 else ClientError
        return cls(r.status_code, code, reason)

    def submit(self, job: Job, traceparent: str | None = None) -> Submission:
        """Submit ``job``; its trace continues ``traceparent`` (W3C), by default the caller's current
        OpenTelemetry span when the caller uses OpenTelemetry."""
        _checked_record(job)  # a malformed spec fails here, before any request
        tp = current_traceparent() if traceparent is None else traceparent
        r = self.request("POST", "/v1/jobs", json=job.to_dict(), headers={TRACEPARENT: tp} if tp else None)
        if r.status_code not in (200, 202):
            raise self._error(r)
        body = r.json()
        return Submission(str(body["job_id"]), created=r.status_code == 202, trace_id=body.get("trace_id"))

    def status(self, job_id: str) -> JobStatus:
        r = self.request("GET", f"/v1/jobs/{path_segment(job_id)}")
        if r.status_code != 200:
            raise self._error(r)
        j = r.json()
        return JobStatus(j["job_id"], j["state"], j.get("tenant"), j.get("reason"), dict(j.get("counts") or {}), j)

    def wait(self, job_id: str, timeout_s: float = 600.0, poll_s: float = 0.5) -> JobStatus:
        """Poll until the job ended; a job not projected yet (just submitted) is waited for too."""
        deadline = time.monotonic() + timeout_s
        last: JobStatus | None = None
        while True:
            try:
                last = self.status(job_id)
                if last.done:
                    return last
            except JobNotFound:
                pass
            if time.monotonic() >= deadline:
                state = last.state if last else "unknown"
                raise WaitTimeout(None, "timeout", f"job {job_id} still {state} after {timeout_s}s")
            time.sleep(poll_s)

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> None:
        self._post(f"/v1/jobs/{path_segment(job_id)}/cancel", {"reason": reason})

    def retry_task(self, job_id: str, task_id: str, reason: str = "") -> None:
        """Run a failed, skipped or cancelled task again with a fresh retry budget (and its skipped
        downstream); the job's history records ``reason``."""
        self._post(f"/v1/jobs/{path_segment(job_id)}/tasks/{path_segment(task_id)}/retry", {"reason": reason})

    def mark_task_succeeded(self, job_id: str, task_id: str, reason: str = "") -> None:
        """Record a failed, skipped or cancelled task as succeeded without running it."""
        self._post(f"/v1/jobs/{path_segment(job_id)}/tasks/{path_segment(task_id)}/mark-succeeded",
                   {"reason": reason})

    def pause(self, job_id: str, reason: str = "") -> None:
        """Pause a running job: nothing new is dispatched (nor GPUs requested), running tasks finish."""
        self._post(f"/v1/jobs/{path_segment(job_id)}/pause", {"reason": reason})

    def resume(self, job_id: str, reason: str = "") -> None:
        """Resume a paused job: what became runnable while it was paused is dispatched."""
        self._post(f"/v1/jobs/{path_segment(job_id)}/resume", {"reason": reason})

    def redrive(self, job_id: str) -> None:
        """Re-run a finished job's failed, skipped and cancelled tasks."""
        self._post(f"/v1/jobs/{path_segment(job_id)}/redrive", None)

    def _post(self, path: str, body: dict[str, Any] | None) -> None:
        """An accepted (202) action, else ``ClientError`` with the API's code (``JobNotFound`` for 404)."""
        r = self.request("POST", path, json=body) if body is not None else self.request("POST", path)
        if r.status_code >= 400:
            raise self._error(r)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- Kafka -------------------------------------------------------------------------------

_ACCEPTED = "dagfold.event.JobAccepted"
_STATUS_EVENTS = JOB_ENDING_EVENTS | {_ACCEPTED, "dagfold.event.JobRejected"}
"""The events whose job state ``KafkaClient`` reports (``dagfold.lifecycle``): ``accepted`` (the read model
would say running), then how the job ended or that it was rejected."""


class KafkaClient:
    """Straight to the commands topic, for producers that must not depend on the API being up.

    ``submit`` checks the spec as the scheduler will (shape, graph, limits) and writes a
    SubmitJob keyed by job ID (durable when it returns). ``status`` and ``wait`` read the job's
    partition of the events topic: ``wait`` after this client's ``submit`` starts at the end
    offset taken before sending (cost: that partition's events since); for another job they
    read the partition from its start, a scan meant for audits; prefer the REST client then.
    Topic prefix and partitioner come from the URL (``?prefix=``) or ``topic_prefix``.
    """

    def __init__(self, log_url: str, *, topic_prefix: str = "", config: Config | None = None) -> None:
        if not log_url.startswith("kafka://"):
            raise ClientError(None, "bad_url", f"KafkaClient needs a kafka:// URL, not {log_url!r}; "
                              "the embedded log belongs to one process: use RestClient")
        self.config = config or Config(log_url=log_url, topic_prefix=topic_prefix)
        self.log = open_log(log_url, Path("."), prefix=topic_prefix)
        self._sender = CommandSender(self.log, "dagfold-client")
        self._start: dict[str, int] = {}  # job ID -> events offset before its submission

    def _tp(self, job_id: str) -> TopicPartition:
        return TopicPartition(EVENTS, self.log.partition_for(job_id.encode(), self.log.partitions(EVENTS)))

    def submit(self, job: Job, traceparent: str | None = None) -> Submission:
        """Write SubmitJob; ``traceparent`` as in ``RestClient.submit``."""
        spec = _checked_record(job, self.config.scheduler.limits)  # as the scheduler will check it
        tp = self._tp(spec["job_id"])
        self._start.setdefault(spec["job_id"], self.log.end_offsets([tp])[tp])
        parent = clean_traceparent(current_traceparent() if traceparent is None else traceparent)
        try:
            self._sender.send(make("dagfold.command.SubmitJob", spec=spec, submitted_at_ms=now_ms(), source="sdk",
                                   traceparent=parent))
        except DagfoldError as exc:
            raise ClientError(None, "not_sent", str(exc)) from None
        return Submission(spec["job_id"], created=None, trace_id=job_trace_id(spec["job_id"], parent))

    def _read(self, job_id: str, until_done: bool, timeout_s: float) -> JobStatus | None:
        tp = self._tp(job_id)
        codec = default_codec()
        consumer = self.log.consumer(None, client_id="dagfold-client-status")
        status: JobStatus | None = None
        try:
            consumer.assign({tp: self._start.get(job_id, 0)})
            end = self.log.end_offsets([tp])[tp]
            deadline = time.monotonic() + timeout_s
            while True:
                for rec in consumer.poll(500, 0.2):
                    if rec.key != job_id.encode():
                        continue
                    try:
                        ev = codec.decode(rec.value)
                    except CodecError:
                        continue
                    if ev["type"] not in _STATUS_EVENTS:
                        continue
                    state = "accepted" if ev["type"] == _ACCEPTED else str(job_state_after(ev))
                    tenant = ev.get("tenant") or (ev["spec"]["tenant"] if "spec" in ev else None)
                    status = JobStatus(job_id, state, tenant or (status.tenant if status else None),
                                       ev.get("reason"), {}, {k: v for k, v in ev.items() if k != "spec"})
                    if until_done and status.done:
                        return status
                if not until_done and consumer.position(tp) >= end:
                    return status
                if time.monotonic() >= deadline:
                    if until_done:
                        state = status.state if status else "not accepted"
                        raise WaitTimeout(None, "timeout", f"job {job_id} still {state} after {timeout_s}s")
                    return status
        finally:
            consumer.close()

    def status(self, job_id: str) -> JobStatus:
        st = self._read(job_id, until_done=False, timeout_s=30.0)
        if st is None:
            raise JobNotFound(404, "not_found", f"no job {job_id!r} on {self.log.url}")
        return st

    def wait(self, job_id: str, timeout_s: float = 600.0) -> JobStatus:
        st = self._read(job_id, until_done=True, timeout_s=timeout_s)
        assert st is not None  # _read waits until a terminal event or raises
        return st

    def close(self) -> None:
        self._sender.close()
        self.log.close()

    def __enter__(self) -> KafkaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
