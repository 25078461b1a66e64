"""GPU cluster occupancy, folded from the GPU allocator's events.

The allocator (``services/allocator``, one writer per pool) owns the node
inventory and the allocations; this model mirrors them for the API, the
dashboard and the metrics. Until the allocator writes events the model is
empty, and ``/v1/cluster`` says so (``available: false``) instead of showing
made-up capacity.

Events read (``dagfold.allocator.*`` on the ``allocator.events`` topic, keyed
by pool; schemas in ``schemas/dagfold.allocator.*.avsc``):

* nodes: ``NodeRegistered`` (capacity, GPU type; the node is up),
  ``NodeHeartbeatRecorded`` (health as judged: ok, throttled, ecc_errors, xid,
  slow; relative ``perf``), ``NodeDrained`` (``lost``: stopped heartbeating;
  else a gray failure), ``NodeRestored``;
* allocations: ``AllocationGranted`` (``alloc_id``, job, task, tenant, tier,
  ``hosts``: node and GPU indices), ``PreemptionRequested`` (marks it),
  ``AllocationReleased`` and ``AllocationExpired`` (free it);
* the GPU queue: ``RequestQueued`` (a request waits, per tenant and tier),
  removed by its grant, ``RequestCancelled`` or ``RequestRejected``.

Fields are looked up leniently (``node_id``|``host``, ``gpus``|``gpu_count``,
``hosts``|``placements``|``node_ids``, ...) and unknown types are ignored, so
the allocator's schemas can grow without breaking the read model; a node's
``health`` is ``healthy``, the reported problem (``throttled``, ...), or its
state (``drained``, ``lost``). Only healthy nodes count as capacity.

Key space (``c`` prefixes, see ``dagfold.projections.keys``)::

    cn node     -> node (capacity, health, allocated GPUs, GPUs per tenant, its allocations, utilisation)
    ca alloc    -> allocation (job, task, tenant, tier, [node, gpus] placements, preemption)
    cq request  -> a queued GPU request (job/task/attempt: tenant, tier, GPUs asked)
    cT tenant   -> tenant GPU usage (allocated, queued), weight and share if the allocator reports them
    cs          -> totals (nodes, GPUs, allocated, healthy, queued requests and GPUs, events seen)
"""

from __future__ import annotations

from typing import Any

from dagfold.projections.keys import SEP, Page, Record, clamp_limit, decode_cursor, key, paginate, part
from dagfold.projections.store import ReadModelStore, ReadModelTxn, decode_value

PREFIX = "dagfold.allocator."
NODE = b"cn"
ALLOC = b"ca"
TENANT = b"cT"
QUEUED = b"cq"
TOTALS = b"cs"
HEALTHY = frozenset({"healthy", "ok", "up", "ready", "active", "available"})
_DOWN_EVENTS = {"NodeDrained": "drained", "NodeDraining": "draining", "NodeLost": "lost",
                "NodeRemoved": "removed", "NodeFailed": "lost", "NodeDown": "lost"}
_UP_EVENTS = frozenset({"NodeRegistered", "NodeRestored"})
_QUEUE_DONE = frozenset({"RequestCancelled", "RequestRejected"})
_GRANT = frozenset({"AllocationGranted", "GangAllocated", "Allocated", "AllocationCreated"})
_RELEASE = frozenset({"AllocationReleased", "AllocationRevoked", "AllocationExpired",
                      "AllocationCancelled", "Released", "Preempted", "AllocationFreed"})


def _first(ev: Record, *names: str, default: Any = None) -> Any:
    for n in names:
        v = ev.get(n)
        if v is not None:
            return v
    return default


def _node_id(ev: Record) -> str | None:
    v = _first(ev, "node_id", "host", "node", "hostname")
    return None if v is None else str(v)


def _totals(txn: ReadModelTxn) -> Record:
    t: Record | None = txn.get(TOTALS)
    return t if t is not None else {"nodes": 0, "gpus": 0, "healthy_gpus": 0, "allocated": 0, "queued": 0,
                                    "queued_gpus": 0, "events": 0, "last_ms": None}


def _new_node(node_id: str) -> Record:
    return {"node_id": node_id, "pool": None, "gpus": 0, "gpu_type": None, "health": "healthy", "state": "up",
            "reported": "ok", "reason": None, "allocated": 0, "tenants": {}, "allocations": {}, "utilization": None,
            "perf": None, "lease_deadline_ms": None, "updated_ms": None}


