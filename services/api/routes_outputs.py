"""Routes of task outputs: what a succeeded attempt uploaded to artifact storage.

``GET /v1/jobs/{job}/tasks/{task}/outputs/{name}`` (and the GPU job's alias
``GET /v1/gpu-jobs/{job}/outputs/{name}``) streams one output's bytes, with
its content type, length and ``ETag`` (the sha256 reported by the runner);
``?presign=true`` answers a time-limited URL of the object store instead
(S3-compatible storage only; 409 on the local folder).

A tenant reaches only its own outputs: the job must be visible to the caller
(the same 404 as every job route otherwise), the name must be one the task's
success report listed, and the stored object must lie under the job's own
prefix (``<tenant>/<job>/``), so even a forged report cannot point a tenant at
another tenant's object.
"""

# No "from __future__ import annotations": FastAPI must see the route signatures' Annotated objects.

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from dagfold.artifacts import ArtifactError, output_prefix
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext
from dagfold.services.api.errors import ApiError

PRESIGN_S = 900


def output_links(base: str, outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outputs of a task as the API shows them: the stored record plus its download path."""
    return [{**o, "download": f"{base}/outputs/{o['name']}"} for o in outputs]


def router(ctx: ApiContext, auth: Any) -> APIRouter:
    r = APIRouter(tags=["outputs"])
    Caller = Annotated[Principal, Depends(auth)]

    def find(job_id: str, task_id: str, name: str, principal: Principal) -> tuple[str, dict[str, Any]]:
        job = ctx.job_for(job_id, principal)
        task = ctx.rm.get_task(job_id, task_id)
        if task is None:
            raise ApiError(404, "not_found", f"task {task_id!r} of job {job_id!r} not found")
        out = next((o for o in task.get("outputs") or [] if o.get("name") == name), None)
        if out is None:
            raise ApiError(404, "not_found", f"task {task_id!r} of job {job_id!r} has no output {name!r}")
        store = ctx.artifact_store()
        key = store.key_of(out["uri"])
        mine = output_prefix(job["tenant"], job_id, task_id, 0).split("/")[:3]  # tenant/job/task
        if key is None or key.split("/")[:3] != mine:
            raise ApiError(404, "not_found", f"output {name!r} is not in this deployment's artifact storage")
        return key, out

    def download(job_id: str, task_id: str, name: str, principal: Principal, presign: bool) -> Any:
        key, out = find(job_id, task_id, name, principal)
        store = ctx.artifact_store()
        if presign:
            url = store.presign(key, PRESIGN_S)
            if url is None:
                raise ApiError(409, "presign_unsupported",
                               "the artifact store is a local folder: download the output from this route")
            return {"name": name, "url": url, "expires_s": PRESIGN_S, "size": out["size"], "sha256": out["sha256"]}
        size = store.size(key)
        if size is None:
            raise ApiError(404, "not_found", f"output {name!r} is no longer in artifact storage")
        chunks = store.iter_bytes(key)
        try:
            first = next(chunks, b"")  # a missing object is a 404 here, before the status line is sent
        except ArtifactError:
            raise ApiError(404, "not_found", f"output {name!r} is no longer in artifact storage") from None

        def body() -> Any:
            yield first
            yield from chunks

        filename = name.rsplit("/", 1)[-1].replace('"', "")
        return StreamingResponse(body(), media_type=out.get("content_type") or "application/octet-stream",
                                 headers={"Content-Length": str(size), "ETag": f'"{out["sha256"]}"',
                                          "Content-Disposition": f'attachment; filename="{filename}"'})

    Presign = Annotated[bool, Query(description="answer a time-limited URL of the object store instead")]

    @r.get("/v1/jobs/{job_id}/tasks/{task_id}/outputs/{name:path}",
           summary="Download an output of a task (or a presigned URL of it)",
           responses={200: {"content": {"application/octet-stream": {}}}, 404: {"description": "no such output"},
                      409: {"description": "presign asked of a local artifact folder"}})
    def task_output(job_id: str, task_id: str, name: str, principal: Caller, presign: Presign = False) -> Any:
        return download(job_id, task_id, name, principal, presign)

    @r.get("/v1/gpu-jobs/{job_id}/outputs/{name:path}",
           summary="Download an output of a GPU job (or a presigned URL of it)",
           responses={200: {"content": {"application/octet-stream": {}}}, 404: {"description": "no such output"},
                      409: {"description": "presign asked of a local artifact folder"}})
    def gpu_job_output(job_id: str, name: str, principal: Caller, presign: Presign = False) -> Any:
        job = ctx.job_for(job_id, principal)
        tasks = ctx.rm.get_tasks(job_id, limit=1).items if job.get("total_tasks") == 1 else []
        if not tasks:
            raise ApiError(404, "not_found", f"job {job_id!r} is not a GPU job (see /v1/jobs/{job_id})")
        return download(job_id, tasks[0]["task_id"], name, principal, presign)

    return r
