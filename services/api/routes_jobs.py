"""Routes of jobs: submit, list, read, follow (SSE), cancel, redrive, retry or mark succeeded a task.

Writes are commands on the log (the scheduler decides); reads come from the
read model. Every job-scoped route answers a job of another tenant exactly as
a job that does not exist (same status, same body), so a tenant cannot probe
for other tenants' jobs.
"""

# No "from __future__ import annotations": FastAPI must see the route signatures'
# Annotated[..., Depends(local)] objects, which string annotations would hide.

import json
import os
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from dagfold.clock import now_ms
from dagfold.codec import make
from dagfold.jobspec import JobSpecIn, SpecError, SpecRejected, parse_spec, spec_hash, still_skipped, to_job_spec
from dagfold.lifecycle import JOB_STATES, REDRIVABLE, TASK_STATES, job_control_refusal, task_action_refusal
from dagfold.parsing import ParseError, load_json, load_yaml
from dagfold.projections.jobs import TERMINAL_JOB_STATES, Page
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext, parse_time_ms
from dagfold.services.api.errors import ApiError
from dagfold.services.api.graph import graph_json, layout, rejected_graph_json
from dagfold.services.api.sse import EVENT_STREAM, After, LastEventId, StreamFor, follow
from dagfold.tracing import TRACEPARENT, clean_traceparent, job_trace_id

if TYPE_CHECKING:
    JobStateName = str
    TaskStateName = str
else:  # the lifecycle's states as plain string literals: the OpenAPI document lists them inline
    JobStateName = Literal[tuple(s.value for s in JOB_STATES)]
    TaskStateName = Literal[tuple(s.value for s in TASK_STATES)]
Limit = Annotated[int, Query(ge=1, le=1000, description="page size (at most 1000)")]

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class CancelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field("cancelled by user", max_length=2000)


class TaskActionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field("", max_length=2000, description="why, for the audit log (the job's history shows it)")


TASK_ACTION_COMMANDS = {"retry": "dagfold.command.RetryTask", "mark_succeeded": "dagfold.command.MarkTaskSucceeded"}


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def body_format(request: Request, accepted: tuple[str, ...] = ("json", "yaml")) -> str:
    """``json`` or ``yaml`` from the Content-Type, else 415 (checked before the body is read).

    Only these types: a page on another origin can send text/plain, form encodings or no type at all without
    the browser asking first, and none of them is read as a spec.
    """
    media = _media_type(request)
    if media in JSON_TYPES or media.endswith("+json"):
        kind = "json"
    elif media in YAML_TYPES or media.endswith("+yaml"):
        kind = "yaml"
    else:
        kind = ""
    if kind not in accepted:
        names = " or ".join(f"application/{k}" for k in accepted)
        raise ApiError(415, "unsupported_media_type",
                       f"send the body as {names} (Content-Type), not {media or 'no type'!r}")
    return kind


def parse_document(body: bytes, kind: str, what: str, invalid: str = "invalid_spec") -> Any:
    """A JSON or YAML body within the bounds of ``dagfold.parsing``: 400 (413 for size) naming the limit."""
    if not body.strip():
        raise ApiError(400, "invalid_request", f"request body is empty: send a {what} as JSON or YAML")
    try:
        return load_json(body, what=what) if kind == "json" else load_yaml(body, what=what)
    except ParseError as exc:
        status = 413 if exc.code == "too_large" else 400
        code = {"invalid": invalid, "too_large": "payload_too_large"}.get(exc.code, exc.code)
        raise ApiError(status, code, str(exc)) from None


def _parse_body(body: bytes, kind: str) -> JobSpecIn:
    """A checked spec from a JSON or YAML body."""
    return parse_spec(parse_document(body, kind, "job spec"))


