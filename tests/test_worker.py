"""The worker on the embedded log: dispatch in, commands (and dead letters) out."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from dagfold import codec
from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS, CONTROL, DEADLETTER, Config, dispatch_topic, worker_group
from dagfold.exceptions import LogError
from dagfold.log.base import Ack, Log, QueuedRecord, TopicPartition
from dagfold.log.embedded import EmbeddedLog
from dagfold.services.worker.exceptions import NonRetryableError
from dagfold.services.worker.handlers import HandlerRegistry, TaskContext
from dagfold.services.worker.worker import Worker, WorkerCrashed
from tests.api_support import wait_until

CFG = Config(partitions=2, dispatch_partitions=2)
QUEUE = "q"
STARTED = "dagfold.command.TaskStarted"
HEARTBEAT = "dagfold.command.TaskHeartbeat"
SUCCEEDED = "dagfold.command.TaskSucceeded"
FAILED = "dagfold.command.TaskFailed"
RELEASED = "dagfold.command.TaskReleased"


# -- fixtures and helpers ---------------------------------------------------------------


@pytest.fixture
def elog(tmp_path: Path) -> Iterator[EmbeddedLog]:
    lg = EmbeddedLog(tmp_path / "log")
    lg.create_topics(CFG.core_topics())
    yield lg
    lg.close()


WorkerFactory = Callable[..., tuple[Worker, threading.Event, threading.Thread]]


@pytest.fixture
def start(elog: EmbeddedLog) -> Iterator[WorkerFactory]:
    """``start(registry=None, worker_id="w1", log=elog, **worker_kwargs)``: a worker running in a thread."""
    running: list[tuple[Worker, threading.Event, threading.Thread]] = []

    def _start(registry: HandlerRegistry | None = None, worker_id: str = "w1", log: Any = None,
               **kw: Any) -> tuple[Worker, threading.Event, threading.Thread]:
        kw.setdefault("poll_timeout_s", 0.05)
        kw.setdefault("shutdown_grace_s", 0.2)
        reg = registry or HandlerRegistry.with_builtins(shell=True)
        w = Worker(cast(Log, log or elog), QUEUE, worker_id, reg, config=CFG, **kw)
        stop = threading.Event()
        t = w.start_thread(stop)
        running.append((w, stop, t))
        return w, stop, t

    yield _start
    for _, stop, _ in running:
        stop.set()
    for w, _, t in running:
        t.join(10)
        assert not t.is_alive()
        w.close()


def dispatch(log: EmbeddedLog, job_id: str, task_id: str = "t1", handler: str = "noop", *,
             args: Mapping[str, Any] | None = None, attempt: int = 1, lease_timeout_s: float = 30.0,
             start_to_close_s: float | None = None, args_json: str | None = None) -> None:
    rec = codec.make("dagfold.dispatch.TaskDispatch", job_id=job_id, task_id=task_id, attempt=attempt,
                     handler=handler, args_json=args_json if args_json is not None else json.dumps(args or {}),
                     idempotency_key=f"{job_id}/{task_id}", lease_timeout_s=lease_timeout_s,
                     start_to_close_s=start_to_close_s, dispatched_at_ms=int(time.time() * 1000))
    send_raw(log, dispatch_topic(QUEUE), job_id.encode(), default_codec().encode(rec))


def send_raw(log: EmbeddedLog, topic: str, key: bytes, value: bytes) -> None:
    if topic == dispatch_topic(QUEUE):
        log.create_topics([CFG.dispatch_spec(QUEUE)])
    p = log.producer("test")
    p.send(topic, key, value)
    p.flush()


def read_all(log: EmbeddedLog, topic: str) -> list[Record]:
    out: list[Record] = []
    for p in range(log.partitions(topic)):
        out.extend(default_codec().decode(r.value) for r in log.read(TopicPartition(topic, p), 0, 10**9))
    return out


def commands(log: EmbeddedLog, job_id: str | None = None, type_: str | None = None) -> list[Record]:
    return [r for r in read_all(log, COMMANDS)
            if (job_id is None or r["job_id"] == job_id) and (type_ is None or r["type"] == type_)]


def wait_for(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    return wait_until(pred, what, timeout, interval_s=0.01)


def outcome(log: EmbeddedLog, job_id: str, timeout: float = 5.0) -> Record:
    recs = wait_for(lambda: [r for r in commands(log, job_id) if r["type"] in (SUCCEEDED, FAILED)],
                    timeout, f"outcome of {job_id}")
    assert len(recs) == 1, recs
    return recs[0]  # type: ignore[no-any-return]


def committed(log: EmbeddedLog) -> dict[TopicPartition, int]:
    """Per dispatch partition, how many records the workers' queue group is done with (accepted or
    rejected): they are never handed out again."""
    topic = dispatch_topic(QUEUE)
    group = log._queues.get(worker_group(QUEUE))
    out = {}
    for p in range(log.partitions(topic)):
        q = group.queues.get(TopicPartition(topic, p)) if group is not None else None
        out[TopicPartition(topic, p)] = q.start + len(q.done) if q is not None else 0
    return out


# -- reports --------------------------------------------------------------------------------


def test_noop_reports_once(elog: EmbeddedLog, start: WorkerFactory) -> None:
    """An instant task's outcome is its one report (the scheduler starts and ends the attempt on it)."""
    w, _, _ = start(worker_id="worker-7")
    dispatch(elog, "job-a", "extract", attempt=3)
    out = outcome(elog, "job-a")
    recs = commands(elog, "job-a")
    assert [r["type"] for r in recs] == [SUCCEEDED]
    for r in recs:
        assert (r["job_id"], r["task_id"], r["attempt"], r["worker_id"]) == ("job-a", "extract", 3, "worker-7")
        assert abs(r["ts_ms"] - time.time() * 1000) < 60_000
    assert out["result_json"] is None
    wait_for(lambda: w.tasks_succeeded == 1 and w.tasks_run == 1)


