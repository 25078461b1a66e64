"""The worker: leases dispatched attempts, runs their handlers, reports outcomes.

Data flow (one ``Worker``, its own queue consumer and producer)::

    dispatch.<queue> --(queue group dagfold-queue.<queue>; Kafka: a share group)--> Worker
        -> commands: TaskStarted, TaskHeartbeat..., TaskSucceeded | TaskFailed | TaskReleased
        -> deadletter: records that do not decode as a TaskDispatch
    control (all partitions, from the end) --> StopTask for this worker_id

The dispatch topic is a queue (``QueueConsumer`` in ``dagfold.log.base``): a worker
acquires records only when it is free to run them, so a task waits for capacity,
never behind another task on a busy worker. Per polled batch:

* Instant (``batched``) handlers such as ``noop`` run at once; each reports once,
  its outcome (no TaskStarted: the scheduler grants the lease and ends the attempt
  on the outcome), the batch's outcomes are flushed together, then their records
  are accepted.
* Of the other records the worker starts one and releases the rest at once, to
  whichever worker is free. The started one is accepted as soon as its
  TaskStarted is flushed: from then on the attempt's lease (heartbeats every
  ``lease_timeout_s / 3``, at least 0.2 s) is what says the attempt is alive, and
  the scheduler reclaims it when the lease runs out. Before that, the record's
  lock does: a worker that dies holding records has them handed to another
  worker when its lock runs out (or at once when it leaves cleanly). A record
  acquired on its last delivery (the queue would archive it then) is first
  appended anew and accepted once the copy is durable; the copy is what runs.

Delivery is at least once; the scheduler fences duplicate and stale reports by
attempt.

Stopping: a StopTask for the running attempt cancels it (``ctx.cancelled``; the
shell handler kills its process group) and nothing is reported for it. Past
``start_to_close_s`` the attempt is cancelled and fails with
``start_to_close_timeout``. When ``run``'s stop event is set, the running
attempt gets ``shutdown_grace_s`` to finish, then is cancelled and given back
(``TaskReleased``, reason ``worker_shutdown``): a drained worker is the
infrastructure's doing, so the scheduler runs the task again elsewhere without
spending its retry budget.

Fault injection (tests): a handler that raises ``WorkerCrashed`` makes its
worker behave as if its process were killed at that point (see the class).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from dagfold import codec, metrics
from dagfold.artifacts import ArtifactStore, output_prefix
from dagfold.clock import now_ms
from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS, CONTROL, DEADLETTER, Config, dispatch_topic, worker_group
from dagfold.exceptions import CodecError, LogError
from dagfold.log.base import Ack, Consumer, Log, LogRecord, QueuedRecord, TopicPartition, TopicSpec
from dagfold.logs import log_context
from dagfold.services.worker.exceptions import NonRetryableError, TaskError, TaskTimeout, UnknownHandlerError
from dagfold.services.worker.handlers import Handler, HandlerRegistry, TaskContext, TaskRuntime, default_registry
from dagfold.tracing import attempt_context, attempt_traceparent

log = logging.getLogger("dagfold.worker")

DISPATCH = "dagfold.dispatch.TaskDispatch"
STOP_TASK = "dagfold.control.StopTask"
SERVICE = "worker"
MAX_RESULT_BYTES = 64 * 1024
MAX_REASON_CHARS = 4096
TAIL_CHARS = 4096
MIN_HEARTBEAT_S = 0.2
_STOPPED_MEMORY = 4096
# A dispatch record's lock covers only the moment from its acquisition to its TaskStarted (the lease
# takes over then), so a short lock hands a dead worker's records on soon.
DISPATCH_LOCK_MS = 15_000
# Releases count as deliveries (Kafka's delivery count): a record a busy worker gives back is
# delivered again, so the limit is Kafka's largest default (group.share.max.delivery.count.limit).
DISPATCH_MAX_DELIVERIES = 10

AttemptKey = tuple[str, str, int]


class WorkerCrashed(Exception):
    """Fault injection: raised by a handler, its worker acts as if its process were killed there.

    For tests of lease expiry where workers are threads of one process (``dagfold
    up`` on the embedded log) and cannot be killed one by one. The attempt is
    abandoned: no outcome is reported, its heartbeats stop; the worker stops at
    once and leaves the queue group, so records it acquired and had not yet
    accepted go to other workers (as after a killed process's lock expiry). The
    scheduler reclaims the attempt when its lease expires (``lease_expired``,
    a worker loss).
    Never raised by dagfold itself; no built-in handler raises it.
    """


def _clean(s: str) -> str:
    """Text Avro can encode (lone surrogates, e.g. from undecodable file names, become '?')."""
    try:
        s.encode()
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "replace").decode()


def _tail(s: str) -> str:
    return _clean(s[-TAIL_CHARS:] if len(s) > TAIL_CHARS else s)


class _Running:
    """The attempt being run: shared by the run loop, its watcher and the control thread."""

    def __init__(self, key: AttemptKey, ctx: TaskContext) -> None:
        self.key = key
        self.ctx = ctx
        self.done = threading.Event()
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self.cancel_kind: str | None = None  # "stop" | "timeout" | "shutdown"
        self.pending: tuple[float | None, str | None] | None = None
        self.progress: float | None = None
        self.message: str | None = None

    def cancel(self, kind: str, reason: str) -> bool:
        with self._lock:
            if self.cancel_kind is not None:
                return False
            self.cancel_kind = kind
        self.ctx.cancel(reason)
        self.wake.set()
        return True

    def request_heartbeat(self, progress: float | None, message: str | None) -> None:
        with self._lock:
            self.pending = (progress, message)
        self.wake.set()

    def take_pending(self) -> tuple[float | None, str | None] | None:
        with self._lock:
            p, self.pending = self.pending, None
        if p is not None:
            if p[0] is not None:
                self.progress = p[0]
            if p[1] is not None:
                self.message = p[1]
        return p


class Worker:
    """One worker of one queue: its own dispatch consumer, control consumer and producer.

    Run several as threads (``start_thread``) or one per process. Call ``close``
    after ``run`` returned.
    """

    def __init__(
        self,
        log: Log,
        queue: str,
        worker_id: str,
        registry: HandlerRegistry | None = None,
        *,
        config: Config | None = None,
        dispatch_partitions: int | None = None,
        max_batch: int = 64,
        poll_timeout_s: float = 0.2,
        shutdown_grace_s: float = 5.0,
        lock_ms: int = DISPATCH_LOCK_MS,
        max_deliveries: int = DISPATCH_MAX_DELIVERIES,
        artifacts: ArtifactStore | None = None,
        runtime: TaskRuntime | None = None,
    ) -> None:
        self.log = log
        self.runtime = runtime if runtime is not None else TaskRuntime()
        self.queue = queue
        self.worker_id = worker_id
        self.registry = registry if registry is not None else default_registry()
        self.topic = dispatch_topic(queue)
        self.group = worker_group(queue)
        cfg = config if config is not None else Config(log_url=log.url)
        spec = cfg.dispatch_spec(queue)
        if dispatch_partitions is not None:
            spec = TopicSpec(spec.name, dispatch_partitions, spec.retention_ms, spec.replication,
                             spec.min_insync_replicas)
        self.dispatch_spec = spec
        self.max_batch = max_batch
        self.max_deliveries = max_deliveries
        self.poll_timeout_s = poll_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.artifacts = artifacts  # task outputs: uploaded from ctx.output_dir when an attempt succeeds
        self._codec = default_codec()
        self._producer = log.producer(f"dagfold-worker-{worker_id}")
        self._consumer = log.queue_consumer(self.group, f"dagfold-worker-{worker_id}", max_records=max_batch,
                                            lock_ms=lock_ms, max_deliveries=max_deliveries)
        self._control: Consumer | None = None
        self._control_thread: threading.Thread | None = None
        self._control_stop = threading.Event()
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._stopped: OrderedDict[AttemptKey, str] = OrderedDict()
        self._closed = False
        self._slow = False  # the last batch had a task that is not instant
        self.crashed = False  # stopped by WorkerCrashed (fault injection)
        # counters (read them as attributes; Prometheus metrics come later)
        self.tasks_run = 0
        self.tasks_succeeded = 0
        self.tasks_failed = 0
        self.tasks_stopped = 0
        self.tasks_skipped = 0
        self.tasks_released = 0  # records given back to the queue unstarted (another worker runs them)
        self.tasks_given_back = 0  # started attempts given back at shutdown (TaskReleased)
        self.tasks_requeued = 0  # records acquired on their last delivery, appended anew (the copy is run)
        self.dead_lettered = 0
        self.heartbeats_sent = 0
        self.batches = 0

    # -- lifecycle ------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {
            "tasks_run": self.tasks_run,
            "tasks_succeeded": self.tasks_succeeded,
            "tasks_failed": self.tasks_failed,
            "tasks_stopped": self.tasks_stopped,
            "tasks_skipped": self.tasks_skipped,
            "tasks_released": self.tasks_released,
            "tasks_given_back": self.tasks_given_back,
            "tasks_requeued": self.tasks_requeued,
            "dead_lettered": self.dead_lettered,
            "heartbeats_sent": self.heartbeats_sent,
            "batches": self.batches,
        }

    def start_thread(self, stop: threading.Event) -> threading.Thread:
        """Run in a new daemon thread named after the worker."""
        t = threading.Thread(target=self.run, args=(stop,), name=f"worker-{self.worker_id}", daemon=True)
        t.start()
        return t

    def run(self, stop: threading.Event) -> None:
        """Poll, run and report until ``stop`` is set."""
        if not self._prepare(stop):
            return
        log.info("worker started", extra={"worker_id": self.worker_id, "queue": self.queue})
        try:
            while not stop.is_set():
                try:
                    # After a batch with a task that is not instant, take one record at a time: a
                    # worker that acquires more than it runs releases the rest, and every release
                    # counts as a delivery (a record a busy queue keeps passing around would reach
                    # the delivery limit and be archived). Instant batches take max_batch.
                    records = self._consumer.poll(self.poll_timeout_s, 1 if self._slow else None)
                except LogError as exc:
                    log.warning("dispatch poll failed: %s", exc, extra={"worker_id": self.worker_id})
                    stop.wait(1.0)
                    continue
                if records:
                    self._process_batch(records, stop)
        except WorkerCrashed as exc:
            self.crashed = True
            log.warning("worker crashed (fault injection): %s", exc, extra={"worker_id": self.worker_id})
            self._consumer.close()  # leave the queue group: records not yet accepted go to other workers
        finally:
            self._stop_control()
            try:
                if not self.crashed:
                    self._producer.flush()
            except LogError:
                log.exception("final flush failed", extra={"worker_id": self.worker_id})
            log.info("worker stopped", extra={"worker_id": self.worker_id, **self.stats()})

    def close(self) -> None:
        """Release the consumers and the producer (after ``run`` returned)."""
        if self._closed:
            return
        self._closed = True
        self._stop_control()
        for c in (self._consumer, self._control):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    log.debug("consumer close failed", exc_info=True)
        try:
            self._producer.close()
        except Exception:
            log.debug("producer close failed", exc_info=True)

    def _topic_exists(self, topic: str) -> bool:
        try:
            return self.log.partitions(topic) > 0
        except LogError:
            return False

    def _prepare(self, stop: threading.Event) -> bool:
        """Create the dispatch topic, wait for the core topics, start the control reader, subscribe."""
        announced = False
        while not stop.is_set():
            try:
                self.log.create_topics([self.dispatch_spec])
            except LogError as exc:
                log.warning("cannot create dispatch topic yet: %s", exc,
                            extra={"worker_id": self.worker_id, "topic": self.topic})
            missing = [t for t in (self.topic, COMMANDS, CONTROL, DEADLETTER) if not self._topic_exists(t)]
            if not missing:
                break
            if not announced:
                log.info("waiting for topics %s", missing, extra={"worker_id": self.worker_id})
                announced = True
            stop.wait(0.5)
        # The control reader starts at the end offsets, which a broker outage can make
        # unreadable for a while: wait it out (before joining the dispatch group, where a
        # member that does not poll would hold up the group's rebalances).
        while not stop.is_set():
            try:
                self._start_control()
                break
            except LogError as exc:
                log.warning("cannot start the control reader yet: %s", exc, extra={"worker_id": self.worker_id})
                stop.wait(1.0)
        if stop.is_set():
            return False
        self._consumer.subscribe([self.topic])
        return True

    # -- control --------------------------------------------------------------
    def _start_control(self) -> None:
        n = self.log.partitions(CONTROL)
        tps = [TopicPartition(CONTROL, p) for p in range(n)]
        ends = self.log.end_offsets(tps)
        self._control = self.log.consumer(None, client_id=f"dagfold-worker-{self.worker_id}-control")
        self._control.assign(ends)
        self._control_stop.clear()
        self._control_thread = threading.Thread(target=self._control_loop, daemon=True,
                                                name=f"worker-{self.worker_id}-control")
        self._control_thread.start()

    def _stop_control(self) -> None:
        self._control_stop.set()
        t = self._control_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)
        self._control_thread = None

    def _control_loop(self) -> None:
        consumer = self._control
        assert consumer is not None
        while not self._control_stop.is_set():
            try:
                records = consumer.poll(256, min(0.2, self.poll_timeout_s))
            except Exception:
                log.warning("control poll failed", exc_info=True, extra={"worker_id": self.worker_id})
                self._control_stop.wait(1.0)
                continue
            for rec in records:
                self.handle_control_record(rec)

    def handle_control_record(self, rec: LogRecord) -> None:
        """Act on one record of the control topic (StopTask for this worker; others are ignored)."""
        try:
            r = self._codec.decode(rec.value)
        except CodecError as exc:
            log.warning("undecodable control record at %s/%d@%d: %s", rec.topic, rec.partition, rec.offset,
                        exc, extra={"worker_id": self.worker_id})
            return
        if r["type"] == STOP_TASK and r["worker_id"] == self.worker_id:
            self.stop_task(r["job_id"], r["task_id"], r["attempt"], r["reason"])

    def stop_task(self, job_id: str, task_id: str, attempt: int, reason: str = "stopped") -> bool:
        """Stop an attempt: cancel it if running (no report is sent for it), skip it if not started yet.

        Returns True if it was running.
        """
        key = (job_id, task_id, attempt)
        with self._lock:
            self._stopped[key] = reason
            self._stopped.move_to_end(key)
            while len(self._stopped) > _STOPPED_MEMORY:
                self._stopped.popitem(last=False)
            running = self._running
        if running is not None and running.key == key:
            if running.cancel("stop", f"stopped: {reason}"):
                log.info("stopping attempt: %s", reason, extra=self._extra(key))
            return True
        return False

    # -- dispatch ---------------------------------------------------------------
    def _process_batch(self, records: list[QueuedRecord], stop: threading.Event) -> None:
        """Run a polled batch: every instant task, and one other, releasing the rest (module docstring)."""
        self.batches += 1
        held = len(records)
        records = self._requeue_last_deliveries(records, stop)
        if not records:
            self._slow = True  # records reached their limit: take one at a time
            return
        instant: list[tuple[QueuedRecord, Record, Handler | None]] = []
        slow: list[tuple[QueuedRecord, Record, Handler]] = []
        settle: list[tuple[QueuedRecord, Ack]] = []  # acknowledged once this batch's reports are durable
        for rec in records:
            d = self._decode_dispatch(rec)
            if d is None:
                settle.append((rec, Ack.REJECT))  # dead-lettered
                continue
            if self._skip_stopped(d):
                settle.append((rec, Ack.ACCEPT))
                continue
            handler = self.registry.find(d["handler"])
            if handler is None or handler.batched:
                instant.append((rec, d, handler))
            else:
                slow.append((rec, d, handler))
        self._slow = bool(slow) or len(records) < held  # records at their limit: take one at a time
        run_now = slow[:1] if not stop.is_set() else []
        give_back = [rec for rec, _, _ in slow[len(run_now):]]
        if stop.is_set():  # stopping: run nothing, give every record back (instant ones too)
            give_back += [rec for rec, _, _ in instant]
            instant = []
        try:
            for rec, d, handler in instant:
                self._start(d, report=False)  # its outcome is the one report (the scheduler grants, then ends)
                self._send_report(d, self._execute(d, handler, stop))
                settle.append((rec, Ack.ACCEPT))
            if run_now:
                self._start(run_now[0][1])
            self._producer.flush()  # reports of the instant tasks and the slow one's TaskStarted
        except LogError:
            log.exception("cannot write reports; the batch's records go back to the queue",
                          extra={"worker_id": self.worker_id})
            self._settle([(rec, Ack.RELEASE) for rec in records])
            stop.wait(1.0)
            return
        # From here the slow attempt's lease stands for it (TaskStarted is durable): accept it,
        # and hand the records this worker will not run now to whichever worker is free.
        settle += [(rec, Ack.ACCEPT) for rec, _, _ in run_now] + [(rec, Ack.RELEASE) for rec in give_back]
        self.tasks_released += len(give_back)
        self._settle(settle)
        if run_now:
            _, d, handler = run_now[0]
            self._send_report(d, self._execute(d, handler, stop))
            try:
                self._producer.flush()
            except LogError:
                log.exception("cannot write the outcome; the scheduler reclaims the attempt when its lease ends",
                              extra=self._extra(self._key(d)))

    def _requeue_last_deliveries(self, records: list[QueuedRecord], stop: threading.Event) -> list[QueuedRecord]:
        """Append anew each record on its last delivery; the records left to process.

        The queue archives a record whose lock runs out (its worker died) or that is released on its
        last delivery, and nothing dispatches its task again. So before anything else is done with
        it, the same record is appended anew (delivery count 1, at the queue's end) and the held one
        accepted once the copy is durable: the copy is what a worker runs, never the held one (a
        task runs once), and a worker that dies from then on loses nothing. Until the copy is
        durable the worker retries the write, having released the rest of the batch (below their
        limit a release loses nothing). Left: a worker killed between the acquisition and the
        copy's flush (docs/semantics.md, dispatch).
        """
        last = [rec for rec in records if rec.delivery_count >= self.max_deliveries]
        if not last:
            return records
        rest = [rec for rec in records if rec.delivery_count < self.max_deliveries]
        while True:
            try:
                for rec in last:
                    self._producer.send(rec.topic, rec.key or b"", rec.value or b"", rec.partition)
                self._producer.flush()
                break
            except LogError:
                # A copy written twice is one attempt dispatched twice: the scheduler fences it.
                log.exception("cannot append records on their last delivery anew; retrying",
                              extra={"worker_id": self.worker_id})
                if rest:
                    self._settle([(rec, Ack.RELEASE) for rec in rest])
                    self.tasks_released += len(rest)
                    rest = []
                if stop.wait(1.0):
                    log.error("stopped before %d record(s) on their last delivery were appended anew: their tasks "
                              "are not dispatched again (schedule_to_start_s bounds them)", len(last),
                              extra={"worker_id": self.worker_id})
                    self._settle([(rec, Ack.RELEASE) for rec in last])
                    return []
        self.tasks_requeued += len(last)
        self._settle([(rec, Ack.ACCEPT) for rec in last])
        return rest

    def _settle(self, acks: list[tuple[QueuedRecord, Ack]]) -> None:
        """Acknowledge records of the current batch and send the acknowledgements without waiting: a
        lost one means the record's lock runs out and it is delivered again, which the scheduler fences."""
        try:
            for rec, ack in acks:
                self._consumer.acknowledge(rec, ack)
            self._consumer.commit(wait=False)
        except LogError as exc:
            log.warning("acknowledging dispatch records failed: %s", exc, extra={"worker_id": self.worker_id})

    @staticmethod
    def _key(d: Record) -> AttemptKey:
        return (d["job_id"], d["task_id"], d["attempt"])

    def _send(self, topic: str, key: bytes, rec: Record) -> None:
        self._producer.send(topic, key, self._codec.encode(rec))

    def _dead_letter(self, rec: LogRecord, reason: str) -> None:
        dl = codec.make("dagfold.deadletter.DeadLetter", source_topic=rec.topic, partition=rec.partition,
                        offset=rec.offset, key=rec.key, value=rec.value, reason=reason, service=SERVICE,
                        ts_ms=now_ms())
        self._send(DEADLETTER, rec.key or b"", dl)
        self.dead_lettered += 1
        metrics.DEAD_LETTERS.labels(SERVICE).inc()
        log.warning("dead-lettered %s/%d@%d: %s", rec.topic, rec.partition, rec.offset, reason,
                    extra={"worker_id": self.worker_id})

    def _extra(self, key: AttemptKey) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "job_id": key[0], "task_id": key[1], "attempt": key[2]}

    def _decode_dispatch(self, rec: LogRecord) -> Record | None:
        """The TaskDispatch in ``rec``, or None after dead-lettering what is not one."""
        try:
            d = self._codec.decode(rec.value)
        except CodecError as exc:
            self._dead_letter(rec, str(exc))
            return None
        if d["type"] != DISPATCH:
            self._dead_letter(rec, f"unexpected record type {d['type']} on {rec.topic}")
            return None
        return d

    def _skip_stopped(self, d: Record) -> bool:
        """True (and counted) for an attempt stopped before it ran."""
        key = self._key(d)
        with self._lock:
            stopped = self._stopped.get(key)
        if stopped is None:
            return False
        self.tasks_skipped += 1
        log.info("skipping attempt stopped before it ran: %s", stopped, extra=self._extra(key))
        return True

    def _start(self, d: Record, report: bool = True) -> None:
        """Count an attempt as started; ``report``: send its TaskStarted (an instant task, whose outcome
        goes out in the same flush, sends none: its outcome starts and ends it at the scheduler)."""
        if report:
            self._send(COMMANDS, d["job_id"].encode(), codec.make(
                "dagfold.command.TaskStarted", job_id=d["job_id"], task_id=d["task_id"], attempt=d["attempt"],
                worker_id=self.worker_id, ts_ms=now_ms()))
        self.tasks_run += 1
        metrics.observe_dispatch(self.queue, d["dispatched_at_ms"], now_ms())

    def _send_report(self, d: Record, report: Record | None) -> None:
        if report is not None:
            self._send(COMMANDS, d["job_id"].encode(), report)

    def _execute(self, d: Record, handler: Handler | None, stop: threading.Event | None) -> Record | None:
        """Run the attempt; the report to send, or None when it was stopped."""
        key = self._key(d)
        started = time.monotonic()
        trace_id = (d.get("traceparent") or attempt_traceparent(*key))[3:35]
        # every line logged while the task runs (handlers' too)
        with log_context(job_id=key[0], task_id=key[1], attempt=key[2], queue=self.queue, worker=self.worker_id,
                         trace_id=trace_id):
            report = self._execute_with_outputs(d, key, handler, stop)
            if report is not None and str(report.get("type", "")).endswith("TaskFailed"):
                log.info("attempt failed: %s", report.get("reason"))
        metrics.observe_worker_task(self.queue, report, time.monotonic() - started, trace_id)
        return report

    def _execute_attempt(self, d: Record, key: AttemptKey, handler: Handler | None,
                         stop: threading.Event | None, output_dir: Path | None = None) -> Record | None:
        ctx = TaskContext(job_id=key[0], task_id=key[1], attempt=key[2], idempotency_key=d["idempotency_key"],
                          tenant=d["tenant"], handler=d["handler"], worker_id=self.worker_id,
                          start_to_close_s=d["start_to_close_s"],
                          traceparent=d.get("traceparent") or attempt_traceparent(*key),
                          output_dir=str(output_dir) if output_dir is not None else None, runtime=self.runtime)
        try:
            args = json.loads(d["args_json"] or "{}")
            if not isinstance(args, dict):
                raise ValueError(f"expected a JSON object, got {type(args).__name__}")
        except ValueError as err:
            return self._failed(ctx, NonRetryableError(f"invalid args_json: {err}"))
        ctx.args = args
        if handler is None:  # not a capability of this worker (e.g. shell where it is not enabled)
            return self._failed(ctx, UnknownHandlerError(d["handler"]))
        bad_args = handler.args_check(args) if handler.args_check is not None else None
        if bad_args:
            return self._failed(ctx, NonRetryableError(f"invalid args: {bad_args}"))
        if handler.batched:
            def beat(p: float | None, m: str | None) -> None:
                self._send_heartbeat(ctx, p, m, flush=False)

            ctx.on_heartbeat = beat
            value, error = self._call(handler, ctx)
            return self._outcome(ctx, value, error)

        running = _Running(key, ctx)
        ctx.on_heartbeat = running.request_heartbeat
        with self._lock:  # stop_task records under this lock, then looks for the running attempt
            stopped = self._stopped.get(key)
            if stopped is None:
                self._running = running
        if stopped is not None:
            # a StopTask (e.g. lease_rejected: a redelivered record) that came after the check in
            # _process_record, before the attempt was registered as running: do not run it
            self.tasks_skipped += 1
            log.info("skipping attempt stopped before it ran: %s", stopped, extra=self._extra(key))
            return None
        lease = d["lease_timeout_s"]
        interval = max(lease / 3.0, MIN_HEARTBEAT_S) if lease == lease and lease > 0 else MIN_HEARTBEAT_S
        limit = d["start_to_close_s"]
        deadline = time.monotonic() + limit if limit is not None and limit > 0 else None
        watcher = threading.Thread(target=self._watch, args=(running, interval, deadline, stop,
                                                             lease if lease == lease and lease > 0 else 0.0),
                                   daemon=True,
                                   name=f"worker-{self.worker_id}-heartbeat")
        watcher.start()
        try:
            value, error = self._call(handler, ctx)
        finally:
            running.done.set()
            running.wake.set()
            watcher.join()
            with self._lock:
                self._running = None
        kind = running.cancel_kind
        if kind == "stop":
            self.tasks_stopped += 1
            log.info("attempt stopped; not reporting it", extra=self._extra(key))
            return None
        if kind == "timeout":
            return self._failed(ctx, error if isinstance(error, TaskTimeout) else TaskTimeout())
        if kind == "shutdown" and error is not None:
            # drained, not failed: the scheduler runs the attempt again elsewhere, retry budget untouched
            self.tasks_given_back += 1
            return codec.make("dagfold.command.TaskReleased", job_id=ctx.job_id, task_id=ctx.task_id,
                              attempt=ctx.attempt, worker_id=self.worker_id, ts_ms=now_ms(),
                              reason="worker_shutdown")
        return self._outcome(ctx, value, error)

    def _execute_with_outputs(self, d: Record, key: AttemptKey, handler: Handler | None,
                              stop: threading.Event | None) -> Record | None:
        """``_execute`` with an output folder when the worker has artifact storage: a success uploads
        the folder's files and lists them in its report; an upload that fails fails the attempt
        (retryable: the storage may be back for the next attempt). Batched handlers are instant
        in-process functions that return their result: they get no folder (it would cost a folder
        per task at full dispatch rate)."""
        if self.artifacts is None or handler is None or handler.batched:
            return self._execute_attempt(d, key, handler, stop)
        folder = Path(tempfile.mkdtemp(prefix="dagfold-outputs-"))
        try:
            self.runtime.hand_over(folder)  # the task process writes there, as the task user if any
            report = self._execute_attempt(d, key, handler, stop, output_dir=folder)
            if report is None or report["type"] != "dagfold.command.TaskSucceeded":
                return report
            try:
                # the task's processes are all gone (its reaper waited for them): nothing rewrites or
                # swaps a file while it is read; each is read once, its digest over the stored bytes
                arts = self.artifacts.upload_outputs(folder, output_prefix(d["tenant"], *key),
                                                     owner=self.runtime.owner())
            except Exception as exc:  # storage refused or unreachable, or outputs over the limits
                ctx = TaskContext(job_id=key[0], task_id=key[1], attempt=key[2],
                                  idempotency_key=d["idempotency_key"], tenant=d["tenant"])
                self.tasks_succeeded -= 1
                return self._failed(ctx, TaskError(f"output upload failed: {exc}"))
            report["outputs"] = [a.to_record() for a in arts]
            return report
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _call(handler: Handler, ctx: TaskContext) -> tuple[Any, Exception | None]:
        try:
            with attempt_context(ctx.traceparent):  # the handler's own OpenTelemetry spans nest under the attempt
                return handler.fn(ctx), None
        except WorkerCrashed:
            raise  # fault injection: abandon the attempt and stop the worker (see WorkerCrashed)
        except Exception as exc:
            return None, exc

    def _outcome(self, ctx: TaskContext, value: Any, exc: Exception | None) -> Record:
        if exc is not None:
            return self._failed(ctx, exc)
        result_json = None
        if value is not None:
            try:
                result_json = json.dumps(value, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                return self._failed(ctx, NonRetryableError(f"result is not JSON-serialisable: {e}"))
            size = len(result_json.encode())
            if size > MAX_RESULT_BYTES:
                return self._failed(ctx, NonRetryableError(
                    f"result_json is {size} bytes, over the {MAX_RESULT_BYTES}-byte limit"))
        self.tasks_succeeded += 1
        log.debug("task succeeded", extra=self._extra((ctx.job_id, ctx.task_id, ctx.attempt)))
        return codec.make("dagfold.command.TaskSucceeded", job_id=ctx.job_id, task_id=ctx.task_id,
                          attempt=ctx.attempt, worker_id=self.worker_id, ts_ms=now_ms(), result_json=result_json,
                          stdout_tail=_tail(ctx.stdout_tail), stderr_tail=_tail(ctx.stderr_tail))

    def _failed(self, ctx: TaskContext, exc: Exception) -> Record:
        if isinstance(exc, TaskError):
            reason, retryable, error_type, exit_code = exc.reason, exc.retryable, exc.error_type(), exc.exit_code
        else:
            reason, retryable, error_type, exit_code = str(exc), True, type(exc).__name__, None
        reason = _clean(str(reason or type(exc).__name__)[:MAX_REASON_CHARS])
        self.tasks_failed += 1
        extra = {**self._extra((ctx.job_id, ctx.task_id, ctx.attempt)), "reason": reason, "retryable": retryable}
        if isinstance(exc, TaskError):
            log.info("task failed: %s", reason, extra=extra)
        else:
            log.info("task failed: %s: %s", type(exc).__name__, reason, extra=extra, exc_info=exc)
        return codec.make("dagfold.command.TaskFailed", job_id=ctx.job_id, task_id=ctx.task_id,
                          attempt=ctx.attempt, worker_id=self.worker_id, ts_ms=now_ms(), reason=reason,
                          exit_code=exit_code, error_type=error_type, retryable=retryable,
                          stdout_tail=_tail(ctx.stdout_tail), stderr_tail=_tail(ctx.stderr_tail))

    # -- heartbeats -------------------------------------------------------------
    def _send_heartbeat(self, ctx: TaskContext, progress: float | None, message: str | None, *,
                        flush: bool, flush_s: float = 30.0) -> bool:
        """Send (and with ``flush`` deliver, waiting at most ``flush_s``) a heartbeat; whether it went out."""
        hb = codec.make("dagfold.command.TaskHeartbeat", job_id=ctx.job_id, task_id=ctx.task_id,
                        attempt=ctx.attempt, worker_id=self.worker_id, ts_ms=now_ms(), progress=progress,
                        message=_clean(str(message)[:1024]) if message is not None else None)
        try:
            self._send(COMMANDS, ctx.job_id.encode(), hb)
            if flush:
                self._producer.flush(flush_s)
        except LogError as exc:
            log.warning("heartbeat failed: %s", exc, extra=self._extra((ctx.job_id, ctx.task_id, ctx.attempt)))
            return False
        self.heartbeats_sent += 1
        return True

    def _watch(self, running: _Running, interval: float, deadline: float | None,
               stop: threading.Event | None, lease_s: float = 0.0) -> None:
        """Heartbeat the running attempt; cancel it at its deadline or after the shutdown grace, and stop it
        once no heartbeat was delivered for a whole lease (``lease_s``; a broker or network outage): the
        scheduler, which counts the lease from the last heartbeat it got, has reclaimed the attempt by then,
        so its outcome would be rejected and its side effects could run twice."""
        next_beat = time.monotonic() + interval
        last_sent = float("-inf")
        renewed = time.monotonic()  # the lease starts when TaskStarted was delivered (just before)
        shutdown_at: float | None = None
        while not running.done.is_set():
            running.wake.clear()
            now = time.monotonic()
            if running.cancel_kind is not None:
                return  # stopped, timed out or shutting down: the lease is no longer ours to keep
            if lease_s > 0 and now - renewed >= lease_s:
                log.warning("lease lost: no heartbeat delivered for %.1f s (the lease); stopping the attempt",
                            now - renewed, extra=self._extra(running.key))
                running.cancel("stop", "lease lost: no heartbeat delivered for the whole lease")
                return
            if deadline is not None and now >= deadline:
                running.cancel("timeout", "start_to_close_timeout")
                return
            if stop is not None and stop.is_set():
                if shutdown_at is None:
                    shutdown_at = now + self.shutdown_grace_s
                if now >= shutdown_at:
                    running.cancel("shutdown", "worker_shutdown")
                    return
            due = now >= next_beat
            if running.pending is not None and now - last_sent >= MIN_HEARTBEAT_S:
                running.take_pending()
                due = True
            if due:
                sent_at = time.monotonic()
                # a flush waits at most until the lease would lapse (a whole lease without delivery ends it)
                if self._send_heartbeat(running.ctx, running.progress, running.message, flush=True,
                                        flush_s=max(0.1, renewed + lease_s - sent_at) if lease_s > 0 else 30.0):
                    renewed = sent_at  # the scheduler got it at or after it was sent
                last_sent = now = time.monotonic()
                next_beat = now + interval
            wake_at = min(t for t in (next_beat, deadline, shutdown_at,
                                      last_sent + MIN_HEARTBEAT_S if running.pending is not None else None,
                                      now + 0.25) if t is not None)
            running.wake.wait(max(0.0, wake_at - now))
