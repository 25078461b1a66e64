"""Routes for operators: stuck tasks, queues, tenants, failure reasons, the GPU cluster.

All read the operator and cluster read models. A tenant key sees its own
share of each (its stuck tasks, its queue counts, its usage, its GPUs); other
tenants' work appears only as anonymous totals, never as job IDs or names.
"""

# No "from __future__ import annotations": FastAPI must see the route signatures'
# Annotated[..., Depends(local)] objects, which string annotations would hide.

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from dagfold.clock import now_ms
from dagfold.projections.keys import Record
from dagfold.projections.operator import open_job_count
from dagfold.services.api.auth import Principal
from dagfold.services.api.context import ApiContext, parse_time_ms

NODE_SCAN_LIMIT = 20_000


def _redact_node(node: Record, principal: Principal) -> Record:
    """A node as a tenant sees it: its own allocations by ID, everyone else's as one anonymous count."""
    if principal.admin:
        return node
    own = principal.tenant or ""
    tenants = node.get("tenants") or {}
    others = sum(n for t, n in tenants.items() if t != own)
    shown = {own: tenants[own]} if own in tenants else {}
    if others:
        shown["other"] = others
    allocs = {a: x for a, x in (node.get("allocations") or {}).items() if x.get("tenant") == own}
    return {**node, "tenants": shown, "allocations": allocs}


