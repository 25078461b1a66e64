"""Job-end callbacks: a real HTTP receiver, the embedded log, the real scheduler and notifier.

The receiver (``tests/callback_support.py``) answers by path: 503 a few times
then 200, a fixed status, down until told otherwise, or slow. Nothing of
dagfold is replaced: jobs run through the scheduler and workers of a Stack, or
(for the crash and redrive cases) events are written to the log the notifier
reads, as the scheduler would write them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from dagfold.commands import submit_job
from dagfold.config import Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.log.embedded import EmbeddedLog
from dagfold.services.callbacks import (
    DELIVERED,
    GAVE_UP,
    PENDING,
    CallbackNotifier,
    CallbackOptions,
    classify,
    sign,
    verify,
)
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.worker.handlers import HandlerRegistry
from tests.api_support import wait_until
from tests.callback_support import LOOPBACK, EventLog, Receiver, allow_loopback, pump, pump_for

SHELL_STACK = StackOptions(workers=1, api=False, registry=HandlerRegistry.with_builtins(shell=True))
SECRET = "test-secret-0123456789"
FAST = CallbackOptions(secret=SECRET, timeout_s=5.0, max_attempts=50, base_backoff_s=0.05, max_backoff_s=0.2,
                       egress=LOOPBACK)  # the receivers are on 127.0.0.1: allowed explicitly


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def fast_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Stack's notifier reads DAGFOLD_CALLBACK_*: sign with SECRET, retry within a fraction of a second."""
    monkeypatch.setenv("DAGFOLD_CALLBACK_SECRET", SECRET)
    monkeypatch.setenv("DAGFOLD_CALLBACK_BASE_BACKOFF_S", "0.05")
    monkeypatch.setenv("DAGFOLD_CALLBACK_MAX_BACKOFF_S", "0.2")
    monkeypatch.setenv("DAGFOLD_CALLBACK_TIMEOUT_S", "5")
    allow_loopback(monkeypatch)


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0



def spec(job_id: str, callback_url: str | None, **task: Any) -> dict[str, Any]:
    doc = {"id": job_id, "tenant": "acme", "retry": {"max_attempts": 1},
           "tasks": [{"id": "a", "handler": "noop", **task}]}
    if callback_url is not None:
        doc["callback_url"] = callback_url
    return to_job_spec(parse_spec(doc))


def stack_config(data: Path) -> Config:
    return Config(data_dir=data, partitions=2, dispatch_partitions=2)


def assert_signed(req: Any) -> None:
    assert req.headers["content-type"] == "application/json"
    assert verify(SECRET, req.body, req.headers["x-dagfold-signature"]), "signature does not match the raw body"
    assert req.headers["x-dagfold-signature"] == sign(SECRET, req.body)
    assert abs(int(req.headers["x-dagfold-timestamp"]) - time.time()) < 120


# -- units: signature, answer classes, backoff ------------------------------------------------------
def test_signature_answer_classes_and_backoff(tmp_path: Path) -> None:
    body = b'{"job_id":"j"}'
    assert verify(SECRET, body, sign(SECRET, body))
    assert sign(SECRET, body).startswith("sha256=") and len(sign(SECRET, body)) == 7 + 64
    assert not verify(SECRET, body + b" ", sign(SECRET, body))
    assert not verify("other", body, sign(SECRET, body))
    assert not verify(SECRET, body, None)

    assert classify(200).kind == classify(204).kind == "delivered"
    for status in (408, 429, 500, 502, 503, 301):
        assert classify(status).kind == "retry", status
    for status in (400, 401, 403, 404, 410, 422):
        assert classify(status).kind == "final", status
    assert classify(429, "7").retry_after_s == 7.0

    log = EmbeddedLog(tmp_path / "log")
    n = CallbackNotifier(log, tmp_path, CallbackOptions(secret=SECRET, base_backoff_s=1.0, max_backoff_s=10.0))
    try:
        for attempts, low, high in ((1, 0.5, 1.0), (2, 1.0, 2.0), (4, 4.0, 8.0), (9, 5.0, 10.0), (500, 5.0, 10.0)):
            for _ in range(20):
                assert low <= n.backoff_s(attempts) <= high, attempts
        assert n.backoff_s(1, retry_after_s=6.0) == 6.0
        assert n.backoff_s(1, retry_after_s=3600.0) == 10.0  # Retry-After within max_backoff_s
    finally:
        n.close()
        log.close()