def test_result_json(elog: EmbeddedLog, start: WorkerFactory) -> None:
    reg = HandlerRegistry()
    reg.register("answer", lambda c: {"answer": c.args["x"] * 2})
    reg.register("bad", lambda c: object())
    reg.register("huge", lambda c: "x" * 100_000)
    start(reg)
    dispatch(elog, "job-r", handler="answer", args={"x": 21})
    dispatch(elog, "job-b", handler="bad")
    dispatch(elog, "job-h", handler="huge")
    assert json.loads(outcome(elog, "job-r")["result_json"]) == {"answer": 42}
    bad = outcome(elog, "job-b")
    assert bad["type"] == FAILED and not bad["retryable"] and "JSON" in bad["reason"]
    huge = outcome(elog, "job-h")
    assert huge["type"] == FAILED and not huge["retryable"] and "limit" in huge["reason"]


def test_shell_exit_code_and_stderr_tail(elog: EmbeddedLog, start: WorkerFactory) -> None:
    start()
    dispatch(elog, "job-s", handler="shell", args={"cmd": "echo out; echo 'it broke' >&2; exit 3"})
    out = outcome(elog, "job-s")
    assert out["type"] == FAILED
    assert out["exit_code"] == 3
    assert out["reason"] == "exit code 3"
    assert out["retryable"] is True
    assert out["error_type"] is None
    assert out["stderr_tail"] == "it broke\n"
    assert out["stdout_tail"] == "out\n"
    assert [r["type"] for r in commands(elog, "job-s")] == [STARTED, FAILED]


def test_shell_env_vars(elog: EmbeddedLog, start: WorkerFactory) -> None:
    start()
    cmd = 'echo "$DAGFOLD_JOB_ID|$DAGFOLD_TASK_ID|$DAGFOLD_ATTEMPT|$DAGFOLD_IDEMPOTENCY_KEY"'
    dispatch(elog, "job-e", "t-env", handler="shell", args={"cmd": cmd}, attempt=2)
    out = outcome(elog, "job-e")
    assert out["type"] == SUCCEEDED
    assert out["stdout_tail"] == "job-e|t-env|2|job-e/t-env\n"


