"""The HTTP API: submit and cancel jobs (commands on the log), read jobs (the read model).

Writes are commands: ``POST /v1/jobs`` validates the spec with the same rules
the scheduler applies, then produces ``SubmitJob`` to the commands topic keyed
by job ID and answers 202; the scheduler decides. Reads come from the
projector's read model, so a job appears there once the scheduler accepted (or
rejected) it and the projector caught up: poll ``GET /v1/jobs/{id}``.

Every error is JSON ``{"error": {"code": ..., "reason": ...}}``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Query, Request
from fastapi import HTTPException as FastAPIHTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from dagfold.codec import default_codec, make
from dagfold.config import COMMANDS, Config
from dagfold.exceptions import CodecError, LogError
from dagfold.log.base import Log, Producer
from projections.exceptions import InvalidCursor
from projections.jobs import TERMINAL_JOB_STATES, Page, ReadModel
from services.scheduler.spec import JobSpecIn, SpecError, load_spec_text, parse_spec, to_job_spec
from services.scheduler.validation import validate_job_spec

logger = logging.getLogger(__name__)

JobState = Literal["running", "succeeded", "succeeded_partial", "failed", "cancelled", "rejected"]
TaskState = Literal["pending", "runnable", "running", "retrying", "succeeded", "failed", "skipped", "cancelled"]

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
REDRIVABLE_STATES = frozenset({"failed", "succeeded_partial", "cancelled"})

_STATUS_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_job",
    500: "internal_error",
    503: "unavailable",
}


class ApiError(FastAPIHTTPException):
    """An HTTP error with a machine code and a reason."""

    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(status, detail={"code": code, "reason": reason})


def _error_body(code: str, reason: str) -> dict[str, Any]:
    return {"error": {"code": code, "reason": reason}}


class CancelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field("cancelled by user", max_length=2000)


class _CommandSender:
    """The API's producer, shared by request threads."""

    def __init__(self, log: Log) -> None:
        self._log = log
        self._producer: Producer | None = None
        self._lock = threading.Lock()

    def send(self, record: dict[str, Any], key: str) -> None:
        try:
            value = default_codec().encode(record)
        except CodecError as exc:
            raise ApiError(400, "invalid_spec", str(exc)) from None
        with self._lock:
            try:
                if self._producer is None:
                    self._producer = self._log.producer("api")
                self._producer.send(COMMANDS, key.encode(), value)
                self._producer.flush()
            except LogError as exc:
                logger.warning("api: cannot write %s: %s", record["type"], exc)
                raise ApiError(503, "log_unavailable", f"the command log is unavailable: {exc}") from None

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                try:
                    self._producer.close()
                except LogError as exc:
                    logger.warning("api: producer close failed: %s", exc)
                self._producer = None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _parse_body(body: bytes, media_type: str) -> JobSpecIn:
    """A checked spec from a JSON or YAML body; anything else is read as YAML (a superset of JSON)."""
    if not body.strip():
        raise SpecError("request body is empty: send a job spec as JSON or YAML")
    if media_type in JSON_TYPES or media_type.endswith("+json"):
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise SpecError(f"job spec is not valid JSON: {exc}") from None
        return parse_spec(data)
    return load_spec_text(body)


def _page(page: Page, name: str) -> dict[str, Any]:
    return {name: page.items, "next_cursor": page.next_cursor}


