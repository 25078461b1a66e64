"""Errors of the HTTP API: every one is JSON ``{"error": {"code": ..., "reason": ...}}``.

One shape for all failures (validation, auth, limits, unknown routes, bugs) so
clients and the CLI print ``code: reason`` without special cases.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi import HTTPException as FastAPIHTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dagfold.exceptions import LogError, disk_full
from dagfold.projections.exceptions import InvalidCursor, StoreError

logger = logging.getLogger("dagfold.api")

STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_job",
    429: "too_many_requests",
    500: "internal_error",
    503: "unavailable",
}


class ApiError(FastAPIHTTPException):
    """An HTTP error with a machine code and a reason (and optional headers, e.g. Retry-After)."""

    def __init__(self, status: int, code: str, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, detail={"code": code, "reason": reason}, headers=headers)


def error_body(code: str, reason: str) -> dict[str, Any]:
    return {"error": {"code": code, "reason": reason}}


def not_found(job_id: str) -> ApiError:
    """The one 404 for a job that does not exist *or belongs to another tenant* (same bytes either way)."""
    return ApiError(404, "not_found", f"job {job_id!r} not found")


def storage_unavailable(request: Request, exc: BaseException) -> JSONResponse:
    """503 for a failure of the storage under the API (full disk, I/O error): the request may succeed later."""
    reason = "no space left on device" if disk_full(exc) else f"storage error: {str(exc)[:300]}"
    logger.warning("api: %s %s: %s", request.method, request.url.path, reason)
    return JSONResponse(error_body("storage_unavailable", reason), status_code=503, headers={"Retry-After": "30"})


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into the JSON error shape."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail
        if isinstance(detail, dict) and "code" in detail:
            body = {"error": detail}
        else:
            body = error_body(STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}"), str(detail))
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return JSONResponse(error_body("invalid_request", "; ".join(parts) or "invalid request"), status_code=400)

    @app.exception_handler(InvalidCursor)
    async def cursor_error(request: Request, exc: InvalidCursor) -> JSONResponse:
        return JSONResponse(error_body("invalid_cursor", str(exc)), status_code=400)

    @app.exception_handler(LogError)
    async def log_error(request: Request, exc: LogError) -> JSONResponse:
        return storage_unavailable(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        if disk_full(exc) or isinstance(exc, (OSError, StoreError)):
            return storage_unavailable(request, exc)
        logger.exception("api: unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", "internal error"), status_code=500)
