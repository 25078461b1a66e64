"""The HTTP API and web dashboard: submit and cancel jobs (commands on the log), read the read models.

Writes are commands: ``POST /v1/jobs`` validates the spec with the same rules
the scheduler applies, then produces ``SubmitJob`` to the commands topic keyed
by job ID and answers 202; the scheduler decides. Reads come from the
projector's read models, so a job appears there once the scheduler accepted
(or rejected) it and the projector caught up: poll ``GET /v1/jobs/{id}`` or
follow ``GET /v1/jobs/{id}/events``.

Also served: ``/metrics`` (Prometheus: the process's registry, so in
``dagfold up`` every component, plus gauges computed from the read models),
``/healthz``, the OpenAPI UI at ``/docs`` and the dashboard at ``/`` (static
files in ``static/``, no build step, no CDN).

Every error is JSON ``{"error": {"code": ..., "reason": ...}}``.
"""

# No "from __future__ import annotations": FastAPI must see the route signatures'
# Annotated[..., Depends(local)] objects, which string annotations would hide.

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import fastapi_offline
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dagfold import metrics
from dagfold.config import Config
from dagfold.jobspec import JobSpecIn
from dagfold.log.base import Log
from dagfold.projections.cluster import ClusterModel
from dagfold.projections.jobs import ReadModel
from dagfold.projections.operator import OperatorModel
from dagfold.services.api import auth as auth_mod
from dagfold.services.api import (
    errors,
    routes_deadletters,
    routes_gpu,
    routes_jobs,
    routes_ops,
    routes_outputs,
    routes_tenants,
)
from dagfold.services.api.admission import Admission, AdmissionConfig
from dagfold.services.api.auth import AuthConfig, Principal
from dagfold.services.api.context import ApiContext, ApiSender, LiveEntitlements
from dagfold.services.api.errors import ApiError
from dagfold.services.api.guard import BrowserGuard, GuardConfig
from dagfold.services.api.metrics_collector import ReadModelCollector
from dagfold.services.callbacks.ledger import CallbackLedger
from dagfold.services.worker.handlers import HandlerRegistry

logger = logging.getLogger("dagfold.api")
STATIC = Path(__file__).resolve().parent / "static"
# Swagger UI and ReDoc, pinned with fastapi-offline (its package data), so /docs and /redoc work offline
DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"


