"""examples/side_effects.py: a task delivered twice (two attempts, or one record twice) charges once."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from dagfold import codec
from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS, Config, dispatch_topic
from dagfold.log.base import TopicPartition
from dagfold.log.embedded import EmbeddedLog
from dagfold.services.worker import HandlerRegistry, TaskContext, Worker
from examples.side_effects import charge_customer, demo

CFG = Config(partitions=2, dispatch_partitions=2)


def _args(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"customer": "c-7", "amount_cents": 500, "charges_file": str(tmp_path / "charges.txt"),
            "ledger": str(tmp_path / "ledger.sqlite"), **extra}


def test_two_attempts_of_a_task_charge_once(tmp_path: Path) -> None:
    ctxs = [TaskContext(job_id="J", task_id="pay", attempt=a, idempotency_key="J/pay", args=_args(tmp_path))
            for a in (1, 2)]
    receipts = [charge_customer(c) for c in ctxs]
    assert receipts[0] == receipts[1] and receipts[0]["charged_by_attempt"] == 1
    assert (tmp_path / "charges.txt").read_text().splitlines() == ["J/pay c-7 500"]
    # another task is another charge
    other = TaskContext(job_id="J", task_id="pay2", attempt=1, idempotency_key="J/pay2", args=_args(tmp_path))
    charge_customer(other)
    assert len((tmp_path / "charges.txt").read_text().splitlines()) == 2


def _commands(log: EmbeddedLog) -> list[Record]:
    c = log.consumer(None, client_id="test")
    c.assign({TopicPartition(COMMANDS, p): 0 for p in range(log.partitions(COMMANDS))})
    out = [default_codec().decode(r.value) for r in c.poll(10_000, 0.1)]
    c.close()
    return out


def test_the_same_dispatch_record_twice_and_a_second_attempt_charge_once(tmp_path: Path) -> None:
    """Through a real worker: one record delivered twice, then the task's next attempt."""
    log = EmbeddedLog(tmp_path / "log")
    try:
        log.create_topics(CFG.core_topics() + [CFG.dispatch_spec("default")])
        reg = HandlerRegistry.with_builtins()
        reg.register("charge_customer", charge_customer)
        producer = log.producer("test")
        for attempt in (1, 1, 2):  # a redelivered record, then a retry
            rec = codec.make("dagfold.dispatch.TaskDispatch", job_id="J", task_id="pay", attempt=attempt,
                             handler="charge_customer", args_json=json.dumps(_args(tmp_path)),
                             idempotency_key="J/pay", lease_timeout_s=30.0, start_to_close_s=None,
                             dispatched_at_ms=int(time.time() * 1000))
            producer.send(dispatch_topic("default"), b"J", default_codec().encode(rec))
        producer.flush()
        w = Worker(log, "default", "w1", reg, config=CFG, poll_timeout_s=0.05)
        stop = threading.Event()
        t = w.start_thread(stop)
        deadline = time.monotonic() + 30
        done: list[Record] = []
        while time.monotonic() < deadline:
            done = [r for r in _commands(log) if r["type"] == "dagfold.command.TaskSucceeded"]
            if len(done) == 3:
                break
            time.sleep(0.05)
        stop.set()
        t.join(10)
        w.close()
        assert [r["attempt"] for r in done] == [1, 1, 2]
        assert len({r["result_json"] for r in done}) == 1  # every run returns the first receipt
        assert (tmp_path / "charges.txt").read_text().splitlines() == ["J/pay c-7 500"]
    finally:
        log.close()


def test_demo_job_retries_after_the_charge_and_charges_once(tmp_path: Path) -> None:
    """Through the scheduler: attempt 1 charges then fails, attempt 2 gets the stored receipt."""
    res = demo(tmp_path)
    assert res["job"]["state"] == "succeeded"
    assert [(a["attempt"], a["outcome"]) for a in res["attempts"]] == [(1, "failed"), (2, "succeeded")]
    assert json.loads(res["attempts"][1]["result_json"])["charged_by_attempt"] == 1
    assert res["charges"] == ["order-1001/charge c-42 1999"]