def job_links(prefix: str = "/v1/jobs", routes: tuple[tuple[str, str, str], ...] = (
        ("GetJob", "", "get"), ("GetTasks", "/tasks", "get"), ("GetJobAttempts", "/attempts", "get"),
        ("GetHistory", "/history", "get"), ("GetGraph", "/graph", "get"), ("CancelJob", "/cancel", "post"),
        ("RedriveJob", "/redrive", "post"), ("PauseJob", "/pause", "post"),
        ("ResumeJob", "/resume", "post"))) -> dict[str, Any]:
    """OpenAPI links from a submission's answer to the routes of the job it names (clients and the stateful
    fuzzing in tests/test_schemathesis.py follow them)."""
    base = prefix.replace("/", "~1") + "~1{job_id}"
    return {name: {"operationRef": f"#/paths/{base}{tail.replace('/', '~1')}/{method}",
                   "parameters": {"job_id": "$response.body#/job_id"}} for name, tail, method in routes}


def _page(page: Page, name: str) -> dict[str, Any]:
    return {name: page.items, "next_cursor": page.next_cursor}


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "payload_too_large", f"body is {declared} bytes, limit {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "payload_too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def submit_spec(ctx: ApiContext, spec_in: JobSpecIn, principal: Principal,
                traceparent: str = "") -> tuple[int, dict[str, Any]]:
    """Submit a checked spec as the caller: the path of every submission route.

    The tenant comes from the caller's key ("default" or none in the spec means
    the key's tenant; another one is refused), then the scheduler's own
    validation (422), a callback_url to a denied literal address (422), the
    repeat check (200 with the existing job; 409 for the same ID or idempotency
    key with another spec), admission (429) and the SubmitJob command. Returns
    ``(202, submitted)`` or ``(200, existing job)``.
    ``traceparent`` (the request's W3C header) goes into SubmitJob: the job's spans continue that trace
    (an invalid one is ignored, never refused).
    """
    if principal.tenant is not None:  # "default" (or no tenant) means the key's tenant; another one is refused
        if "tenant" in spec_in.model_fields_set and spec_in.tenant not in (principal.tenant, "default"):
            raise ApiError(403, "tenant_mismatch", f"this API key belongs to tenant {principal.tenant!r}; "
                           f"the spec names tenant {spec_in.tenant!r}")
        spec_in = spec_in.model_copy(update={"tenant": principal.tenant})
    ent = ctx.entitlements(spec_in.tenant)
    if ent is not None and ent.max_tier is not None and "tier" not in spec_in.model_fields_set \
            and ent.tier_refusal(spec_in.tier):  # no tier named: the tenant's highest, not a refusal
        spec_in = spec_in.model_copy(update={"tier": ent.max_tier})
    try:
        spec = to_job_spec(spec_in, ctx.config.scheduler.limits)
    except SpecRejected as exc:
        raise ApiError(422, exc.rejection.code, exc.rejection.reason) from None
    except SpecError as exc:
        raise ApiError(400, "invalid_spec", str(exc)) from None
    url = spec.get("callback_url")
    refused = ctx.egress.literal_refusal(url) if url else None
    if refused is not None:  # early and only for literals: the notifier checks every address it resolves
        raise ApiError(422, "refused_destination", "callback_url names an address callbacks may not go to "
                       "(loopback, private, link-local... ; an operator may allow ranges: DAGFOLD_CALLBACK_ALLOW)")
    check_capabilities(ctx, spec)
    try:
        digest = spec_hash(spec)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ApiError(400, "invalid_spec", f"spec cannot be encoded: {exc}") from None
    job_id, tenant = spec["job_id"], spec["tenant"]
    owner = ctx.rm.job_tenant(job_id)
    if owner is not None and owner != tenant:  # job IDs are one namespace: the second submitter hears it now
        raise ApiError(409, "job_id_taken", f"job ID {job_id!r} is already taken; choose another (or omit it)")
    existing = ctx.rm.get_job(job_id) if owner is not None else None
    if (existing is not None and existing["state"] != "rejected" and existing.get("spec_hash")
            and principal.can_see(existing["tenant"])):
        if existing["spec_hash"] == digest:  # the same submission again: the first job stands
            return 200, existing
        key = spec["idempotency_key"]
        if key:
            raise ApiError(409, "idempotency_conflict",
                           f"idempotency key {key!r} was already used by job {job_id} with a different spec "
                           f"(spec hash {existing['spec_hash'][:12]}, this one {digest[:12]})")
        raise ApiError(409, "job_exists", f"job {job_id} already exists with a different spec")
    if principal.tenant is None:
        # an open API's caller is one identity whatever tenant it names: its own bucket first
        ctx.admission.check_rate(tenant, caller=None if principal.authenticated else principal.name)
    ctx.admission.check_open_jobs(tenant)
    traceparent = clean_traceparent(traceparent)
    ctx.sender.send(make("dagfold.command.SubmitJob", spec=spec, submitted_at_ms=now_ms(), source="api",
                         traceparent=traceparent), job_id)
    ctx.admission.submitted(tenant, job_id)
    return 202, {"job_id": job_id, "state": "submitted", "tasks": len(spec["tasks"]), "tenant": tenant,
                 "idempotency_key": spec["idempotency_key"], "trace_id": job_trace_id(job_id, traceparent)}