def create_app(log: Log, read_model: ReadModel, config: Config, *, max_body_bytes: int | None = None) -> FastAPI:
    """The API over ``log`` (commands out) and ``read_model`` (queries in).

    ``max_body_bytes`` defaults to the submission limit ``config.scheduler.limits.max_spec_bytes``.
    """
    limits = config.scheduler.limits
    body_limit = max_body_bytes if max_body_bytes is not None else limits.max_spec_bytes
    sender = _CommandSender(log)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        sender.close()

    app = FastAPI(
        title="dagfold",
        version="0.1.0",
        description="Event-sourced scheduler for DAG and GPU jobs. Submissions are commands: "
        "a 202 means the job was queued for the scheduler; poll GET /v1/jobs/{job_id}.",
        lifespan=lifespan,
    )
    app.state.sender = sender

    # -- errors ----------------------------------------------------------
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail
        if isinstance(detail, dict) and "code" in detail:
            body = {"error": detail}
        else:
            body = _error_body(_STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}"), str(detail))
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return JSONResponse(_error_body("invalid_request", "; ".join(parts) or "invalid request"),
                            status_code=400)

    @app.exception_handler(InvalidCursor)
    async def cursor_error(request: Request, exc: InvalidCursor) -> JSONResponse:
        return JSONResponse(_error_body("invalid_cursor", str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("api: unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(_error_body("internal_error", "internal error"), status_code=500)

    def _job_or_404(job_id: str) -> dict[str, Any]:
        job = read_model.get_job(job_id)
        if job is None:
            raise ApiError(404, "not_found", f"job {job_id!r} not found")
        return job

    # -- health ----------------------------------------------------------
    @app.get("/healthz", tags=["ops"], summary="Liveness")
    def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    # -- submit ----------------------------------------------------------
    @app.post(
        "/v1/jobs",
        status_code=202,
        tags=["jobs"],
        summary="Submit a job (JSON or YAML body)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    t: {"schema": {"$ref": "#/components/schemas/JobSpecIn"}}
                    for t in ("application/json", "application/yaml")
                },
            },
            "responses": {
                "400": {"description": "Malformed spec (the reason names the field)"},
                "413": {"description": "Body larger than the limit"},
                "422": {"description": "Spec refused (cycle, unknown dependency, limits)"},
            },
        },
    )
    async def submit_job(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > body_limit:
            raise ApiError(413, "payload_too_large", f"body is {declared} bytes, limit {body_limit}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > body_limit:
                raise ApiError(413, "payload_too_large", f"body exceeds the limit of {body_limit} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        media_type = _media_type(request)

        def prepare() -> dict[str, Any]:
            try:
                spec = to_job_spec(_parse_body(body, media_type))
            except SpecError as exc:
                raise ApiError(400, "invalid_spec", str(exc)) from None
            rejection = validate_job_spec(spec, limits)
            if rejection is not None:
                raise ApiError(422, rejection.code, rejection.reason)
            record = make("dagfold.command.SubmitJob", spec=spec, submitted_at_ms=_now_ms(), source="api")
            sender.send(record, spec["job_id"])
            return spec

        spec = await run_in_threadpool(prepare)  # parsing a large spec and flushing must not block the loop
        job_id = spec["job_id"]
        return JSONResponse(
            {"job_id": job_id, "state": "submitted", "tasks": len(spec["tasks"]),
             "idempotency_key": spec["idempotency_key"]},
            status_code=202,
            headers={"Location": f"/v1/jobs/{job_id}"},
        )

    # -- reads -----------------------------------------------------------
    @app.get("/v1/jobs", tags=["jobs"], summary="List jobs, newest first")
    def list_jobs(
        tenant: Annotated[str | None, Query(min_length=1)] = None,
        state: JobState | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        return _page(read_model.list_jobs(tenant=tenant, state=state, limit=limit, cursor=cursor), "jobs")

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], summary="Job summary")
    def get_job(job_id: str) -> dict[str, Any]:
        return _job_or_404(job_id)

    @app.get("/v1/jobs/{job_id}/tasks", tags=["jobs"], summary="Tasks of a job, by task ID")
    def get_tasks(
        job_id: str,
        state: TaskState | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        _job_or_404(job_id)
        return _page(read_model.get_tasks(job_id, limit=limit, cursor=cursor, state=state), "tasks")

    @app.get("/v1/jobs/{job_id}/tasks/{task_id}", tags=["jobs"], summary="One task")
    def get_task(job_id: str, task_id: str) -> dict[str, Any]:
        task = read_model.get_task(job_id, task_id)
        if task is None:
            _job_or_404(job_id)
            raise ApiError(404, "not_found", f"job {job_id!r} has no task {task_id!r}")
        return task

    @app.get("/v1/jobs/{job_id}/tasks/{task_id}/attempts", tags=["jobs"], summary="Attempts of a task")
    def get_attempts(job_id: str, task_id: str) -> dict[str, Any]:
        if read_model.get_task(job_id, task_id) is None:
            _job_or_404(job_id)
            raise ApiError(404, "not_found", f"job {job_id!r} has no task {task_id!r}")
        return {"attempts": read_model.get_attempts(job_id, task_id)}

    @app.get("/v1/jobs/{job_id}/history", tags=["jobs"], summary="Every event of a job, in order")
    def get_history(
        job_id: str,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        _job_or_404(job_id)
        return _page(read_model.get_history(job_id, limit=limit, cursor=cursor), "events")

    # -- control ---------------------------------------------------------
    @app.post("/v1/jobs/{job_id}/cancel", status_code=202, tags=["jobs"], summary="Cancel a job")
    def cancel_job(job_id: str, body: Annotated[CancelIn | None, Body()] = None) -> dict[str, Any]:
        job = _job_or_404(job_id)
        if job["state"] in TERMINAL_JOB_STATES:
            raise ApiError(409, "job_finished", f"job {job_id!r} is already {job['state']}")
        reason = body.reason if body is not None else "cancelled by user"
        sender.send(make("dagfold.command.CancelJob", job_id=job_id, reason=reason,
                         requested_at_ms=_now_ms()), job_id)
        return {"job_id": job_id, "state": "cancel_requested"}

    @app.post("/v1/jobs/{job_id}/redrive", status_code=202, tags=["jobs"],
              summary="Re-run a finished job's failed, skipped and cancelled tasks")
    def redrive_job(job_id: str) -> dict[str, Any]:
        job = _job_or_404(job_id)
        if job["state"] not in REDRIVABLE_STATES:
            raise ApiError(409, "not_redrivable", f"job {job_id!r} is {job['state']}; only "
                           f"{', '.join(sorted(REDRIVABLE_STATES))} jobs can be redriven")
        sender.send(make("dagfold.command.RedriveJob", job_id=job_id, requested_at_ms=_now_ms()), job_id)
        return {"job_id": job_id, "state": "redrive_requested"}

    # -- OpenAPI: document the spec schema the raw-body endpoint accepts -------
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            spec_schema = JobSpecIn.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(jsonable_encoder(spec_schema.pop("$defs", {})))
            components["JobSpecIn"] = spec_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
