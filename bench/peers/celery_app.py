"""The Celery app of the bench (peers venv): Redis as broker and result backend."""

from __future__ import annotations

import os
import time

from celery import Celery

from bench.peers.probe import task_probe

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:16399/0")

app = Celery("bench", broker=URL, backend=URL)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
)


@app.task(name="bench.noop")
def noop(task_id: str) -> None:
    task_probe(task_id, time.time())


_levels: dict[tuple[str, bool], list[list[str]]] = {}


@app.task(name="bench.advance")
def advance(workload: str, smoke: bool, i: int, prefix: str, final_id: str) -> None:
    """Start level ``i`` of the workload as a chord whose callback starts level i+1 (the dynamic canvas).

    A static ``chain(group, group, ...)`` carries every later level inside each
    message (O(tasks x levels) bytes); this keeps each message O(1).
    """
    from celery import chain, chord, group

    from bench.peers.workloads import levels, load

    lv = _levels.get((workload, smoke))
    if lv is None:
        lv = _levels[(workload, smoke)] = levels(load(workload, smoke))
    def then(k: int):  # type: ignore[no-untyped-def]
        if k == len(lv):
            return done.si().set(task_id=final_id)
        return advance.si(workload, smoke, k, prefix, final_id)

    j = i
    while j < len(lv) and len(lv[j]) == 1:
        j += 1
    if j > i:  # a run of single-task levels is one chain
        chain(*[noop.si(prefix + lv[k][0]) for k in range(i, j)], then(j)).apply_async()
    else:
        chord(group([noop.si(prefix + t) for t in lv[i]]), then(i + 1)).apply_async()


@app.task(name="bench.done")
def done() -> str:
    return "done"
