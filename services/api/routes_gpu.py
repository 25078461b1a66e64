"""Routes of GPU jobs: one GPU task per job, submitted, followed and cancelled as a unit.

``POST /v1/gpu-jobs`` turns a small request (model, params, prompt, resources,
pool) into a one-task job spec (task ``run``, handler ``gpu``, queue = pool,
``args`` = {model, params, prompt}) and submits it through the same path as
``POST /v1/jobs`` (``routes_jobs.submit_spec``: tenant from the key, the
scheduler's validation, repeats, admission). The scheduler sends the task to
the pool's GPU allocator. ``GET /v1/gpu-jobs/{id}`` shows the job and its task
(state, attempt, progress, allocation), and the callback delivery when the
notifier runs in this process; ``/events`` is the job's event stream plus
``progress`` frames of the task; ``/cancel`` cancels the job.

A GPU job here is any one-task job whose task is a GPU task (handler ``gpu``,
or resources with GPUs), whichever route submitted it; another job is
answered 404.
"""

# No "from __future__ import annotations": FastAPI must see the route signatures'
# Annotated[..., Depends(local)] objects, which string annotations would hide.

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, UrlConstraints, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool

from dagfold.jobspec import (
    MAX_GPU_TYPES,
    MAX_SECONDS,
    GpuType,
    IdempotencyKey,
    JobId,
    JobSpecIn,
    QueueName,
    RetryPolicyIn,
    SpecError,
    TenantName,
    is_gpu,
    parse_spec,
)
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext
from dagfold.services.api.errors import ApiError
from dagfold.services.api.routes_jobs import (
    CancelIn,
    _read_body,
    body_format,
    job_links,
    parse_document,
    request_cancel,
    submit_spec,
)
from dagfold.services.api.routes_outputs import output_links
from dagfold.services.api.sse import EVENT_STREAM, After, LastEventId, StreamFor, follow
from dagfold.tracing import TRACEPARENT

TASK_ID = "run"
GPU_LINKS = {**job_links("/v1/gpu-jobs", (("GetGpuJob", "", "get"), ("CancelGpuJob", "/cancel", "post"))),
             **job_links("/v1/jobs", (("GetJob", "", "get"), ("GetHistory", "/history", "get")))}
HANDLER = "gpu"
MAX_GPUS_PER_HOST = 8
TASK_FIELDS = ("state", "gpu_state", "attempt", "progress", "worker_id", "retries", "requeues", "reason", "exit_code",
               "error_type", "dispatched_ms", "started_ms", "ended_ms", "last_heartbeat_ms", "checkpoint_uri")
JOB_TIMES = ("created_ms", "started_ms", "ended_ms", "updated_ms", "duration_ms")

Tier = Literal["enterprise", "standard", "free"]
CallbackUrl = Annotated[AnyHttpUrl, UrlConstraints(max_length=2048, allowed_schemes=["http", "https"])]


class GpuResourcesIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    gpus: int = Field(1, ge=1, le=MAX_GPUS_PER_HOST, description="GPUs on each host")
    gpu_type: GpuType | list[GpuType] = Field(default_factory=list, max_length=MAX_GPU_TYPES,
                                              description="allowed GPU types (any of them); empty: any type")
    hosts: int = Field(1, ge=1, le=1024, description="hosts of the gang (all-or-nothing)")
    gpu_milli: int = Field(1000, ge=1, le=1000, description="thousandths of one GPU; below 1000 shares a GPU "
                           "(needs gpus 1)")
    max_runtime_s: float | None = Field(None, gt=0, le=MAX_SECONDS,
                                        description="the allocation ends after this long")
    checkpoint: bool = Field(False, description="the job checkpoints: preemption lets it save and resume")

    @model_validator(mode="after")
    def _share_of_one_gpu(self) -> "GpuResourcesIn":
        if self.gpu_milli < 1000 and self.gpus != 1:
            raise ValueError("gpu_milli below 1000 is a share of one GPU: it needs gpus 1")
        return self