def test_python_errors(elog: EmbeddedLog, start: WorkerFactory) -> None:
    reg = HandlerRegistry()

    @reg.handler("permanent")
    def permanent(c: TaskContext) -> None:
        raise NonRetryableError("bad input file")

    @reg.handler("transient")
    def transient(c: TaskContext) -> None:
        raise ValueError("service unavailable")

    start(reg)
    dispatch(elog, "job-p", handler="permanent")
    dispatch(elog, "job-t", handler="transient")
    p = outcome(elog, "job-p")
    assert (p["type"], p["reason"], p["retryable"], p["error_type"]) == (
        FAILED, "bad input file", False, "NonRetryableError")
    t = outcome(elog, "job-t")
    assert (t["type"], t["reason"], t["retryable"], t["error_type"], t["exit_code"]) == (
        FAILED, "service unavailable", True, "ValueError", None)


def test_unknown_handler_and_bad_args(elog: EmbeddedLog, start: WorkerFactory) -> None:
    start()
    dispatch(elog, "job-u", handler="frobnicate")
    dispatch(elog, "job-j", handler="noop", args_json="{not json")
    dispatch(elog, "job-l", handler="noop", args_json="[1, 2]")
    u = outcome(elog, "job-u")
    assert (u["type"], u["reason"], u["retryable"]) == (FAILED, "unknown handler 'frobnicate'", False)
    assert [r["type"] for r in commands(elog, "job-u")] == [FAILED]
    for job in ("job-j", "job-l"):
        r = outcome(elog, job)
        assert r["type"] == FAILED and not r["retryable"] and r["reason"].startswith("invalid args_json")


# -- long tasks: lease, heartbeats, stop, timeouts -----------------------------------------------


def test_started_is_flushed_before_a_long_handler_runs(elog: EmbeddedLog, start: WorkerFactory) -> None:
    seen: list[list[str]] = []
    reg = HandlerRegistry()
    reg.register("look", lambda c: seen.append([r["type"] for r in commands(elog, c.job_id)]))
    start(reg)
    dispatch(elog, "job-f", handler="look")
    outcome(elog, "job-f")
    assert seen == [[STARTED]]


def test_heartbeats_while_running(elog: EmbeddedLog, start: WorkerFactory) -> None:
    reg = HandlerRegistry.with_builtins()

    @reg.handler("progress")
    def progress(c: TaskContext) -> None:
        for i in range(1, 4):
            c.heartbeat(i / 4, f"step {i}")
            time.sleep(0.25)

    w, _, _ = start(reg)
    dispatch(elog, "job-h", handler="sleep", args={"seconds": 1.0}, lease_timeout_s=0.6, attempt=2)
    assert outcome(elog, "job-h")["type"] == SUCCEEDED
    types = [r["type"] for r in commands(elog, "job-h")]
    assert types[0] == STARTED and types[-1] == SUCCEEDED
    beats = commands(elog, "job-h", HEARTBEAT)
    assert 3 <= len(beats) <= 7, types  # every 0.2 s for 1 s
    assert all(b["attempt"] == 2 and b["worker_id"] == "w1" for b in beats)
    assert set(types[1:-1]) == {HEARTBEAT}

    dispatch(elog, "job-p", handler="progress", lease_timeout_s=30)
    outcome(elog, "job-p")
    beats = commands(elog, "job-p", HEARTBEAT)
    assert [(b["progress"], b["message"]) for b in beats] == [(0.25, "step 1"), (0.5, "step 2"), (0.75, "step 3")]
    assert w.heartbeats_sent >= 6


