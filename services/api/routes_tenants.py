"""Routes of tenant entitlements: read them (the tenant itself or an admin), set them (an admin).

Setting them writes ``SetTenantEntitlements`` to every partition of the
commands topic (``dagfold.commands.set_tenant_entitlements``) and of
``allocator.commands`` (each GPU pool's allocator folds its copy: weights and
quotas change live): each scheduler
partition folds its copy (an upstream producer's SubmitJob is checked against
it), the projector shows it to every API instance, and a replay sees the same
settings at the same point of the log. The auth file's ``tenants:`` section is
written the same way when the API starts (``publish_auth_file``).
"""

# No "from __future__ import annotations": FastAPI must see the route signatures'
# Annotated[..., Depends(local)] objects, which string annotations would hide.

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path
from fastapi.concurrency import run_in_threadpool

from dagfold.commands import set_allocator_entitlements, set_tenant_entitlements
from dagfold.config import ALLOCATOR_COMMANDS, COMMANDS
from dagfold.exceptions import LogError
from dagfold.rules import RULES
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext
from dagfold.services.api.errors import ApiError
from dagfold.tenants import Entitlements, EntitlementsError

logger = logging.getLogger("dagfold.api")
TenantName = Annotated[str, Path(min_length=1, max_length=RULES["tenant"].max_len, pattern=RULES["tenant"].pattern)]


def send_entitlements(ctx: ApiContext, tenant: str, ent: Entitlements, source: str) -> None:
    """One SetTenantEntitlements per partition of the commands topic (the schedulers), and one per partition
    of ``allocator.commands`` (the GPU allocators: weights and quotas)."""
    if ctx.log is None:
        raise ApiError(405, "read_only", "this API is read-only: it has no command log")
    try:
        partitions = ctx.log.partitions(COMMANDS)
        pool_partitions = ctx.log.partitions(ALLOCATOR_COMMANDS)
    except LogError as exc:
        raise ApiError(503, "log_unavailable", f"the command log is unavailable: {exc}") from None
    rec = ent.to_record()
    for cmd in set_tenant_entitlements(tenant, rec, partitions, source, ctx.log.partition_for):
        ctx.sender.send(cmd, cmd["job_id"])
    for cmd in set_allocator_entitlements(tenant, rec, pool_partitions, source, ctx.log.partition_for):
        ctx.sender.send(cmd, cmd["pool"], ALLOCATOR_COMMANDS)


def publish_auth_file(ctx: ApiContext) -> None:
    """The auth file's tenants, through the log (the scheduler ignores settings the file already gave)."""
    for tenant, ent in sorted(ctx.auth.tenants().items()):
        try:
            send_entitlements(ctx, tenant, ent, "auth_file")
        except ApiError as exc:
            logger.warning("cannot write tenant %r's settings to the log: %s", tenant, exc.detail)
            return


def router(ctx: ApiContext, auth: Any) -> APIRouter:
    r = APIRouter(tags=["tenants"])
    Caller = Annotated[Principal, Depends(auth)]

    @r.get("/v1/tenants/{tenant}/entitlements", summary="A tenant's entitlements (its own key or an admin key)")
    def get_entitlements(tenant: TenantName, principal: Caller) -> dict[str, Any]:
        if not principal.can_see(tenant):
            raise ApiError(403, "forbidden", "a tenant key reads only its own tenant's entitlements")
        ent = ctx.entitlements(tenant)
        stored = ctx.rm.tenant_settings(tenant)
        return {"tenant": tenant, "entitlements": (ent.to_record() if ent is not None else None),
                "source": stored["source"] if stored is not None else ("auth_file" if ent is not None else None)}

    @r.put("/v1/tenants/{tenant}/entitlements", status_code=202,
           summary="Set a tenant's entitlements (admin): written through the log to every scheduler partition",
           responses={400: {"description": "Malformed settings"}, 403: {"description": "Not an admin key"}})
    async def put_entitlements(tenant: TenantName, principal: Caller,
                               body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        if not principal.admin:
            raise ApiError(403, "forbidden", "setting entitlements needs an admin key")
        try:
            ent = Entitlements.parse(body, f"tenant {tenant!r}")
        except EntitlementsError as exc:
            raise ApiError(400, "invalid_entitlements", str(exc)) from None
        await run_in_threadpool(send_entitlements, ctx, tenant, ent, "admin_api")
        return {"tenant": tenant, "entitlements": ent.to_record(), "state": "submitted"}

    return r
