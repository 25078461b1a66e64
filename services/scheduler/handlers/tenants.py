"""Handler of a tenant's settings: SetTenantEntitlements."""

from __future__ import annotations

from dagfold.codec import Record
from dagfold.services.scheduler.appliers import read_tenant
from dagfold.services.scheduler.context import Ctx
from dagfold.services.scheduler.exceptions import InvalidSettingsError
from dagfold.services.scheduler.handlers.registry import handles
from dagfold.tenants import Entitlements, EntitlementsError, settings_unchanged


@handles("dagfold.command.SetTenantEntitlements")
def set_tenant_entitlements(ctx: Ctx, cmd: Record) -> None:
    """Store a tenant's settings on this partition (each partition gets its own copy of the command).

    Settings that do not parse are dropped with an exception (the runner dead-letters the command);
    the auth file's settings, re-sent at every API start, are a no-op when the file did not change.
    """
    try:
        ent = Entitlements.parse(cmd["entitlements"], f"tenant {cmd['tenant'][:60]!r}")
    except EntitlementsError as exc:
        raise InvalidSettingsError(str(exc)) from None
    rec = ent.to_record()
    if settings_unchanged(read_tenant(ctx.txn, cmd["tenant"]), rec, cmd["source"]):
        return  # e.g. the file's settings were applied before; later admin changes stand
    ctx.event("TenantEntitlementsSet", cmd["job_id"], tenant=cmd["tenant"], entitlements=rec, source=cmd["source"])