def check_capabilities(ctx: ApiContext, spec: dict[str, Any]) -> None:
    """The tenant's tier and handlers (403), the deployment's handlers and their own argument checks.

    The scheduler applies the tenant part again to SubmitJob records from any producer
    (``handlers.jobs.entitlement_refusal``); the API answers at once, before anything is written.
    """
    tenant = spec["tenant"]
    ent = ctx.entitlements(tenant)
    if ent is not None:
        why = ent.tier_refusal(spec["tier"])
        if why:
            raise ApiError(403, "tier_not_allowed", f"tenant {tenant!r}: {why}")
    seen: set[str] = set()
    for t in spec["tasks"]:
        name = t["handler"]
        if ent is not None and name not in seen:
            why = ent.handler_refusal(name)
            if why:
                raise ApiError(403, "handler_not_allowed", f"tenant {tenant!r}, task {t['task_id']!r}: {why}")
        seen.add(name)
        if ctx.handlers is None or t.get("resources") is not None:
            continue  # workers elsewhere, or a GPU task (run by node agents)
        if name not in ctx.handlers:
            raise ApiError(403, "handler_not_enabled",
                           f"task {t['task_id']!r}: handler {name!r} is not enabled on this deployment's workers "
                           f"(enabled: {', '.join(ctx.handlers.names())}; see --handlers)")
        bad = ctx.handlers.check_args(name, json.loads(t["args_json"] or "{}"))
        if bad:
            raise ApiError(422, "invalid_args", f"task {t['task_id']!r}: {bad}")


def request_cancel(ctx: ApiContext, job_id: str, principal: Principal, reason: str) -> dict[str, Any]:
    """Send CancelJob for a job the caller may see (404 otherwise; 409 if it already ended)."""
    job = ctx.job_for(job_id, principal)
    if job["state"] in TERMINAL_JOB_STATES:
        raise ApiError(409, "job_finished", f"job {job_id!r} is already {job['state']}")
    ctx.sender.send(make("dagfold.command.CancelJob", job_id=job_id, reason=reason, requested_at_ms=now_ms()),
                    job_id)
    return {"job_id": job_id, "state": "cancel_requested"}


def request_job_control(ctx: ApiContext, job_id: str, principal: Principal, action: str,
                        reason: str) -> dict[str, Any]:
    """Send PauseJob or ResumeJob for a job the caller may see (404 otherwise), after the lifecycle's rules
    (409 with their code; the scheduler applies them again when it folds the command)."""
    job = ctx.job_for(job_id, principal)
    why = job_control_refusal(action, job_id, job["state"])
    if why is not None:
        raise ApiError(409, *why)
    ctx.sender.send(make(f"dagfold.command.{action.capitalize()}Job", job_id=job_id, reason=reason,
                         requested_by=principal.name, requested_at_ms=now_ms()), job_id)
    return {"job_id": job_id, "state": f"{action}_requested"}


def _upstream_counts(ctx: ApiContext, job_id: str, task: dict[str, Any]) -> dict[str, Any]:
    """The task's trigger-rule inputs from the read model (O(in-degree) reads), as the fold counts them."""
    ups = list(dict.fromkeys(task.get("depends_on") or []))
    c: dict[str, Any] = {"rule": task.get("trigger_rule") or "all_success", "n_up": len(ups), "rem": 0, "ok": 0,
                         "bad": 0, "skip": 0}
    for u in ups:
        state = (ctx.rm.get_task(job_id, u) or {}).get("state")
        c[{"succeeded": "ok", "failed": "bad", "skipped": "skip", "cancelled": "skip"}.get(state or "", "rem")] += 1
    return c