class RequestMetrics:
    """ASGI middleware: request count and latency by route template (never by raw path: bounded labels)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            if not route.startswith("/ui/static"):
                metrics.API_REQUESTS.labels(route, scope["method"], str(status[0])).inc()
                metrics.API_LATENCY.labels(route).observe(time.perf_counter() - started)


class ReadOnly:
    """ASGI middleware of a read-only API (``dagfold serve`` of a replayed folder): only GET, HEAD and
    OPTIONS pass; every write (a submission, a cancel, a redrive) gets a 405 naming the reason."""

    ALLOWED = frozenset({"GET", "HEAD", "OPTIONS"})

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in self.ALLOWED:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"code": "read_only", "reason": (
            "this API serves a replayed folder read-only (no scheduler, no log): submit to the live API")}}).encode()
        await send({"type": "http.response.start", "status": 405, "headers": [
            (b"content-type", b"application/json"), (b"allow", b"GET, HEAD, OPTIONS"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(log: Log | None, read_model: ReadModel, config: Config, *, max_body_bytes: int | None = None,
               auth: AuthConfig | None = None, admission: AdmissionConfig | None = None,
               sse_poll_s: float = 0.25, callbacks: CallbackLedger | None = None,
               read_only: bool = False, guard: GuardConfig | None = None,
               handlers: HandlerRegistry | None = None) -> FastAPI:
    """The API over ``log`` (commands out) and ``read_model`` (queries in).

    ``auth`` defaults to ``AuthConfig.from_env()`` (``DAGFOLD_AUTH_FILE``,
    ``DAGFOLD_API_KEYS``; none: open). ``admission`` defaults to the
    ``DAGFOLD_SUBMIT_*`` environment with the auth file's per-tenant limits.
    ``max_body_bytes`` defaults to the submission limit ``config.scheduler.limits.max_spec_bytes``.
    ``callbacks``: the callback notifier's ledger, when it runs in this process (GPU job status shows
    delivery states from it).
    ``read_only`` (``log`` may then be None): reads only, every write refused with 405 ``read_only``.
    ``guard`` (Host, cross-origin writes, local token: ``services/api/guard.py``) defaults to
    ``GuardConfig.from_env(config.api_host)``.
    ``handlers``: the workers' registry when they run in this process (submissions naming another
    handler are refused, custom handlers' argument checks run). At start (lifespan) the auth file's
    tenant settings are written through the log (not when ``read_only``).
    """
    if log is None and not read_only:
        raise ValueError("an API without a log must be read-only")
    auth_config = auth if auth is not None else AuthConfig.from_env()
    adm_config = admission if admission is not None else AdmissionConfig.from_env(auth_config.limits)
    ops = OperatorModel(read_model.store)
    ctx = ApiContext(
        log=log, rm=read_model, config=config, sender=ApiSender(log), auth=auth_config,
        admission=Admission(adm_config, ops.open_jobs, lambda j: read_model.get_job(j) is not None),
        body_limit=max_body_bytes if max_body_bytes is not None else config.scheduler.limits.max_spec_bytes,
        sse_poll_s=sse_poll_s, callbacks=callbacks, handlers=handlers,
    )
    if admission is None:  # the tenants' limits as set through the log (admin API), else the auth file's
        ctx.admission.config = replace(adm_config, tenants=LiveEntitlements(ctx))
    principal = auth_mod.dependency(auth_config)
    local_registry = CollectorRegistry(auto_describe=False)
    local_registry.register(ReadModelCollector(ops, ClusterModel(read_model.store)))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not read_only:
            await run_in_threadpool(routes_tenants.publish_auth_file, ctx)
        yield
        ctx.sender.close()

    app = FastAPI(
        title="dagfold",
        version="0.1.0",
        description="Event-sourced scheduler for DAG and GPU jobs. Submissions are commands: a 202 means the job "
        "was queued for the scheduler; poll GET /v1/jobs/{job_id} or follow GET /v1/jobs/{job_id}/events. "
        "With API keys configured, send Authorization: Bearer <key> (or X-API-Key); a tenant key sees only "
        "its tenant's jobs.",
        lifespan=lifespan,
        docs_url=None,  # served below from local files: FastAPI's own pages load Swagger UI and ReDoc from a CDN
        redoc_url=None,
    )
    app.state.ctx = ctx
    app.state.sender = ctx.sender
    app.add_middleware(BrowserGuard, config=guard if guard is not None else GuardConfig.from_env(config.api_host),
                       keys_enabled=auth_config.enabled)
    app.add_middleware(RequestMetrics)
    if read_only:
        app.add_middleware(ReadOnly)
    errors.install(app)

    @app.get("/healthz", tags=["ops"], summary="Liveness")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "read_only": True} if read_only else {"status": "ok"}

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics (an admin key when auth is on)",
             response_class=Response,
             responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}})
    def prometheus(caller: Annotated[Principal, Depends(principal)], request: Request) -> Response:
        if not caller.admin:
            raise ApiError(403, "forbidden", "metrics need an admin key")
        if "application/openmetrics-text" in request.headers.get("accept", ""):  # with exemplars (trace IDs)
            body = openmetrics.generate_latest(REGISTRY).removesuffix(b"# EOF\n")
            return Response(body + openmetrics.generate_latest(local_registry),
                            media_type=openmetrics.CONTENT_TYPE_LATEST)
        return Response(generate_latest(REGISTRY) + generate_latest(local_registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(routes_jobs.router(ctx, principal))
    app.include_router(routes_gpu.router(ctx, principal))
    app.include_router(routes_outputs.router(ctx, principal))
    app.include_router(routes_ops.router(ctx, principal))
    app.include_router(routes_deadletters.router(ctx, principal))
    app.include_router(routes_tenants.router(ctx, principal))

    # -- API docs without a CDN: Swagger UI and ReDoc bundles from fastapi-offline's package data (MIT) ----
    app.mount("/ui/docs-assets", StaticFiles(directory=DOCS_ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="dagfold API",
                                   swagger_js_url="/ui/docs-assets/swagger-ui-bundle.js",
                                   swagger_css_url="/ui/docs-assets/swagger-ui.css",
                                   swagger_favicon_url="/ui/docs-assets/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="dagfold API",
                              redoc_js_url="/ui/docs-assets/redoc.standalone.js",
                              redoc_favicon_url="/ui/docs-assets/favicon.png", with_google_fonts=False)

    # -- dashboard: static files, hash-routed single page ---------------------------------
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/ui/", include_in_schema=False)
    @app.get("/ui/{path:path}", include_in_schema=False)
    def ui(path: str = "") -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    # -- OpenAPI: document the schemas the raw-body endpoints accept -------
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (JobSpecIn, routes_gpu.GpuJobIn):
                body_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(jsonable_encoder(body_schema.pop("$defs", {})))
                components[model.__name__] = body_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    return app