def _effective_health(node: Record) -> str:
    """``healthy``, the problem the node reports (throttled, ...), or its state (drained, lost, removed)."""
    if node.get("state", "up") != "up":
        return str(node["state"])
    reported = str(node.get("reported") or "ok").lower()
    return "healthy" if reported in HEALTHY else reported


def _healthy(node: Record) -> bool:
    return str(node["health"]).lower() in HEALTHY


def _capacity(node: Record) -> tuple[int, int, int]:
    """(present, GPUs counted, healthy GPUs) of a node, for the totals."""
    if node["health"] == "removed":
        return 0, 0, 0
    healthy = max(int(node["gpus"]) - len(node.get("cordoned_gpus") or []), 0)
    return 1, int(node["gpus"]), healthy if _healthy(node) else 0


def _save_node(txn: ReadModelTxn, tot: Record, before: tuple[int, int, int], node: Record) -> None:
    after = _capacity(node)
    tot["nodes"] += after[0] - before[0]
    tot["gpus"] += after[1] - before[1]
    tot["healthy_gpus"] += after[2] - before[2]
    txn.put(key(NODE, part(node["node_id"])), node)


def _util(ev: Record) -> float | None:
    u = _first(ev, "gpu_util", "utilization", "gpu_utilization")
    if isinstance(u, list) and u:
        u = sum(float(x) for x in u) / len(u)
    if not isinstance(u, int | float):
        return None
    u = float(u)
    return round(u / 100.0 if u > 1.0 else u, 4)


def _node_event(txn: ReadModelTxn, tot: Record, short: str, ev: Record, ts: int | None) -> None:
    nid = _node_id(ev)
    if nid is None:
        return
    nk = key(NODE, part(nid))
    existing = txn.get(nk)
    node = existing or _new_node(nid)
    before = _capacity(node) if existing is not None else (0, 0, 0)
    gpus = _first(ev, "gpus", "gpu_count", "total_gpus")
    if isinstance(gpus, list):
        gpus = len(gpus)
    if isinstance(gpus, int):
        node["gpus"] = gpus
    node["pool"] = _first(ev, "pool", default=node["pool"])
    gtype = _first(ev, "gpu_type", "model")
    if gtype is not None:
        node["gpu_type"] = gtype if isinstance(gtype, str) else ",".join(map(str, gtype))
    if short in _DOWN_EVENTS:
        lost = ev.get("lost")
        node["state"] = "lost" if lost is True else ("drained" if lost is False else _DOWN_EVENTS[short])
        node["reason"] = ev.get("reason")
    elif short in _UP_EVENTS:
        node["state"] = "up"
        node["reason"] = None
        if short == "NodeRegistered":
            node["reported"] = "ok"
            node["cordoned_gpus"] = []  # a new incarnation: its GPUs are judged afresh
    health = _first(ev, "health", "status", "healthy")
    if isinstance(health, bool):
        health = "ok" if health else "degraded"
    if health is not None:
        node["reported"] = str(health).lower()
    util = _util(ev)
    if util is not None:
        node["utilization"] = util
    if isinstance(ev.get("cordoned_gpus"), list):  # GPUs cordoned one by one (the rest of the node serves)
        node["cordoned_gpus"] = list(ev["cordoned_gpus"])
    if isinstance(ev.get("perf"), int | float):
        node["perf"] = float(ev["perf"])
    if ev.get("lease_deadline_ms") is not None:
        node["lease_deadline_ms"] = ev["lease_deadline_ms"]
    node["health"] = _effective_health(node)
    node["updated_ms"] = ts
    _save_node(txn, tot, before, node)


def _placements(ev: Record) -> list[tuple[str, int]]:
    raw = _first(ev, "hosts", "placements", "nodes", "node_ids", default=[])
    per_host = _first(ev, "gpus_per_host", "gpus", default=0)
    out: list[tuple[str, int]] = []
    for p in raw if isinstance(raw, list) else []:
        if isinstance(p, dict):
            nid = _node_id(p)
            g = _first(p, "gpus", "gpu_count", "gpu_indices", default=0)
            n = len(g) if isinstance(g, list) else int(g)
            if p.get("gpu_milli") == 0:
                n = 0  # a CPU-only share of the host
        else:
            nid, n = str(p), int(per_host) if isinstance(per_host, int) else 0
        if nid is not None:
            out.append((nid, n))
    return out