def request_task_action(ctx: ApiContext, job_id: str, task_id: str, principal: Principal, action: str,
                        reason: str) -> dict[str, Any]:
    """Send RetryTask or MarkTaskSucceeded for a task of a job the caller may see (404 otherwise), after the
    scheduler's own rules (409 with their code; the scheduler applies them again when it folds the command)."""
    job = ctx.job_for(job_id, principal)
    task = ctx.rm.get_task(job_id, task_id)
    if task is None:
        raise ApiError(404, "not_found", f"job {job_id!r} has no task {task_id!r}")
    why = task_action_refusal(action, job_id, job["state"], task_id, task["state"], task.get("attempt") or 0)
    if why is None and action == "retry":
        why = still_skipped(task_id, _upstream_counts(ctx, job_id, task))
    if why is not None:
        raise ApiError(409, *why)
    ctx.sender.send(make(TASK_ACTION_COMMANDS[action], job_id=job_id, task_id=task_id, requested_by=principal.name,
                         reason=reason, requested_at_ms=now_ms()), job_id)
    return {"job_id": job_id, "task_id": task_id, "state": f"{action}_requested"}


def router(ctx: ApiContext, auth: Any) -> APIRouter:
    r = APIRouter(tags=["jobs"])
    Caller = Annotated[Principal, Depends(auth)]

    # -- submit ----------------------------------------------------------------
    def prepare(body: bytes, kind: str, principal: Principal, traceparent: str) -> JSONResponse:
        try:
            spec_in = _parse_body(body, kind)
        except SpecError as exc:
            raise ApiError(400, "invalid_spec", str(exc)) from None
        status, out = submit_spec(ctx, spec_in, principal, traceparent)
        return JSONResponse(out, status_code=status, headers={"Location": f"/v1/jobs/{out['job_id']}"})

    @r.post(
        "/v1/jobs",
        status_code=202,
        summary="Submit a job (JSON or YAML body)",
        description="202: queued for the scheduler; poll GET /v1/jobs/{job_id}. 200: the same spec was submitted "
        "before (same job ID or idempotency key): the existing job. 409: same job ID or idempotency key, "
        "different spec. 429: the tenant's rate or open-jobs limit (see Retry-After).",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    t: {"schema": {"$ref": "#/components/schemas/JobSpecIn"}}
                    for t in ("application/json", "application/yaml")
                },
            },
            "responses": {
                "200": {"description": "Repeated submission: the existing job", "links": job_links()},
                "202": {"description": "Queued for the scheduler", "links": job_links()},
                "400": {"description": "Malformed spec (the reason names the field)"},
                "403": {"description": "The spec names a tenant other than the API key's ('default' is the key's)"},
                "409": {"description": "Job ID or idempotency key already used with a different spec"},
                "413": {"description": "Body larger than the limit"},
                "415": {"description": "Content-Type is not a spec type (JSON; for jobs also YAML)"},
                "422": {"description": "Spec refused (cycle, unknown dependency, limits)"},
                "429": {"description": "Tenant rate limit or open-jobs cap; Retry-After says when to retry"},
            },
        },
    )
    async def submit_job(request: Request, principal: Caller) -> JSONResponse:
        kind = body_format(request)
        if principal.tenant is not None:  # refuse a flood before reading its bodies
            ctx.admission.check_rate(principal.tenant)
        body = await _read_body(request, ctx.body_limit)
        return await run_in_threadpool(prepare, body, kind, principal, request.headers.get(TRACEPARENT, ""))

    # -- reads -------------------------------------------------------------------
    @r.get("/v1/jobs", summary="List jobs, newest first")
    def list_jobs(
        principal: Caller,
        tenant: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        state: JobStateName | None = None,
        created_after: Annotated[str | None, Query(description="ms since epoch or ISO 8601, inclusive")] = None,
        created_before: Annotated[str | None, Query(description="ms since epoch or ISO 8601, exclusive")] = None,
        limit: Limit = 100,
        cursor: str | None = None,
        name: Annotated[str | None, Query(min_length=1, max_length=200,
                                          description="only jobs whose name contains this (any case)")] = None,
        id_prefix: Annotated[str | None, Query(min_length=1, max_length=200,
                                               description="only jobs whose ID starts with this, in ID order")] = None,
    ) -> dict[str, Any]:
        page = ctx.rm.list_jobs(tenant=principal.scope(tenant), state=state, limit=limit, cursor=cursor,
                                created_after=parse_time_ms(created_after, "created_after"),
                                created_before=parse_time_ms(created_before, "created_before"),
                                name=name, id_prefix=id_prefix)
        return _page(page, "jobs")

    trace_ui = os.environ.get("DAGFOLD_TRACE_UI", "")  # a trace viewer's page: {trace_id} replaced

    @r.get("/v1/jobs/{job_id}", summary="Job summary")
    def get_job(job_id: str, principal: Caller) -> dict[str, Any]:
        job = ctx.job_summary_for(job_id, principal)
        if trace_ui and job.get("trace_id"):
            job = {**job, "trace_url": trace_ui.replace("{trace_id}", job["trace_id"])}
        return job

    @r.get("/v1/jobs/{job_id}/tasks", summary="Tasks of a job, by task ID")
    def get_tasks(job_id: str, principal: Caller, state: TaskStateName | None = None, limit: Limit = 100,
                  cursor: str | None = None) -> dict[str, Any]:
        ctx.job_for(job_id, principal)
        return _page(ctx.rm.get_tasks(job_id, limit=limit, cursor=cursor, state=state), "tasks")

    def _task_or_404(job_id: str, task_id: str, principal: Principal) -> dict[str, Any]:
        ctx.job_for(job_id, principal)
        task = ctx.rm.get_task(job_id, task_id)
        if task is None:
            raise ApiError(404, "not_found", f"job {job_id!r} has no task {task_id!r}")
        return task

    @r.get("/v1/jobs/{job_id}/tasks/{task_id}", summary="One task")
    def get_task(job_id: str, task_id: str, principal: Caller) -> dict[str, Any]:
        return _task_or_404(job_id, task_id, principal)

    @r.get("/v1/jobs/{job_id}/tasks/{task_id}/attempts", summary="Attempts of a task, with reasons and output tails")
    def get_attempts(job_id: str, task_id: str, principal: Caller) -> dict[str, Any]:
        _task_or_404(job_id, task_id, principal)
        return {"attempts": ctx.rm.get_attempts(job_id, task_id)}

    @r.get("/v1/jobs/{job_id}/attempts", summary="Every attempt of a job (the timeline), by task")
    def get_job_attempts(job_id: str, principal: Caller, limit: Limit = 1000,
                         cursor: str | None = None) -> dict[str, Any]:
        ctx.job_for(job_id, principal)
        return _page(ctx.rm.get_job_attempts(job_id, limit=limit, cursor=cursor), "attempts")

    @r.get("/v1/jobs/{job_id}/history", summary="Every event of a job, in order")
    def get_history(job_id: str, principal: Caller, limit: Limit = 100, cursor: str | None = None) -> dict[str, Any]:
        ctx.job_for(job_id, principal)
        return _page(ctx.rm.get_history(job_id, limit=limit, cursor=cursor), "events")

    @r.get("/v1/jobs/{job_id}/graph", summary="The job's DAG with a layered layout and task states")
    def get_graph(job_id: str, principal: Caller) -> JSONResponse:
        job = ctx.job_for(job_id, principal)
        if job["state"] == "rejected":
            return JSONResponse({"job_id": job_id, "state": "rejected", **rejected_graph_json(
                ctx.rm.get_rejected_graph(job_id))})
        cache_key = f"{job_id}\x00{job['created_ms']}"
        lay = ctx.layouts.get(cache_key)
        states: dict[str, str] = {}
        marked: set[str] = set()
        deps: list[tuple[str, list[str]]] = []
        for t in ctx.rm.iter_tasks(job_id):
            states[t["task_id"]] = t["state"]
            if t["state"] == "succeeded" and t.get("marked_by") is not None:
                marked.add(t["task_id"])
            if lay is None:
                deps.append((t["task_id"], t.get("depends_on") or []))
        if lay is None:
            lay = layout(deps)
            ctx.layouts.put(cache_key, lay)
        return JSONResponse({"job_id": job_id, "state": job["state"], **graph_json(lay, states, marked)})

    @r.get(
        "/v1/jobs/{job_id}/events",
        summary="Follow a job: server-sent events (job summary changes, new history entries, end)",
        response_class=StreamingResponse,
        responses=EVENT_STREAM,
    )
    async def job_events(job_id: str, request: Request, principal: Caller, after: After = None,
                         timeout_s: StreamFor = None, last_event_id: LastEventId = None) -> StreamingResponse:
        return await follow(ctx, job_id, principal, request, last_event_id or after, timeout_s, ctx.job_for)

    # -- control -----------------------------------------------------------------
    @r.post("/v1/jobs/{job_id}/cancel", status_code=202, summary="Cancel a job")
    def cancel_job(job_id: str, principal: Caller, body: Annotated[CancelIn | None, Body()] = None) -> dict[str, Any]:
        return request_cancel(ctx, job_id, principal, body.reason if body is not None else "cancelled by user")

    @r.post("/v1/jobs/{job_id}/redrive", status_code=202,
            summary="Re-run a finished job's failed, skipped and cancelled tasks")
    def redrive_job(job_id: str, principal: Caller) -> dict[str, Any]:
        job = ctx.job_for(job_id, principal)
        if job["state"] not in REDRIVABLE:
            raise ApiError(409, "not_redrivable", f"job {job_id!r} is {job['state']}; only "
                           f"{', '.join(sorted(REDRIVABLE))} jobs can be redriven")
        ctx.sender.send(make("dagfold.command.RedriveJob", job_id=job_id, requested_at_ms=now_ms()), job_id)
        return {"job_id": job_id, "state": "redrive_requested"}

    control_responses: dict[int | str, dict[str, Any]] = {
        404: {"description": "No such job (or another tenant's job)"},
        409: {"description": "The job is not in a state for this (code: job_paused, job_not_paused, job_finished)"}}

    @r.post("/v1/jobs/{job_id}/pause", status_code=202, responses=control_responses,
            summary="Pause a running job: nothing new is dispatched, running tasks finish")
    def pause_job(job_id: str, principal: Caller,
                  body: Annotated[TaskActionIn | None, Body()] = None) -> dict[str, Any]:
        return request_job_control(ctx, job_id, principal, "pause", body.reason if body else "")

    @r.post("/v1/jobs/{job_id}/resume", status_code=202, responses=control_responses,
            summary="Resume a paused job: what became runnable meanwhile is dispatched")
    def resume_job(job_id: str, principal: Caller,
                   body: Annotated[TaskActionIn | None, Body()] = None) -> dict[str, Any]:
        return request_job_control(ctx, job_id, principal, "resume", body.reason if body else "")

    action_responses: dict[int | str, dict[str, Any]] = {
        404: {"description": "No such job or task (or another tenant's job)"},
        409: {"description": "The job or task is not in a state for this (code: job_succeeded, job_cancelled, "
                             "task_succeeded, task_not_finished, still_skipped)"}}

    @r.post("/v1/jobs/{job_id}/tasks/{task_id}/retry", status_code=202, responses=action_responses,
            summary="Run a failed, skipped or cancelled task again (fresh retry budget); its skipped downstream too")
    def retry_task(job_id: str, task_id: str, principal: Caller,
                   body: Annotated[TaskActionIn | None, Body()] = None) -> dict[str, Any]:
        return request_task_action(ctx, job_id, task_id, principal, "retry", body.reason if body else "")

    @r.post("/v1/jobs/{job_id}/tasks/{task_id}/mark-succeeded", status_code=202, responses=action_responses,
            summary="Record a failed, skipped or cancelled task as succeeded without running it")
    def mark_task_succeeded(job_id: str, task_id: str, principal: Caller,
                            body: Annotated[TaskActionIn | None, Body()] = None) -> dict[str, Any]:
        return request_task_action(ctx, job_id, task_id, principal, "mark_succeeded", body.reason if body else "")

    return r
