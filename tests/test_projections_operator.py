"""Operator read models: tenant usage, queue depths, stuck-task deadlines, failure reasons, rebuild by replay."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import make
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.projections import OperatorModel, ReadModel, ReadModelStore
from dagfold.projections.jobs import apply
from dagfold.projections.operator import QUEUE_STATES, reason_class
from dagfold.services.scheduler.harness import FoldHarness

T0 = 1_700_000_000_000


def task(tid: str, *deps: str, queue: str = "default", timeouts: dict[str, Any] | None = None) -> dict[str, Any]:
    return make("dagfold.common.TaskSpec", task_id=tid, handler="noop", depends_on=list(deps), queue=queue,
                timeouts=make("dagfold.common.Timeouts", **timeouts) if timeouts else None)


def accepted(job_id: str, tasks: list[dict[str, Any]], ts: int = T0, tenant: str = "acme",
             timeouts: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = make("dagfold.common.JobSpec", job_id=job_id, tenant=tenant, tasks=tasks,
                timeouts=make("dagfold.common.Timeouts", **timeouts) if timeouts else None)
    return make("dagfold.event.JobAccepted", job_id=job_id, ts_ms=ts, spec=spec, spec_hash="h-" + job_id)


def ev(name: str, **fields: Any) -> dict[str, Any]:
    return make("dagfold.event." + name, **fields)


class Model:
    """Events applied straight into a store (the projector's batching is tested elsewhere)."""

    def __init__(self, path: Path) -> None:
        self.store = ReadModelStore(path)
        self.rm = ReadModel(self.store)
        self.ops = OperatorModel(self.store)
        self.offset = 0

    def project(self, *events: dict[str, Any]) -> None:
        txn = self.store.txn()
        for e in events:
            apply(txn, e, 0, self.offset)
            self.offset += 1
        self.store.commit(txn)

    def dump(self) -> list[tuple[bytes, bytes]]:
        return list(self.store.scan(b""))


@pytest.fixture
def m(tmp_path: Path) -> Iterator[Model]:
    model = Model(tmp_path / "read")
    yield model
    model.store.close()


def queue_counts(m: Model, tenant: str | None = None) -> dict[str, dict[str, int]]:
    return {q["queue"]: {s: q[s] for s in QUEUE_STATES} for q in m.ops.queues(tenant)}


def test_tenant_usage_and_queue_depths(m: Model) -> None:
    m.project(accepted("j1", [task("a"), task("b", "a", queue="gpu")]),
              accepted("j2", [task("x")], tenant="beta"))
    acme = m.ops.tenant("acme")
    assert acme is not None and acme["tasks"]["pending"] == 2 and acme["jobs"]["running"] == 1
    assert m.ops.open_jobs("beta") == 1 and m.ops.open_jobs("nobody") == 0
    assert m.ops.queues() == []

    m.project(ev("TaskDispatched", job_id="j1", task_id="a", attempt=1, ts_ms=T0 + 1, queue="default"),
              ev("TaskDispatched", job_id="j2", task_id="x", attempt=1, ts_ms=T0 + 2, queue="default"))
    assert queue_counts(m) == {"default": {"runnable": 2, "running": 0, "retrying": 0}}
    assert queue_counts(m, "beta") == {"default": {"runnable": 1, "running": 0, "retrying": 0}}
    assert m.ops.oldest_runnable_ms("default") == T0 + 1

    m.project(ev("LeaseGranted", job_id="j1", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 5,
                 lease_deadline_ms=T0 + 30_005))
    assert queue_counts(m)["default"] == {"runnable": 1, "running": 1, "retrying": 0}
    assert m.ops.oldest_runnable_ms("default") == T0 + 2
    m.project(ev("TaskSucceeded", job_id="j1", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 9),
              ev("TaskDispatched", job_id="j1", task_id="b", attempt=1, ts_ms=T0 + 9, queue="gpu"))
    assert queue_counts(m) == {"default": {"runnable": 1, "running": 0, "retrying": 0},
                               "gpu": {"runnable": 1, "running": 0, "retrying": 0}}
    m.project(ev("TaskCancelled", job_id="j2", task_id="x", attempt=1, ts_ms=T0 + 10, reason="stop"),
              ev("JobCancelled", job_id="j2", ts_ms=T0 + 10, reason="stop"))
    assert "default" not in queue_counts(m)  # an idle queue leaves no key
    assert m.ops.oldest_runnable_ms("default") is None
    beta = m.ops.tenant("beta")
    assert beta is not None and beta["jobs"]["cancelled"] == 1 and beta["jobs"]["running"] == 0
    assert beta["tasks"]["cancelled"] == 1 and beta["tasks"]["runnable"] == 0
    acme = m.ops.tenant("acme")
    assert acme is not None and acme["tasks"] == {"pending": 0, "runnable": 1, "running": 0, "retrying": 0,
                                                  "succeeded": 1, "failed": 0, "skipped": 0, "cancelled": 0}
    totals = m.ops.totals()
    assert totals["tasks"]["succeeded"] == 1 and totals["jobs"]["running"] == 1


def test_stuck_by_deadline(m: Model) -> None:
    m.project(accepted("j", [task("run"), task("queued", timeouts={"schedule_to_start_s": 60}), task("slow"),
                             task("retry"), task("plain")], timeouts={"start_to_close_s": 10}))
    m.project(
        ev("TaskDispatched", job_id="j", task_id="run", attempt=1, ts_ms=T0, queue="default"),
        ev("LeaseGranted", job_id="j", task_id="run", attempt=1, worker_id="w1", ts_ms=T0,
           lease_deadline_ms=T0 + 30_000),
        ev("TaskDispatched", job_id="j", task_id="queued", attempt=1, ts_ms=T0, queue="default"),
        ev("TaskDispatched", job_id="j", task_id="plain", attempt=1, ts_ms=T0, queue="default"),
        ev("TaskDispatched", job_id="j", task_id="retry", attempt=1, ts_ms=T0, queue="default"),
        ev("LeaseGranted", job_id="j", task_id="retry", attempt=1, worker_id="w2", ts_ms=T0,
           lease_deadline_ms=T0 + 30_000),
        ev("TaskFailed", job_id="j", task_id="retry", attempt=1, worker_id="w2", ts_ms=T0 + 1000, reason="boom",
           final=False),
        ev("TaskRetryScheduled", job_id="j", task_id="retry", attempt=1, ts_ms=T0 + 1000, next_attempt=2,
           retry_at_ms=T0 + 3000, reason="boom"),
    )
    task_run = m.rm.get_task("j", "run")
    assert task_run is not None and "_ix" not in task_run and task_run["s2c_ms"] == 10_000
    assert m.ops.stuck(T0, grace_ms=0) == []
    # start-to-close (10 s) comes before the lease (30 s) for "run"; backoff of "retry" at +3 s
    got = m.ops.stuck(T0 + 11_000, grace_ms=0)
    assert [(x["task_id"], x["kind"]) for x in got] == [("retry", "backoff"), ("run", "start_to_close")]
    assert got[1]["worker_id"] == "w1" and got[1]["overdue_s"] == pytest.approx(1.0)
    assert [x["task_id"] for x in m.ops.stuck(T0 + 11_000, grace_ms=5000)] == ["retry"]
    got = m.ops.stuck(T0 + 61_000, grace_ms=0)
    assert [(x["task_id"], x["kind"]) for x in got] == [("retry", "backoff"), ("run", "start_to_close"),
                                                        ("queued", "schedule_to_start")]
    # runnable without a schedule-to-start limit: only with queued_longer_than
    got = m.ops.stuck(T0 + 61_000, grace_ms=0, queued_longer_than_ms=30_000)
    assert {x["task_id"] for x in got} == {"retry", "run", "queued", "plain"}
    assert [x["kind"] for x in got if x["task_id"] == "plain"] == ["queued"]
    assert m.ops.stuck(T0 + 61_000, tenant="beta") == []
    assert len(m.ops.stuck(T0 + 61_000, tenant="acme", grace_ms=0)) == 3
    assert len(m.ops.stuck(T0 + 61_000, grace_ms=0, limit=1)) == 1

    # a heartbeat moves the lease; the task's deadline entry moves with it
    m.project(ev("LeaseExtended", job_id="j", task_id="run", attempt=1, worker_id="w1", ts_ms=T0 + 5000,
                 lease_deadline_ms=T0 + 8000))
    assert [(x["task_id"], x["kind"], x["due_ms"]) for x in m.ops.stuck(T0 + 9000, grace_ms=0)] == [
        ("retry", "backoff", T0 + 3000), ("run", "lease", T0 + 8000)]
    # finished tasks leave the index
    m.project(ev("TaskSucceeded", job_id="j", task_id="run", attempt=1, worker_id="w1", ts_ms=T0 + 9000),
              ev("TaskDispatched", job_id="j", task_id="retry", attempt=2, ts_ms=T0 + 9000, queue="default"))
    assert m.ops.stuck(T0 + 20_000, grace_ms=0) == []


def test_stuck_listing_reads_only_due_keys(m: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 running tasks with future leases and one overdue: the query visits the overdue one only."""
    n = 10_000
    m.project(accepted("big", [task(f"t{i:05d}") for i in range(n)]))
    events = []
    for i in range(n):
        events += [ev("TaskDispatched", job_id="big", task_id=f"t{i:05d}", attempt=1, ts_ms=T0, queue="default"),
                   ev("LeaseGranted", job_id="big", task_id=f"t{i:05d}", attempt=1, worker_id="w", ts_ms=T0,
                      lease_deadline_ms=T0 + (1000 if i == 4242 else 600_000))]
    m.project(*events)
    visited = 0
    real_scan = m.store.scan

    def counting_scan(prefix: bytes, **kw: Any) -> Iterator[tuple[bytes, bytes]]:
        nonlocal visited
        for row in real_scan(prefix, **kw):
            visited += 1
            yield row

    monkeypatch.setattr(m.store, "scan", counting_scan)
    got = m.ops.stuck(T0 + 10_000, grace_ms=0)
    assert [x["task_id"] for x in got] == ["t04242"]
    assert visited <= 2  # the overdue key, then the first future one ends the range


def test_failure_reasons_and_retries(m: Model) -> None:
    m.project(accepted("j", [task("a"), task("b")]), accepted("k", [task("c")], tenant="beta"))
    m.project(
        ev("TaskFailed", job_id="j", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 1,
           reason="lease_expired: no heartbeat from w within the lease", final=False),
        ev("TaskRetryScheduled", job_id="j", task_id="a", attempt=1, ts_ms=T0 + 1, next_attempt=2,
           retry_at_ms=T0 + 2, reason="lease_expired"),
        ev("TaskFailed", job_id="j", task_id="a", attempt=2, worker_id="w", ts_ms=T0 + 5, reason="exit code 3",
           exit_code=3, final=True, stderr_tail="oops"),
        ev("TaskFailed", job_id="j", task_id="b", attempt=1, worker_id="w", ts_ms=T0 + 6, reason="bad value 42",
           error_type="ValueError", final=True),
        ev("TaskFailed", job_id="k", task_id="c", attempt=1, worker_id="w", ts_ms=T0 + 7, reason="exit code 3",
           exit_code=3, final=True),
    )
    reasons = m.ops.failure_reasons()
    assert [(r["class"], r["count"], r["final"], r["retried"]) for r in reasons] == [
        ("exit code 3", 2, 2, 0), ("ValueError", 1, 1, 0), ("lease_expired", 1, 0, 1)]
    assert reasons[0]["last_job_id"] == "k"  # newest of both tenants
    assert [r["class"] for r in m.ops.failure_reasons("beta")] == ["exit code 3"]
    recent = m.ops.recent_failures()
    assert [(x["job_id"], x["task_id"], x["attempt"]) for x in recent] == [("k", "c", 1), ("j", "b", 1),
                                                                         ("j", "a", 2), ("j", "a", 1)]
    assert [x["task_id"] for x in m.ops.recent_failures("acme", limit=2)] == ["b", "a"]
    assert [x["task_id"] for x in m.ops.recent_failures(since_ms=T0 + 6)] == ["c", "b"]
    acme = m.ops.tenant("acme")
    assert acme is not None and acme["failures"] == 3 and acme["lease_expiries"] == 1 and acme["retries"] == 1
    assert acme.get("worker_losses", 0) == 0
    # a lost worker (LeaseReclaimed) is counted apart from the task's own failures
    m.project(accepted("k2", [task("d")], tenant="beta"),
              ev("LeaseReclaimed", job_id="k2", task_id="d", attempt=1, worker_id="w", ts_ms=T0 + 8,
                 reason="lease_expired: no heartbeat from w within the lease", losses=1, final=False))
    beta = m.ops.tenant("beta")
    assert beta is not None
    assert (beta["worker_losses"], beta["lease_expiries"], beta["failures"]) == (1, 1, 1)
    job = m.rm.get_job("j")
    assert job is not None and job["retries"] == 1 and job["spec_hash"] == "h-j"


@pytest.mark.parametrize(("reason", "code", "etype", "cls"), [
    ("lease_expired: no heartbeat from w1 within the lease", None, None, "lease_expired"),
    ("start_to_close_timeout", None, None, "start_to_close_timeout"),
    ("exit code 2", 2, None, "exit code 2"),
    ("division by zero", None, "ZeroDivisionError", "ZeroDivisionError"),
    ("killed by signal 9", -9, None, "exit code -9"),
    ("Connection to 10.0.0.7 port 5432 refused", None, None, "Connection to N.N.N.N port N refused"),
    ("", None, None, "unknown"),
])
def test_reason_class(reason: str, code: int | None, etype: str | None, cls: str) -> None:
    assert reason_class(reason, code, etype) == cls


def test_list_jobs_by_creation_time(m: Model) -> None:
    for i in range(6):
        m.project(accepted(f"j{i}", [task("a")], ts=T0 + i * 1000, tenant="acme" if i % 2 else "beta"))
    ids = lambda page: [j["job_id"] for j in page.items]  # noqa: E731
    assert ids(m.rm.list_jobs(created_after=T0 + 2000)) == ["j5", "j4", "j3", "j2"]
    assert ids(m.rm.list_jobs(created_before=T0 + 2000)) == ["j1", "j0"]
    assert ids(m.rm.list_jobs(created_after=T0 + 1000, created_before=T0 + 4000)) == ["j3", "j2", "j1"]
    assert ids(m.rm.list_jobs(tenant="acme", created_after=T0 + 1500)) == ["j5", "j3"]
    assert ids(m.rm.list_jobs(state="running", created_before=T0 + 1)) == ["j0"]
    page = m.rm.list_jobs(created_after=T0 + 1000, limit=2)
    assert ids(page) == ["j5", "j4"] and page.next_cursor
    page2 = m.rm.list_jobs(created_after=T0 + 1000, limit=2, cursor=page.next_cursor)
    assert ids(page2) == ["j3", "j2"]
    attempts = m.rm.get_job_attempts("j0")
    assert attempts.items == []


def _harness_events(seed: int) -> list[dict[str, Any]]:
    """A realistic event stream from the real fold: retries, failures, lease expiries, cancels, redrives."""
    rnd = random.Random(seed)
    h = FoldHarness()
    for j in range(6):
        tasks = [{"id": f"t{i}", "depends_on": [f"t{k}" for k in range(i) if rnd.random() < 0.3],
                  "queue": rnd.choice(["default", "io"])} for i in range(rnd.randint(3, 12))]
        doc = {"id": f"job{j}", "tenant": rnd.choice(["acme", "beta"]), "tasks": tasks,
               "failure_policy": rnd.choice(["skip_downstream", "fail_fast", "allow_partial"]),
               "retry": {"max_attempts": 3, "initial_interval_s": 0.5}, "timeouts": {"heartbeat_s": 5}}
        h.submit(to_job_spec(parse_spec(doc)))
    for _ in range(400):
        if h.dispatched and rnd.random() < 0.8:
            d = h.dispatched.popleft()
            h.report("Started", d, f"w{rnd.randint(1, 3)}")
            roll = rnd.random()
            if roll < 0.6:
                h.report("Succeeded", d, h.task(d["job_id"], d["task_id"])["worker"] or "w1")  # type: ignore[index]
            elif roll < 0.8:
                h.report("Failed", d, h.task(d["job_id"], d["task_id"])["worker"] or "w1",  # type: ignore[index]
                         reason=f"exit code {rnd.randint(1, 3)}", exit_code=rnd.randint(1, 3))
            # else: the worker vanishes; the lease expires when time advances
        elif rnd.random() < 0.05:
            h.process({"type": "dagfold.command.CancelJob", "job_id": f"job{rnd.randint(0, 5)}",
                       "reason": "test", "requested_at_ms": h.now_ms})
        elif rnd.random() < 0.05:
            h.process({"type": "dagfold.command.RedriveJob", "job_id": f"job{rnd.randint(0, 5)}",
                       "requested_at_ms": h.now_ms})
        else:
            h.advance(rnd.randint(100, 3000))
    return h.events


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rebuild_by_replay_is_identical_and_consistent(tmp_path: Path, seed: int) -> None:
    events = _harness_events(seed)
    assert len(events) > 50
    live = Model(tmp_path / "live")
    rebuilt = Model(tmp_path / "rebuilt")
    try:
        rnd = random.Random(seed)
        i = 0
        while i < len(events):  # live: many small batches, as polled
            n = rnd.randint(1, 7)
            live.project(*events[i:i + n])
            i += n
        rebuilt.project(*events)  # replay: one batch from an empty store
        assert live.dump() == rebuilt.dump()

        # the operator models agree with a full recount of the tasks
        jobs = live.rm.list_jobs(limit=1000).items
        per_tenant: dict[str, dict[str, int]] = {}
        per_queue: dict[str, dict[str, int]] = {}
        deadlines = 0
        for job in jobs:
            counts = per_tenant.setdefault(job["tenant"], {})
            for s, n in job["counts"].items():
                counts[s] = counts.get(s, 0) + n
            for t in live.rm.iter_tasks(job["job_id"]):
                if t["state"] in QUEUE_STATES:
                    q = per_queue.setdefault(t["queue"], dict.fromkeys(QUEUE_STATES, 0))
                    q[t["state"]] += 1
                deadlines += t["_ix"].get("dl") is not None
        for tenant, counts in per_tenant.items():
            usage = live.ops.tenant(tenant)
            assert usage is not None
            assert {s: n for s, n in usage["tasks"].items() if n} == {s: n for s, n in counts.items() if n}
            assert sum(usage["jobs"].values()) == sum(1 for j in jobs if j["tenant"] == tenant)
        assert queue_counts(live) == per_queue
        assert len(live.ops.stuck(2**52, grace_ms=0, limit=1000)) == deadlines
    finally:
        live.store.close()
        rebuilt.store.close()