def router(ctx: ApiContext, auth: Any) -> APIRouter:
    r = APIRouter(tags=["operations"])
    Caller = Annotated[Principal, Depends(auth)]

    @r.get("/v1/stuck", summary="Tasks past their lease, start-to-close, schedule-to-start or backoff deadline")
    def stuck(
        principal: Caller,
        grace_s: Annotated[float, Query(ge=0, le=86400, description="ignore deadlines passed less than this")] = 5.0,
        queued_longer_than_s: Annotated[float | None, Query(ge=0, le=10**7, description=(
            "also list runnable tasks waiting longer than this, with or without a schedule-to-start limit"))] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        now = now_ms()
        items = ctx.ops.stuck(now, grace_ms=int(grace_s * 1000), tenant=None if principal.admin else principal.tenant,
                              limit=limit, queued_longer_than_ms=None if queued_longer_than_s is None
                              else int(queued_longer_than_s * 1000))
        return {"now_ms": now, "tasks": items}

    @r.get("/v1/queues", summary="Dispatch queues: runnable (depth), running and retrying tasks, oldest wait")
    def queues(principal: Caller) -> dict[str, Any]:
        now = now_ms()
        out = []
        for q in ctx.ops.queues(None if principal.admin else principal.tenant):
            item: dict[str, Any] = {**q, "depth": q["runnable"]}
            if principal.admin:
                oldest = ctx.ops.oldest_runnable_ms(q["queue"])
                item["oldest_runnable_ms"] = oldest
                item["oldest_runnable_age_s"] = None if oldest is None else round(max(now - oldest, 0) / 1000, 3)
            out.append(item)
        return {"now_ms": now, "queues": out}

    @r.get("/v1/tenants", summary="Tenants: jobs and tasks by state, running tasks, GPU use and shares")
    def tenants(principal: Caller) -> dict[str, Any]:
        usage = {u["tenant"]: u for u in ctx.ops.tenants()}
        gpu = {t["tenant"]: t for t in ctx.cluster.tenants()}
        cluster_on = ctx.cluster.totals() is not None
        running_total = sum(u["tasks"].get("running", 0) for u in usage.values())
        gpus_total = sum(max(t["gpus"], 0) for t in gpu.values())
        out = []
        for name in sorted(set(usage) | set(gpu)):
            if not principal.can_see(name):
                continue
            u = usage.get(name) or {"jobs": {}, "tasks": {}, "retries": 0, "failures": 0, "lease_expiries": 0}
            g = gpu.get(name) or {}
            running = u["tasks"].get("running", 0)
            rate, burst, cap = ctx.admission.config.limits(name)
            out.append({
                "tenant": name, "jobs": u["jobs"], "tasks": u["tasks"], "running_tasks": running,
                "open_jobs": open_job_count(u["jobs"]), "retries": u["retries"], "failures": u["failures"],
                "lease_expiries": u["lease_expiries"], "worker_losses": u.get("worker_losses", 0),
                "redispatches": u.get("redispatches", 0),
                "gpus": g.get("gpus", 0) if cluster_on else None,
                "gpus_queued": g.get("queued_gpus", 0) if cluster_on else None,
                "share": {
                    "running_tasks": round(running / running_total, 4) if running_total else 0.0,
                    "gpus": (round(g.get("gpus", 0) / gpus_total, 4) if gpus_total else 0.0) if cluster_on else None,
                    "weight": g.get("weight"), "dominant_share": g.get("share"),
                },
                "limits": {"rate_per_s": rate, "burst": burst, "max_open_jobs": cap},
            })
        return {"tenants": out, "cluster": cluster_on}

    @r.get("/v1/failures", summary="Failure reasons by class, and the most recent failed attempts")
    def failures(
        principal: Caller,
        since: Annotated[str | None, Query(description="ms since epoch or ISO 8601")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    ) -> dict[str, Any]:
        tenant = None if principal.admin else principal.tenant
        return {"reasons": ctx.ops.failure_reasons(tenant),
                "recent": ctx.ops.recent_failures(tenant, limit=limit, since_ms=parse_time_ms(since, "since"))}

    @r.get("/v1/cluster", summary="GPU cluster occupancy (empty until the GPU allocator writes events)")
    def cluster(principal: Caller) -> dict[str, Any]:
        tot = ctx.cluster.totals()
        if tot is None:
            return {"available": False, "reason": "no GPU allocator events projected yet",
                    "totals": None, "pools": [], "gpu_types": [], "tenants": []}
        pools: dict[str, dict[str, int]] = {}
        types: dict[str, dict[str, int]] = {}
        for n in ctx.cluster.nodes(limit=1000).items if tot["nodes"] > NODE_SCAN_LIMIT else _all_nodes(ctx):
            if n["health"] == "removed":
                continue
            for group, name in ((pools, n.get("pool") or "default"), (types, n.get("gpu_type") or "unknown")):
                g = group.setdefault(str(name), {"nodes": 0, "gpus": 0, "allocated": 0, "unhealthy_nodes": 0})
                g["nodes"] += 1
                g["gpus"] += n["gpus"]
                g["allocated"] += n["allocated"]
                g["unhealthy_nodes"] += n["health"] not in ("healthy", "ok", "up", "ready", "active", "available")
        healthy = tot["healthy_gpus"]
        totals = {**tot, "free": max(healthy - tot["allocated"], 0),
                  "allocation_ratio": round(tot["allocated"] / healthy, 4) if healthy else 0.0}
        tenants = [t for t in ctx.cluster.tenants() if principal.can_see(t["tenant"])]
        return {"available": True, "totals": totals,
                "pools": [{"pool": k, **v} for k, v in sorted(pools.items())],
                "gpu_types": [{"gpu_type": k, **v} for k, v in sorted(types.items())], "tenants": tenants}

    @r.get("/v1/cluster/nodes", summary="GPU nodes: capacity, health, allocated GPUs per tenant")
    def nodes(
        principal: Caller,
        pool: Annotated[str | None, Query(max_length=200)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        page = ctx.cluster.nodes(limit=limit, cursor=cursor, pool=pool)
        return {"nodes": [_redact_node(n, principal) for n in page.items], "next_cursor": page.next_cursor}

    return r


def _all_nodes(ctx: ApiContext) -> list[Record]:
    out: list[Record] = []
    cursor = None
    while True:
        page = ctx.cluster.nodes(limit=1000, cursor=cursor)
        out += page.items
        cursor = page.next_cursor
        if cursor is None:
            return out