# -- the whole stack: retries, a final 4xx, no URL, a failed job, restart ------------------------
def test_stack_calls_back_once_with_retries_and_not_again_after_restart(
        tmp_path: Path, receiver: Receiver, fast_env: None) -> None:
    data = tmp_path / "data"
    delivered0 = metric("dagfold_callbacks_delivered_total")
    retried0 = metric("dagfold_callbacks_retried_total")
    rejected0 = metric("dagfold_callbacks_failed_total", {"reason": "rejected"})
    jobs = {
        "cb-flaky": spec("cb-flaky", receiver.url("/flaky/2/a")),
        "cb-gone": spec("cb-gone", receiver.url("/status/410/b")),
        "cb-none": spec("cb-none", None),
        "cb-failed": spec("cb-failed", receiver.url("/hook/c"), handler="shell", args={"cmd": "exit 3"}),
    }
    with Stack(stack_config(data), SHELL_STACK) as stack:
        assert stack.notifier is not None
        ledger = stack.notifier.ledger
        for s in jobs.values():
            stack.sender.send(submit_job(s, source="test"))
        for job_id in jobs:
            job = stack.wait_job(job_id, timeout_s=60)
            assert job is not None and job["state"] in ("succeeded", "failed"), job
        for job_id in ("cb-flaky", "cb-gone", "cb-failed"):
            wait_until(lambda j=job_id: (ledger.delivery(j) or {}).get("state") in (DELIVERED, GAVE_UP),
                       what=f"{job_id} delivered or given up")
        assert not stack.failed, stack.errors

        # 503, 503, 200: three attempts of one delivery, each signed, the same idempotency key
        flaky = receiver.of("cb-flaky")
        assert [r.status for r in flaky] == [503, 503, 200]
        bodies = [r.json for r in flaky]
        assert [b["attempt"] for b in bodies] == [1, 2, 3]
        for r in flaky:
            assert_signed(r)
        last = bodies[-1]
        assert {k: last[k] for k in ("job_id", "delivery_id", "state", "reason", "partial", "tenant", "round")} == {
            "job_id": "cb-flaky", "delivery_id": "cb-flaky", "state": "succeeded", "reason": None,
            "partial": False, "tenant": "acme", "round": 0}
        assert last["ended_ms"] == stack.read_model.get_job("cb-flaky")["ended_ms"]
        d = ledger.delivery("cb-flaky")
        assert d is not None and d["state"] == DELIVERED and d["attempts"] == 3 and d["last_status"] == 200

        # 410 is final: one request, given up with the reason
        gone = receiver.of("cb-gone")
        assert [r.status for r in gone] == [410]
        d = ledger.delivery("cb-gone")
        assert d is not None and d["state"] == GAVE_UP and "410" in d["reason"] and d["attempts"] == 1

        # a failed job: its state and reason in the body
        failed = receiver.of("cb-failed")
        assert len(failed) == 1 and failed[0].status == 200
        assert failed[0].json["state"] == "failed" and failed[0].json["reason"]
        assert_signed(failed[0])

        # no callback_url: nothing sent, nothing kept
        assert receiver.of("cb-none") == [] and ledger.job("cb-none") is None
        assert len(receiver.requests) == 5
        assert ledger.pending() == 0

    assert metric("dagfold_callbacks_delivered_total") - delivered0 == 2
    assert metric("dagfold_callbacks_retried_total") - retried0 == 2
    assert metric("dagfold_callbacks_failed_total", {"reason": "rejected"}) - rejected0 == 1

    # restart on the same data folder: nothing is sent again; a new job is called back once
    with Stack(stack_config(data), SHELL_STACK) as stack:
        assert stack.notifier is not None
        stack.sender.send(submit_job(spec("cb-after", receiver.url("/hook/d")), source="test"))
        assert (stack.wait_job("cb-after", timeout_s=60) or {}).get("state") == "succeeded"
        receiver.wait_for("cb-after")
        time.sleep(1.0)  # time for a wrong repeat to show
        assert len(receiver.of("cb-after")) == 1
        assert len(receiver.requests) == 6
        assert stack.notifier.ledger.delivery("cb-flaky")["attempts"] == 3


