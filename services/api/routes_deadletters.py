"""Routes for dead letters: list them, show one, resubmit a dead-lettered SubmitJob after a fix.

Admin only when auth is on: a dead letter holds another tenant's raw record.
Reads go to the dead-letter topic itself (``dagfold.deadletters``: a bounded
window per page, never the whole topic). A resubmission decodes the record
again with today's codec (the fix may have been a schema, a registry or a
partitioner), validates the spec with the scheduler's rules, and sends a new
SubmitJob keyed by its job ID, so it lands on the job's partition; a job that
already exists with the same spec is answered 200, as a repeated submission is.
"""

# No "from __future__ import annotations": FastAPI must see the route signatures'
# Annotated[..., Depends(local)] objects, which string annotations would hide.

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse

from dagfold.commands import submit_job
from dagfold.deadletters import DeadLetter, DeadLetterError, get_dead_letter, list_dead_letters
from dagfold.exceptions import LogError
from dagfold.jobspec import spec_hash, validate_job_spec
from dagfold.log.base import Log
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext, parse_time_ms
from dagfold.services.api.errors import ApiError

DlId = Annotated[str, Path(max_length=40, description="PARTITION-OFFSET of the record in the dead-letter topic")]


def router(ctx: ApiContext, auth: Any) -> APIRouter:
    r = APIRouter(tags=["operations"])
    Caller = Annotated[Principal, Depends(auth)]

    def admin_log(principal: Principal) -> Log:
        if not principal.admin:
            raise ApiError(403, "forbidden", "dead letters need an admin key: they hold other tenants' records")
        if ctx.log is None:
            raise ApiError(404, "no_log", "this API serves a replayed folder: it has no dead-letter topic")
        return ctx.log

    def one(log: Log, dl_id: str) -> DeadLetter:
        try:
            dl = get_dead_letter(log, dl_id)
        except DeadLetterError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except LogError as exc:
            raise ApiError(503, "log_unavailable", f"cannot read the dead-letter topic: {exc}") from None
        if dl is None:
            raise ApiError(404, "not_found", f"no dead letter {dl_id!r}")
        return dl

    def shown(dl: DeadLetter) -> dict[str, Any]:
        item = dl.as_dict()
        job = ctx.rm.get_job(dl.job_id) if dl.job_id else None
        item["job_state"] = job["state"] if job else None  # e.g. after a resubmission
        item["resubmittable"] = dl.record_type == "dagfold.command.SubmitJob"
        return item

    @r.get("/v1/deadletters", summary="Dead letters, newest first: source topic/partition/offset, service, reason, "
           "a bounded decoded preview (admin)")
    def list_(
        principal: Caller,
        since: Annotated[str | None, Query(max_length=40, description="ms since epoch or ISO 8601")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
        cursor: Annotated[str | None, Query(max_length=1400)] = None,
    ) -> dict[str, Any]:
        log = admin_log(principal)
        try:
            items, next_cursor = list_dead_letters(log, limit, cursor, parse_time_ms(since, "since"))
        except DeadLetterError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except LogError as exc:
            raise ApiError(503, "log_unavailable", f"cannot read the dead-letter topic: {exc}") from None
        return {"deadletters": [shown(d) for d in items], "next_cursor": next_cursor}

    @r.get("/v1/deadletters/{dl_id}", summary="One dead letter (admin)")
    def get(principal: Caller, dl_id: DlId) -> dict[str, Any]:
        return shown(one(admin_log(principal), dl_id))

    @r.post("/v1/deadletters/{dl_id}/resubmit", status_code=202, summary=(
        "Resubmit a dead-lettered SubmitJob after a fix: decoded again, validated, sent keyed by its job ID (admin)"))
    def resubmit(principal: Caller, dl_id: DlId) -> Any:
        dl = one(admin_log(principal), dl_id)
        if dl.decoded is None:
            raise ApiError(422, "undecodable", f"dead letter {dl_id} still does not decode: {dl.preview}")
        if dl.decoded["type"] != "dagfold.command.SubmitJob":
            raise ApiError(409, "not_resubmittable", f"dead letter {dl_id} is a {dl.decoded['type']}; "
                           "only a SubmitJob can be resubmitted")
        spec = dl.decoded["spec"]
        rejection = validate_job_spec(spec, ctx.config.scheduler.limits)
        if rejection is not None:
            raise ApiError(422, rejection.code, rejection.reason)
        job_id = spec["job_id"]
        existing = ctx.rm.get_job(job_id)
        if existing is not None and existing["state"] != "rejected":
            if existing.get("spec_hash") and existing["spec_hash"] != spec_hash(spec):
                raise ApiError(409, "job_exists", f"job {job_id} already exists with a different spec")
            return JSONResponse({"job_id": job_id, "state": existing["state"], "deadletter": dl_id,
                                 "resubmitted": False}, status_code=200)
        ctx.sender.send(submit_job(spec, source=f"deadletter:{dl_id}"), job_id)
        return {"job_id": job_id, "state": "submitted", "deadletter": dl_id, "resubmitted": True,
                "tenant": spec["tenant"], "tasks": len(spec["tasks"])}

    return r