class GpuJobIn(BaseModel):
    """A GPU job: one task on ``resources.hosts`` x ``resources.gpus`` GPUs of ``pool``."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    job_id: JobId | None = Field(None, description="generated if absent (derived from idempotency_key when given)")
    idempotency_key: IdempotencyKey | None = Field(
        None, description="a repeated submission with this key returns the first job")
    tenant: TenantName | None = Field(None, description="default: the API key's tenant")
    tier: Tier = "standard"
    model: str = Field(min_length=1, max_length=512, description="the model to run")
    params: dict[str, Any] = Field(default_factory=dict, description="model parameters, passed to the handler")
    prompt: str = Field("", description="input of the job, passed to the handler")
    callback_url: CallbackUrl | None = Field(None, description="POSTed once when the job ends (signed; see docs)")
    resources: GpuResourcesIn = Field(default_factory=lambda: GpuResourcesIn.model_validate({}))
    pool: QueueName = Field("default", description="GPU pool; also the task's queue")
    retry: RetryPolicyIn | None = None


def to_spec_in(req: GpuJobIn) -> JobSpecIn:
    """The one-task job spec of a GPU request (``tenant`` only when the request names one)."""
    task = {"id": TASK_ID, "handler": HANDLER, "queue": req.pool,
            "args": {"model": req.model, "params": req.params, "prompt": req.prompt},
            "resources": req.resources.model_dump()}
    doc: dict[str, Any] = {"idempotency_key": req.idempotency_key, "tasks": [task],
                           "callback_url": str(req.callback_url) if req.callback_url is not None else None,
                           "retry": req.retry.model_dump() if req.retry is not None else None}
    if req.job_id is not None:
        doc["id"] = req.job_id
    if req.tenant is not None:
        doc["tenant"] = req.tenant
    if "tier" in req.model_fields_set:  # else the spec's default, lowered to the tenant's highest tier
        doc["tier"] = req.tier
    return parse_spec(doc)


def _reason(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_gpu_job(body: bytes) -> GpuJobIn:
    """A checked request from a JSON body: 400 if it is not a JSON object, 422 naming the bad fields."""
    data = parse_document(body, "json", "GPU job", "invalid_request")
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object")
    try:
        return GpuJobIn.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_gpu_job", _reason(exc)) from None


def gpu_status(job: dict[str, Any], task: dict[str, Any]) -> str:
    """The job's state as the seed names them (QUEUED, ASSIGNED, RUNNING, CHECKPOINTING, COMPLETED, FAILED,
    CANCELLED): its GPU task's, derived from the events by the projection; a job ended by a cancel or a
    failure before its task ran reads as the job ended."""
    status = task.get("gpu_state") or "QUEUED"
    if job["state"] == "cancelled" and status not in ("COMPLETED", "FAILED"):
        return "CANCELLED"
    if job["state"] in ("failed", "rejected") and status != "COMPLETED":
        return "FAILED"
    return str(status)


def links(job_id: str) -> dict[str, str]:
    base = f"/v1/gpu-jobs/{job_id}"
    return {"self": base, "events": base + "/events", "cancel": base + "/cancel", "job": f"/v1/jobs/{job_id}",
            "history": f"/v1/jobs/{job_id}/history"}


def router(ctx: ApiContext, auth: Any) -> APIRouter:
    r = APIRouter(tags=["gpu-jobs"])
    Caller = Annotated[Principal, Depends(auth)]

    def gpu_job_for(job_id: str, principal: Principal) -> tuple[dict[str, Any], dict[str, Any]]:
        """The job and its GPU task; 404 when the job is not visible or not a GPU job."""
        job = ctx.job_for(job_id, principal)
        tasks = ctx.rm.get_tasks(job_id, limit=1).items if job.get("total_tasks") == 1 else []
        if not tasks or not is_gpu(tasks[0]):
            raise ApiError(404, "not_found", f"job {job_id!r} is not a GPU job (see /v1/jobs/{job_id})")
        return job, tasks[0]

    def submit(body: bytes, principal: Principal, traceparent: str) -> JSONResponse:
        req = parse_gpu_job(body)
        try:
            spec_in = to_spec_in(req)
        except SpecError as exc:
            raise ApiError(422, "invalid_gpu_job", str(exc)) from None
        status, out = submit_spec(ctx, spec_in, principal, traceparent)
        job_id = out["job_id"]
        answer = {"job_id": job_id, "state": out["state"], "tenant": out["tenant"],
                  "idempotency_key": out.get("idempotency_key"), "trace_id": out.get("trace_id"),
                  "links": links(job_id)}
        return JSONResponse(answer, status_code=status, headers={"Location": f"/v1/gpu-jobs/{job_id}"})

    @r.post(
        "/v1/gpu-jobs",
        status_code=202,
        summary="Submit a GPU job (JSON)",
        description="One task (handler gpu, queue = pool) on resources.hosts x resources.gpus GPUs. 202: queued "
        "for the scheduler; follow links.self or links.events. 200: the same request was submitted before (same "
        "job_id or idempotency_key): the existing job. 409: same job_id or idempotency_key, different request. "
        "429: the tenant's rate or open-jobs limit.",
        openapi_extra={
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/GpuJobIn"}}}},
            "responses": {
                "200": {"description": "Repeated submission: the existing job", "links": GPU_LINKS},
                "202": {"description": "Queued for the scheduler", "links": GPU_LINKS},
                "400": {"description": "Body is not a JSON object"},
                "403": {"description": "The request names a tenant other than the API key's"},
                "409": {"description": "Job ID or idempotency key already used with a different request"},
                "413": {"description": "Body larger than the limit"},
                "415": {"description": "Content-Type is not a spec type (JSON; for jobs also YAML)"},
                "422": {"description": "Invalid request (the reason names the fields) or refused by the "
                        "scheduler's rules"},
                "429": {"description": "Tenant rate limit or open-jobs cap; Retry-After says when to retry"},
            },
        },
    )
    async def submit_gpu_job(request: Request, principal: Caller) -> JSONResponse:
        body_format(request, ("json",))
        if principal.tenant is not None:  # refuse a flood before reading its bodies
            ctx.admission.check_rate(principal.tenant)
        body = await _read_body(request, ctx.body_limit)
        return await run_in_threadpool(submit, body, principal, request.headers.get(TRACEPARENT, ""))

    @r.get("/v1/gpu-jobs/{job_id}", summary="GPU job status: job, task, allocation, callback")
    def get_gpu_job(job_id: str, principal: Caller) -> dict[str, Any]:
        try:
            job, task = gpu_job_for(job_id, principal)
        except ApiError:
            # the caller's own submission that lost the race for this job ID to another tenant's job
            claim = ctx.own_rejected_claim(job_id, principal)
            if claim is None:
                raise
            return {"job_id": job_id, "state": "rejected", "status": "FAILED", "tenant": claim["tenant"],
                    "tier": None, "code": claim["code"], "reason": claim["reason"], "pool": None, "model": None,
                    "params": None, "resources": None, "task": None, "allocation": None, "result": None,
                    "outputs": [], "callback_url": None, **{k: claim.get(k) for k in JOB_TIMES},
                    "links": links(job_id)}
        try:
            args = json.loads(task.get("args_json") or "{}")
        except ValueError:
            args = {}
        result = None
        if task.get("result_json"):
            try:
                result = json.loads(task["result_json"])
            except ValueError:
                result = task["result_json"]
        out: dict[str, Any] = {
            "job_id": job_id, "state": job["state"], "status": gpu_status(job, task), "tenant": job["tenant"],
            "tier": job.get("tier"),
            "code": job.get("code"), "reason": job.get("reason"), "pool": task.get("queue"),
            "model": args.get("model"), "params": args.get("params"), "resources": task.get("resources"),
            "task": {"task_id": task["task_id"], **{k: task.get(k) for k in TASK_FIELDS}},
            "allocation": task.get("allocation"),
            "result": result,
            "outputs": output_links(f"/v1/gpu-jobs/{job_id}", task.get("outputs") or []),
            "callback_url": job.get("callback_url"),
            **{k: job.get(k) for k in JOB_TIMES},
            "links": links(job_id),
        }
        if ctx.callbacks is not None and job.get("callback_url"):
            delivery = ctx.callbacks.status(job_id)
            if delivery is not None:
                out["callback"] = delivery
        return out

    @r.get(
        "/v1/gpu-jobs/{job_id}/events",
        summary="Follow a GPU job: server-sent events (job, history, progress of the task, end)",
        response_class=StreamingResponse,
        responses=EVENT_STREAM,
    )
    async def gpu_job_events(job_id: str, request: Request, principal: Caller, after: After = None,
                             timeout_s: StreamFor = None, last_event_id: LastEventId = None) -> StreamingResponse:
        return await follow(ctx, job_id, principal, request, last_event_id or after, timeout_s, gpu_job_for,
                            progress_task=lambda found: str(found[1]["task_id"]))

    @r.post("/v1/gpu-jobs/{job_id}/cancel", status_code=202, summary="Cancel a GPU job")
    def cancel_gpu_job(job_id: str, principal: Caller,
                       body: Annotated[CancelIn | None, Body()] = None) -> dict[str, Any]:
        gpu_job_for(job_id, principal)
        return request_cancel(ctx, job_id, principal, body.reason if body is not None else "cancelled by user")

    return r