# -- log level: re-reading events after a crash, redrive rounds, pending across restarts -----------
@pytest.fixture
def events(tmp_path: Path) -> Iterator[EventLog]:
    e = EventLog(tmp_path)
    yield e
    e.close()


def test_redrive_is_a_new_delivery_and_rereading_events_sends_nothing(
        tmp_path: Path, events: EventLog, receiver: Receiver) -> None:
    events.accept("r1", receiver.url("/hook/r1"))
    events.emit("JobFailed", "r1", reason="task 'a' failed: exit code 3")
    events.emit("JobRedriven", "r1", task_ids=["a"])
    events.emit("JobSucceeded", "r1", partial=True)
    events.accept("r2", None)
    events.emit("JobCancelled", "r2", reason="cancelled by user")

    n = CallbackNotifier(events.log, tmp_path, FAST)
    try:
        pump(n, lambda: len(receiver.requests) >= 2 and not n._in_flight, what="two deliveries")
        pump_for(n, 0.5)
    finally:
        n.close()
    first, second = sorted(receiver.requests, key=lambda r: r.delivery)  # sent concurrently: any order
    assert (first.delivery, first.json["state"], first.json["round"]) == ("r1", "failed", 0)
    assert first.json["reason"] == "task 'a' failed: exit code 3"
    assert (second.delivery, second.json["state"], second.json["round"]) == ("r1/redrive/1", "succeeded_partial", 1)
    assert second.json["partial"] is True and second.json["delivery_id"] == "r1/redrive/1"

    # a ledger without its positions (written before the ledger kept them): a new notifier re-reads every event
    events.forget_positions(tmp_path)
    n = CallbackNotifier(events.log, tmp_path, FAST)
    try:
        assert pump_for(n, 1.0) == 6, "every event is read again"
        assert len(receiver.requests) == 2
        status = n.ledger.status("r1")
        assert status is not None and status["state"] == DELIVERED and status["round"] == 1
    finally:
        n.close()


def test_pending_retries_do_not_block_others_and_survive_a_restart(
        tmp_path: Path, events: EventLog, receiver: Receiver) -> None:
    receiver.down.set()
    events.accept("p", receiver.url("/down/p"))
    events.accept("s", receiver.url("/slow/s"))
    events.accept("q", receiver.url("/hook/q"))
    events.emit("JobSucceeded", "p")
    events.emit("JobSucceeded", "s")

    n = CallbackNotifier(events.log, tmp_path, FAST)
    try:
        pump(n, lambda: len(receiver.of("p")) >= 3 and receiver.of("s"), what="p retried, s in flight")
        events.emit("JobFailed", "q", reason="boom")  # ends while p retries and s hangs
        pump(n, lambda: (n.ledger.delivery("q") or {}).get("state") == DELIVERED, timeout_s=5, what="q delivered")
        assert [r.status for r in receiver.of("s")] == [None], "s is still being answered"
        assert n.ledger.delivery("p")["state"] == PENDING and n.ledger.delivery("p")["attempts"] >= 2
    finally:
        n.close()  # s in flight is abandoned: still pending in the ledger

    receiver.down.clear()
    receiver.release.set()
    n = CallbackNotifier(events.log, tmp_path, FAST)
    try:
        pump(n, lambda: all((n.ledger.delivery(j) or {}).get("state") == DELIVERED for j in "ps"),
             what="p and s delivered after the restart")
        pump_for(n, 0.5)
    finally:
        n.close()
    assert [r.status for r in receiver.of("p")][-1] == 200
    assert [r.status for r in receiver.of("p")].count(200) == 1
    assert len(receiver.of("s")) == 2  # the abandoned attempt and its resend: one idempotency key
    assert {json.loads(r.body)["delivery_id"] for r in receiver.of("s")} == {"s"}
    assert len(receiver.of("q")) == 1