def _alloc_id(ev: Record) -> str | None:
    aid = _first(ev, "allocation_id", "alloc_id", "lease_id")
    if aid is not None:
        return str(aid)
    if ev.get("job_id") is None:
        return None
    return f"{ev['job_id']}/{ev.get('task_id') or ''}/{ev.get('attempt') or ''}"


def _tenant_delta(txn: ReadModelTxn, tenant: str, gpus: int, allocs: int) -> None:
    tk = key(TENANT, part(tenant))
    rec = txn.get(tk) or {"tenant": tenant, "gpus": 0, "allocations": 0, "weight": None, "share": None}
    rec["gpus"] += gpus
    rec["allocations"] += allocs
    txn.put(tk, rec)


def _node_alloc(txn: ReadModelTxn, tot: Record, nid: str, aid: str, tenant: str, gpus: int, job_id: Any = None) -> None:
    """Add (``gpus`` > 0) or remove (< 0) an allocation's GPUs on one node."""
    nk = key(NODE, part(nid))
    existing = txn.get(nk)
    node = existing or _new_node(nid)
    before = _capacity(node) if existing is not None else (0, 0, 0)
    node["allocated"] += gpus
    node["tenants"][tenant] = node["tenants"].get(tenant, 0) + gpus
    if node["tenants"][tenant] <= 0:
        del node["tenants"][tenant]
    if gpus > 0:
        node["allocations"][aid] = {"tenant": tenant, "gpus": gpus, "job_id": job_id}
    else:
        node["allocations"].pop(aid, None)
    tot["allocated"] += gpus
    _save_node(txn, tot, before, node)


def _request_id(ev: Record) -> str | None:
    if ev.get("job_id") is None:
        return None
    return f"{ev['job_id']}/{ev.get('task_id') or ''}/{ev.get('attempt') or 0}"


def _tenant_queue_delta(txn: ReadModelTxn, tenant: str, requests: int, gpus: int) -> None:
    tk = key(TENANT, part(tenant))
    rec = txn.get(tk) or {"tenant": tenant, "gpus": 0, "allocations": 0, "weight": None, "share": None}
    rec["queued"] = rec.get("queued", 0) + requests
    rec["queued_gpus"] = rec.get("queued_gpus", 0) + gpus
    txn.put(tk, rec)


def _queued(txn: ReadModelTxn, tot: Record, ev: Record, ts: int | None) -> None:
    rid = _request_id(ev)
    if rid is None or txn.get(key(QUEUED, part(rid))) is not None:
        return
    tenant = str(_first(ev, "tenant", default="default"))
    gpus = int(ev.get("gpus") or 0) * max(int(ev.get("hosts") or 1), 1)
    txn.put(key(QUEUED, part(rid)), {"request": rid, "job_id": ev["job_id"], "task_id": ev.get("task_id"),
                                     "tenant": tenant, "tier": ev.get("tier"), "gpus": gpus,
                                     "gpu_type": ev.get("gpu_type") or [], "requeued": bool(ev.get("requeued")),
                                     "queued_ms": ts, "submitted_ms": ev.get("submitted_ms")})
    tot["queued"] += 1
    tot["queued_gpus"] += gpus
    _tenant_queue_delta(txn, tenant, 1, gpus)


def _dequeue(txn: ReadModelTxn, tot: Record, ev: Record) -> None:
    rid = _request_id(ev)
    if rid is None:
        return
    qk = key(QUEUED, part(rid))
    req = txn.get(qk)
    if req is None:
        return
    txn.delete(qk)
    tot["queued"] -= 1
    tot["queued_gpus"] -= int(req["gpus"])
    _tenant_queue_delta(txn, req["tenant"], -1, -int(req["gpus"]))


def _preempting(txn: ReadModelTxn, ev: Record) -> None:
    aid = _alloc_id(ev)
    if aid is None:
        return
    ak = key(ALLOC, part(aid))
    alloc = txn.get(ak)
    if alloc is not None:
        alloc.update(preempting=True, grace_deadline_ms=ev.get("grace_deadline_ms"), preempt_reason=ev.get("reason"))
        txn.put(ak, alloc)


