"""Server-sent events of one job's progress: summary changes and new history entries.

Why polling the read model rather than a push from the projector: the read
model is the only state the API owns, point reads cost microseconds, and a
stream then works the same whether the projector runs in this process or not.
Each stream reads the job summary and the history after its cursor every
``poll_s``; the event ``id`` is the history cursor, so a client that
reconnects with ``Last-Event-ID`` resumes without gaps or repeats.

Events: ``job`` (the summary, when it changed), ``history`` (one entry per
event of the job, in log order), ``progress`` (only with ``progress_task``:
that task's state, attempt, progress and allocation, when one of them
changed), ``end`` (the job is finished and every entry was sent; the stream
closes). A comment line every ``heartbeat_s`` keeps
proxies from closing an idle stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from dagfold import metrics
from dagfold.projections.jobs import TERMINAL_JOB_STATES, ReadModel, history_prefix
from dagfold.projections.keys import decode_cursor
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext
from dagfold.services.api.errors import ApiError

PAGE = 500

# The query and header parameters of every route that follows a job (``follow``), and its documented answer.
After = Annotated[str | None, Query(description="resume after this history cursor")]
StreamFor = Annotated[float | None, Query(gt=0, le=86400, description="close after this long")]
LastEventId = Annotated[str | None, Header()]
EVENT_STREAM: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "event stream"}}

T = TypeVar("T")


def _frame(event: str, data: Any, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


PROGRESS_FIELDS = ("state", "gpu_state", "attempt", "progress", "worker_id", "allocation")


async def job_stream(rm: ReadModel, job_id: str, cursor: str | None, is_disconnected: Callable[[], Any], *,
                     poll_s: float = 0.25, heartbeat_s: float = 15.0, max_s: float | None = None,
                     progress_task: str | None = None) -> AsyncIterator[str]:
    """The frames of the stream (``cursor``: resume after this history entry; ``progress_task``: also
    send ``progress`` frames of this task)."""
    metrics.SSE_STREAMS.inc()
    try:
        yield "retry: 2000\n\n"
        last_summary: tuple[Any, ...] | None = None
        last_progress: tuple[Any, ...] | None = None
        last_beat = started = time.monotonic()
        while True:
            job = rm.get_job(job_id)
            if job is None:
                yield _frame("end", {"job_id": job_id, "state": None})
                return
            page = rm.get_history(job_id, limit=PAGE, cursor=cursor)
            for entry in page.items:
                cursor = rm.history_cursor(job_id, entry["partition"], entry["offset"])
                yield _frame("history", entry, cursor)
            if progress_task is not None:
                task = rm.get_task(job_id, progress_task)
                if task is not None:
                    progress_key = tuple(task.get(f) for f in PROGRESS_FIELDS)
                    if progress_key != last_progress:
                        last_progress = progress_key
                        yield _frame("progress", {"job_id": job_id, "task_id": progress_task,
                                                  **{f: task.get(f) for f in PROGRESS_FIELDS}})
            summary_key = (job["state"], job["last_offset"], job["updated_ms"])
            if summary_key != last_summary:
                last_summary = summary_key
                yield _frame("job", job)
            if page.next_cursor:
                continue  # more history waiting: no pause
            if job["state"] in TERMINAL_JOB_STATES:
                yield _frame("end", {"job_id": job_id, "state": job["state"]})
                return
            now = time.monotonic()
            if max_s is not None and now - started >= max_s:
                return
            if now - last_beat >= heartbeat_s:
                last_beat = now
                yield ": keep-alive\n\n"
            if await is_disconnected():
                return
            await asyncio.sleep(poll_s)
    finally:
        metrics.SSE_STREAMS.dec()


def claim_response(claim: dict[str, Any]) -> StreamingResponse:
    """The SSE response for the caller's own submission that lost the race for its job ID to another tenant's
    job (``ApiContext.job_summary_for``): one ``job`` frame with the rejected submission, then ``end``; never a
    frame of the other tenant's job."""
    job_id = claim["job_id"]

    async def frames() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        yield _frame("job", claim)
        yield _frame("end", {"job_id": job_id, "state": claim["state"]})

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_response(rm: ReadModel, job_id: str, cursor: str | None, is_disconnected: Callable[[], Any], *,
                    poll_s: float, max_s: float | None, progress_task: str | None = None) -> StreamingResponse:
    """The SSE response of a job route: a bad cursor is a 400 here, before the stream starts
    (after that, the status line is sent and an error could only end the stream)."""
    if cursor:
        decode_cursor(cursor, history_prefix(job_id))
    stream = job_stream(rm, job_id, cursor, is_disconnected, poll_s=poll_s, max_s=max_s,
                        progress_task=progress_task)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def follow(ctx: ApiContext, job_id: str, principal: Principal, request: Request, cursor: str | None,
                 timeout_s: float | None, find: Callable[[str, Principal], T],
                 progress_task: Callable[[T], str | None] = lambda _: None) -> StreamingResponse:
    """A job route's event stream: ``find`` (the route's tenant-scoped lookup, a 404 for another tenant's job)
    first; where it refuses, the caller's own rejected claim on the ID (``claim_response``), or its refusal."""
    try:
        found = await run_in_threadpool(find, job_id, principal)
    except ApiError:
        claim = await run_in_threadpool(ctx.own_rejected_claim, job_id, principal)
        if claim is None:
            raise
        return claim_response(claim)
    return stream_response(ctx.rm, job_id, cursor, request.is_disconnected, poll_s=ctx.sse_poll_s,
                           max_s=timeout_s, progress_task=progress_task(found))