def test_stop_task_stops_running_sleep_and_shell(elog: EmbeddedLog, start: WorkerFactory,
                                                 tmp_path: Path) -> None:
    w, _, _ = start(worker_id="w-stop")
    pidfile = tmp_path / "pid"

    def stop_when_started(job: str, worker_id: str = "w-stop") -> float:
        wait_for(lambda: commands(elog, job, STARTED), what=f"{job} started")
        time.sleep(0.1)
        rec = codec.make("dagfold.control.StopTask", worker_id=worker_id, job_id=job, task_id="t1", attempt=1,
                         reason="job_cancelled", ts_ms=int(time.time() * 1000))
        send_raw(elog, CONTROL, worker_id.encode(), default_codec().encode(rec))
        return time.monotonic()

    # A StopTask for another worker or attempt changes nothing.
    dispatch(elog, "job-other", handler="sleep", args={"seconds": 0.5})
    stop_when_started("job-other", worker_id="someone-else")
    assert outcome(elog, "job-other")["type"] == SUCCEEDED

    dispatch(elog, "job-sl", handler="sleep", args={"seconds": 30})
    t0 = stop_when_started("job-sl")
    wait_for(lambda: w.tasks_stopped == 1, what="sleep stopped")
    assert time.monotonic() - t0 < 2

    dispatch(elog, "job-sh", handler="shell", args={"cmd": f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; "
                                                           "sleep 30"})
    wait_for(pidfile.exists, what="the shell running")  # its reaper starts first
    t0 = stop_when_started("job-sh")
    wait_for(lambda: w.tasks_stopped == 2, what="shell stopped")
    assert time.monotonic() - t0 < 3

    # The worker goes on; nothing but Started (and maybe heartbeats) was reported for stopped attempts.
    dispatch(elog, "job-next")
    assert outcome(elog, "job-next")["type"] == SUCCEEDED
    for job in ("job-sl", "job-sh"):
        assert {r["type"] for r in commands(elog, job)} <= {STARTED, HEARTBEAT}
    pid = int(pidfile.read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_stop_before_start_skips_the_attempt(elog: EmbeddedLog, start: WorkerFactory) -> None:
    w, _, _ = start()
    assert w.stop_task("job-x", "t1", 1, "lease_rejected") is False
    dispatch(elog, "job-x")
    dispatch(elog, "job-y")
    outcome(elog, "job-y")
    wait_for(lambda: w.tasks_skipped == 1)
    assert commands(elog, "job-x") == []


def test_start_to_close_timeout(elog: EmbeddedLog, start: WorkerFactory) -> None:
    reg = HandlerRegistry.with_builtins(shell=True)

    @reg.handler("stubborn")
    def stubborn(c: TaskContext) -> str:
        c.cancelled.wait(10)  # notices cancellation but returns normally
        return "finished anyway"

    start(reg)
    dispatch(elog, "job-sh", handler="shell", args={"cmd": "echo begun; sleep 30"}, start_to_close_s=0.3)
    dispatch(elog, "job-py", handler="stubborn", start_to_close_s=0.3)
    sh = outcome(elog, "job-sh")
    assert (sh["type"], sh["reason"], sh["retryable"]) == (FAILED, "start_to_close_timeout", True)
    assert sh["stdout_tail"] == "begun\n"
    py = outcome(elog, "job-py")
    assert (py["type"], py["reason"]) == (FAILED, "start_to_close_timeout")


def test_shutdown_gives_the_running_task_back_after_grace(elog: EmbeddedLog, start: WorkerFactory) -> None:
    """A drained worker is no failure of the task: it reports TaskReleased, not TaskFailed (which spent
    the task's retry budget and, with the default policy, failed it for good)."""
    w, stop, t = start(shutdown_grace_s=0.2)
    dispatch(elog, "job-long", handler="sleep", args={"seconds": 30})
    wait_for(lambda: commands(elog, "job-long", STARTED))
    stop.set()
    t.join(5)
    assert not t.is_alive()
    recs = wait_for(lambda: commands(elog, "job-long", RELEASED), what="TaskReleased")
    assert [(r["reason"], r["worker_id"], r["attempt"]) for r in recs] == [("worker_shutdown", "w1", 1)]
    assert not commands(elog, "job-long", FAILED) and not commands(elog, "job-long", SUCCEEDED)
    assert w.tasks_given_back == 1
    assert sum(committed(elog).values()) == 1


# -- dead letters, offsets, topics ---------------------------------------------------------------


def test_undecodable_record_goes_to_deadletter(elog: EmbeddedLog, start: WorkerFactory) -> None:
    w, _, _ = start()
    send_raw(elog, dispatch_topic(QUEUE), b"job-z", b"garbage, not avro")
    started = codec.make(STARTED, job_id="job-z", task_id="t", attempt=1, worker_id="x", ts_ms=1)
    send_raw(elog, dispatch_topic(QUEUE), b"job-z", default_codec().encode(started))
    dispatch(elog, "job-z")
    assert outcome(elog, "job-z")["type"] == SUCCEEDED
    dls = wait_for(lambda: len(read_all(elog, DEADLETTER)) == 2 and read_all(elog, DEADLETTER))
    assert dls[0]["source_topic"] == dispatch_topic(QUEUE)
    assert dls[0]["key"] == b"job-z" and dls[0]["value"] == b"garbage, not avro"
    assert "magic" in dls[0]["reason"]
    assert dls[0]["service"] == "worker"
    assert dls[1]["offset"] == dls[0]["offset"] + 1 and STARTED in dls[1]["reason"]
    assert w.dead_lettered == 2
    assert [r["type"] for r in commands(elog, "job-z")] == [SUCCEEDED]


class _CheckingLog:
    """Wraps the log: checks, when the worker accepts a dispatch record, that its TaskStarted (or, for an
    instant task, its outcome) is durable (from then on the attempt's lease, not the record, stands for it)."""

    def __init__(self, log: EmbeddedLog, fail_flushes: int = 0) -> None:
        self._log = log
        self.accepted = 0
        self.released = 0
        self.flushes = 0
        self.fail_flushes = fail_flushes
        self.violations: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    def producer(self, client_id: str) -> Any:
        inner = self._log.producer(client_id)
        outer = self

        class P:
            def send(self, *a: Any, **k: Any) -> None:
                inner.send(*a, **k)

            def flush(self, timeout_s: float = 30.0) -> None:
                outer.flushes += 1
                if outer.fail_flushes > 0:
                    outer.fail_flushes -= 1
                    inner._buf.clear()  # the buffered records are lost
                    raise LogError("broker unavailable")
                inner.flush(timeout_s)

            def close(self) -> None:
                inner.close()

        return P()

    def queue_consumer(self, group_id: str, client_id: str = "dagfold", **kw: Any) -> Any:
        inner = self._log.queue_consumer(group_id, client_id, **kw)
        outer = self
        orig_ack, orig_commit = inner.acknowledge, inner.commit
        accepted: list[QueuedRecord] = []

        def acknowledge(rec: QueuedRecord, ack: Ack = Ack.ACCEPT) -> None:
            if ack is Ack.ACCEPT:
                accepted.append(rec)
                outer.accepted += 1
            elif ack is Ack.RELEASE:
                outer.released += 1
            orig_ack(rec, ack)

        def commit(wait: bool = True) -> None:
            started = {(r["job_id"], r["task_id"], r["attempt"]) for r in commands(outer._log)
                       if r["type"] in (STARTED, SUCCEEDED, FAILED)}
            for rec in accepted:
                d = default_codec().decode(rec.value)
                if (d["job_id"], d["task_id"], d["attempt"]) not in started:
                    outer.violations.append(f"{rec.partition}@{rec.offset} accepted before its TaskStarted")
            accepted.clear()
            orig_commit(wait)

        inner.acknowledge = acknowledge  # type: ignore[method-assign]
        inner.commit = commit  # type: ignore[method-assign]
        return inner


def test_records_accepted_after_their_start_and_not_rerun(elog: EmbeddedLog, start: WorkerFactory) -> None:
    wrapped = _CheckingLog(elog)
    w, stop, t = start(log=wrapped)
    for i in range(20):
        dispatch(elog, f"job-{i}", handler="noop" if i % 5 else "sleep", args={"seconds": 0.01})
    wait_for(lambda: len(commands(elog, type_=SUCCEEDED)) == 20)
    stop.set()
    t.join(5)
    w.close()
    assert wrapped.accepted == 20 and not wrapped.violations
    assert sum(committed(elog).values()) == 20

    # A new worker in the same queue group gets only what is new.
    w2, _, _ = start(worker_id="w2")
    dispatch(elog, "job-new")
    outcome(elog, "job-new")
    reported = commands(elog, type_=SUCCEEDED)  # every task's outcome, once (noop: its one report)
    assert len(reported) == 21 and len(commands(elog, type_=STARTED)) == 4  # the sleeps reported their start
    assert [r["job_id"] for r in reported if r["worker_id"] == "w2"] == ["job-new"]


def test_failed_flush_redelivers_the_batch(elog: EmbeddedLog, start: WorkerFactory) -> None:
    wrapped = _CheckingLog(elog, fail_flushes=1)
    dispatch(elog, "job-1")
    dispatch(elog, "job-2")
    start(log=wrapped)
    assert outcome(elog, "job-1")["type"] == SUCCEEDED
    assert outcome(elog, "job-2")["type"] == SUCCEEDED
    wait_for(lambda: sum(committed(elog).values()) == 2)
    assert not wrapped.violations


def test_a_busy_worker_releases_what_it_cannot_run_now(elog: EmbeddedLog, start: WorkerFactory) -> None:
    """The head-of-line case: a worker that acquired a long task and two short ones runs the long one
    and gives the short ones back at once, so an idle worker runs them while the long one runs."""
    dispatch(elog, "job-long", "long", handler="sleep", args={"seconds": 30})
    dispatch(elog, "job-long", "s1", handler="sleep", args={"seconds": 0.01})
    dispatch(elog, "job-long", "s2", handler="sleep", args={"seconds": 0.01})
    wrapped = _CheckingLog(elog)
    busy, _, _ = start(log=wrapped, worker_id="busy", max_batch=8)
    wait_for(lambda: busy.tasks_run == 1)
    assert wrapped.released == 2 and busy.tasks_released == 2
    idle, _, _ = start(worker_id="idle")
    wait_for(lambda: len(commands(elog, "job-long", SUCCEEDED)) == 2, what="short tasks")
    assert {r["task_id"]: r["worker_id"] for r in commands(elog, "job-long", STARTED)} == {
        "long": "busy", "s1": "idle", "s2": "idle"}
    assert not commands(elog, "job-long", FAILED)
    assert not wrapped.violations


def test_noop_batches_flush_once(elog: EmbeddedLog, start: WorkerFactory) -> None:
    n = 2000
    elog.create_topics([CFG.dispatch_spec(QUEUE)])
    p = elog.producer("test")
    for i in range(n):
        rec = codec.make("dagfold.dispatch.TaskDispatch", job_id=f"j{i}", task_id="t", attempt=1, handler="noop",
                         idempotency_key=f"j{i}/t", lease_timeout_s=30.0, dispatched_at_ms=0)
        p.send(dispatch_topic(QUEUE), f"j{i}".encode(), default_codec().encode(rec))
    p.flush()
    wrapped = _CheckingLog(elog)
    t0 = time.monotonic()
    w, _, _ = start(log=wrapped, max_batch=500)
    wait_for(lambda: sum(committed(elog).values()) == n, timeout=30)  # accepted after the reports
    elapsed = time.monotonic() - t0
    assert wrapped.flushes <= w.batches + 1
    assert w.batches <= n // 500 + 2
    assert len(commands(elog, type_=SUCCEEDED)) == n
    assert elapsed < 20
    print(f"{n / elapsed:.0f} noop tasks/s")


def test_worker_creates_dispatch_topic_and_waits_for_core_topics(tmp_path: Path) -> None:
    lg = EmbeddedLog(tmp_path / "fresh")
    w = Worker(cast(Log, lg), "gpu", "w1", HandlerRegistry.with_builtins(), dispatch_partitions=3, poll_timeout_s=0.05)
    stop = threading.Event()
    t = w.start_thread(stop)
    try:
        wait_for(lambda: "dispatch.gpu" in lg.topics())
        assert lg.partitions("dispatch.gpu") == 3
        time.sleep(0.3)
        assert t.is_alive() and COMMANDS not in lg.topics()  # waiting for the core topics
        lg.create_topics(CFG.core_topics())
        rec = codec.make("dagfold.dispatch.TaskDispatch", job_id="j", task_id="t", attempt=1, handler="noop",
                         idempotency_key="k", lease_timeout_s=30.0, dispatched_at_ms=0)
        p = lg.producer("test")
        p.send("dispatch.gpu", b"j", default_codec().encode(rec))
        p.flush()
        wait_for(lambda: w.tasks_succeeded == 1)
    finally:
        stop.set()
        t.join(5)
        w.close()
        lg.close()


def test_several_workers_share_a_queue(elog: EmbeddedLog, start: WorkerFactory) -> None:
    workers = [start(worker_id=f"w{i}", max_batch=2)[0] for i in range(3)]
    time.sleep(0.2)
    for i in range(30):
        dispatch(elog, f"job-{i}", handler="sleep", args={"seconds": 0.02})
    wait_for(lambda: {r["job_id"] for r in commands(elog, type_=SUCCEEDED)} == {f"job-{i}" for i in range(30)})
    assert sum(w.tasks_succeeded for w in workers) >= 30
    assert sum(1 for w in workers if w.tasks_run) >= 2  # each acquires 2 at a time: the others get the rest


def test_a_backlog_of_slow_tasks_is_not_passed_around_until_archived(elog: EmbeddedLog, start: WorkerFactory) -> None:
    """Four workers and a backlog of short sleeps: a worker that acquired a whole batch released all but
    one, each release counted as a delivery, and records passed around 10 times were archived, their
    tasks never run (6 of 16 in a warm-up). After a batch with a slow task a worker takes one record."""
    workers = [start(worker_id=f"w{i}")[0] for i in range(4)]
    for i in range(60):
        dispatch(elog, f"job-{i}", handler="sleep", args={"seconds": 0.01})
    wait_for(lambda: len(commands(elog, type_=SUCCEEDED)) == 60, timeout=30, what="all 60 tasks")
    assert sum(w.tasks_run for w in workers) == 60


def test_a_record_on_its_last_delivery_is_requeued_not_released(elog: EmbeddedLog, start: WorkerFactory) -> None:
    """A busy worker gives back the slow tasks it cannot run now. A record on its last delivery was
    released too, so the queue archived it and its task never ran; now a record acquired on its last
    delivery is appended anew (delivery count 1) and the held one accepted: the copies run, none is
    released."""
    dispatch(elog, "job-a", handler="sleep", args={"seconds": 0.3})
    dispatch(elog, "job-a", "t2", handler="sleep", args={"seconds": 0.01})
    other = elog.queue_consumer(worker_group(QUEUE), "other", max_records=8, max_deliveries=2)
    other.subscribe([dispatch_topic(QUEUE)])
    held = wait_for(lambda: other.poll(0.1), what="both records acquired")
    assert len(held) == 2
    for r in held:  # a first delivery, given back (e.g. by a worker that stopped)
        other.acknowledge(r, Ack.RELEASE)
    other.commit()
    other.close()
    w, _, _ = start(max_batch=8, max_deliveries=2)
    wait_for(lambda: len(commands(elog, "job-a", SUCCEEDED)) == 2, timeout=10, what="both tasks")
    assert w.tasks_requeued == 2 and w.tasks_released == 0
    assert len(commands(elog, "job-a", STARTED)) == 2  # each task ran once: the copy, not the held record


def test_a_worker_dying_with_a_record_on_its_last_delivery_loses_no_task(elog: EmbeddedLog,
                                                                          start: WorkerFactory) -> None:
    """The long chaos run's lost tasks (docs/reliability.md): workers killed while they held a dispatch
    record drove its delivery count to the limit; the next worker that acquired it died too, the queue
    archived the record and the task was never dispatched again (runnable, attempt 1, for 55 minutes).
    Now that worker appends the record anew before it runs anything, so its death loses nothing."""
    calls: list[str] = []

    def crash_first(ctx: TaskContext) -> None:
        calls.append(ctx.worker_id)
        if len(calls) == 1:
            raise WorkerCrashed("fault injection: killed while holding the record")

    reg = HandlerRegistry.with_builtins()
    reg.register("crash_first", crash_first, batched=True)  # instant: its record is held while it runs
    dispatch(elog, "job-a", handler="crash_first")
    topic = dispatch_topic(QUEUE)
    # Two deaths while holding it: a member whose lock lapses, one that leaves without settling.
    lapsed = elog.queue_consumer(worker_group(QUEUE), "lapsed", max_records=1, lock_ms=1, max_deliveries=3)
    lapsed.subscribe([topic])
    assert [r.delivery_count for r in wait_for(lambda: lapsed.poll(0.1), what="1st delivery")] == [1]
    left = elog.queue_consumer(worker_group(QUEUE), "left", max_records=1, lock_ms=60_000, max_deliveries=3)
    left.subscribe([topic])
    assert [r.delivery_count for r in wait_for(lambda: left.poll(0.1), what="2nd delivery")] == [2]
    left.close()
    lapsed.close()
    dying, _, _ = start(reg, worker_id="dying", max_deliveries=3)
    wait_for(lambda: dying.crashed, what="the worker on the last delivery to die")
    assert calls == ["dying"]
    start(reg, worker_id="survivor", max_deliveries=3)
    assert outcome(elog, "job-a")["worker_id"] == "survivor"  # one outcome: the task ran to its end once
    assert calls == ["dying", "survivor"] and dying.tasks_requeued == 1
    assert sum(committed(elog).values()) == 2  # the held record accepted, its copy run and accepted


def test_a_failed_append_of_a_last_delivery_is_retried(elog: EmbeddedLog, start: WorkerFactory) -> None:
    """The copy of a record on its last delivery is written again when its flush fails (the held
    record is archived whatever the worker does with it): the task still runs, once."""
    dispatch(elog, "job-a")
    dispatch(elog, "job-b")
    other = elog.queue_consumer(worker_group(QUEUE), "other", max_records=8, max_deliveries=2)
    other.subscribe([dispatch_topic(QUEUE)])
    assert len(wait_for(lambda: other.poll(0.1), what="both records")) == 2
    other.close()  # a death without settling: both on their last delivery next time
    wrapped = _CheckingLog(elog, fail_flushes=1)
    w, _, _ = start(log=wrapped, max_deliveries=2)
    assert outcome(elog, "job-a")["type"] == SUCCEEDED and outcome(elog, "job-b")["type"] == SUCCEEDED
    assert w.tasks_requeued == 2 and wrapped.flushes >= 3  # the failed one, the copies, the outcomes
    wait_for(lambda: sum(committed(elog).values()) == 4, what="held records and copies done")


def test_a_batch_taken_as_the_worker_stops_is_given_back_whole(elog: EmbeddedLog) -> None:
    """Stopped between a poll and its batch: the worker runs nothing of it and releases every record,
    instant ones included (they were left acquired and unacknowledged: held from other workers until
    their lock ran out, and the worker's next poll refused)."""
    for i in range(2):
        dispatch(elog, f"job-n{i}")  # noop: instant
    dispatch(elog, "job-s", "s", handler="sleep", args={"seconds": 0.01})
    w = Worker(elog, QUEUE, "w1", HandlerRegistry.with_builtins(), config=CFG, max_batch=8, poll_timeout_s=0.05)
    try:
        w._consumer.subscribe([dispatch_topic(QUEUE)])
        records = wait_for(lambda: w._consumer.poll(0.1), what="the batch")
        assert len(records) == 3
        stop = threading.Event()
        stop.set()
        w._process_batch(records, stop)
        assert w.tasks_run == 0 and w.tasks_released == 3
        assert w._consumer.poll(0.1) is not None  # nothing of the batch is left unacknowledged
        assert not commands(elog)
    finally:
        w.close()