def _grant(txn: ReadModelTxn, tot: Record, ev: Record, ts: int | None) -> None:
    _dequeue(txn, tot, ev)
    aid = _alloc_id(ev)
    if aid is None or txn.get(key(ALLOC, part(aid))) is not None:
        return  # unknown or already granted: a repeat changes nothing
    tenant = str(_first(ev, "tenant", default="default"))
    places = _placements(ev)
    for nid, n in places:
        _node_alloc(txn, tot, nid, aid, tenant, n, ev.get("job_id"))
    total = sum(n for _, n in places)
    _tenant_delta(txn, tenant, total, 1)
    txn.put(key(ALLOC, part(aid)), {"allocation_id": aid, "job_id": ev.get("job_id"), "task_id": ev.get("task_id"),
                                    "tenant": tenant, "tier": ev.get("tier"), "gpus": total,
                                    "placements": [[nid, n] for nid, n in places], "granted_ms": ts,
                                    "preempting": False})


def _release(txn: ReadModelTxn, tot: Record, ev: Record) -> None:
    aid = _alloc_id(ev)
    if aid is None:
        return
    ak = key(ALLOC, part(aid))
    alloc = txn.get(ak)
    if alloc is None:
        return
    for nid, n in alloc["placements"]:
        _node_alloc(txn, tot, nid, aid, alloc["tenant"], -int(n))
    _tenant_delta(txn, alloc["tenant"], -int(alloc["gpus"]), -1)
    txn.delete(ak)


def _share(txn: ReadModelTxn, ev: Record) -> None:
    tenant = ev.get("tenant")
    if tenant is None:
        return
    tk = key(TENANT, part(str(tenant)))
    rec = txn.get(tk) or {"tenant": str(tenant), "gpus": 0, "allocations": 0, "weight": None, "share": None}
    rec["weight"] = _first(ev, "weight", default=rec["weight"])
    rec["share"] = _first(ev, "dominant_share", "share", default=rec["share"])
    txn.put(tk, rec)


def apply(txn: ReadModelTxn, ev: Record) -> bool:
    """Fold one allocator event into ``txn``; False if it is not an allocator event."""
    t = str(ev.get("type", ""))
    if not t.startswith(PREFIX):
        return False
    short = t.rsplit(".", 1)[-1]
    ts = _first(ev, "ts_ms", "timestamp_ms", "at_ms")
    tot = _totals(txn)
    if short.startswith("Node"):
        _node_event(txn, tot, short, ev, ts)
    elif short in _GRANT:
        _grant(txn, tot, ev, ts)
    elif short in _RELEASE:
        _release(txn, tot, ev)
    elif short == "RequestQueued":
        _queued(txn, tot, ev, ts)
    elif short in _QUEUE_DONE:
        _dequeue(txn, tot, ev)
    elif short == "PreemptionRequested":
        _preempting(txn, ev)
    elif "Share" in short:
        _share(txn, ev)
    tot["events"] += 1
    if isinstance(ts, int):
        tot["last_ms"] = ts
    txn.put(TOTALS, tot)
    return True


class ClusterModel:
    """Queries over the cluster model; safe from any thread."""

    def __init__(self, store: ReadModelStore) -> None:
        self.store = store

    def totals(self) -> Record | None:
        """Totals, or None when no allocator event was ever projected."""
        tot: Record | None = self.store.get(TOTALS)
        return tot

    def nodes(self, limit: int = 1000, cursor: str | None = None, pool: str | None = None) -> Page:
        prefix = NODE + SEP
        after = decode_cursor(cursor, prefix) if cursor else None

        def rows() -> Any:
            for k, v in self.store.scan(prefix, after=after):
                node = decode_value(v)
                yield k, (node if pool is None or node.get("pool") == pool else None)

        return paginate(rows(), clamp_limit(limit))

    def tenants(self) -> list[Record]:
        return [decode_value(v) for _, v in self.store.scan(TENANT + SEP)]

    def queued(self, limit: int = 1000) -> list[Record]:
        """Queued GPU requests (bounded by ``limit``)."""
        out = []
        for _, v in self.store.scan(QUEUED + SEP):
            out.append(decode_value(v))
            if len(out) >= limit:
                break
        return out

    def allocations_of(self, tenant: str, limit: int = 1000) -> list[Record]:
        """Allocations of one tenant (a scan of the allocations: bounded by the running GPU jobs)."""
        out = []
        for _, v in self.store.scan(ALLOC + SEP):
            a = decode_value(v)
            if a["tenant"] == tenant:
                out.append(a)
                if len(out) >= limit:
                    break
        return out
