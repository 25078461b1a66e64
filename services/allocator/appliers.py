"""Event appliers: the only code that changes allocator state.

Each event is applied at once when a processor emits it (later decisions in
the same command see it) and again, alone, on replay. Appliers read only the
event and the state, never a command or a clock, so replaying the
``allocator.events`` partition of a pool rebuilds its state byte for byte.
Every applier touches O(hosts of the allocation) records.
"""

from __future__ import annotations

from collections.abc import Callable

from dagfold.codec import Record
from dagfold.services.allocator import keys
from dagfold.services.allocator.model import FULL, AllocView, NodeView, Part, RequestView
from dagfold.services.allocator.profile import active_classes, drift, shape_key, should_refresh
from dagfold.services.allocator.state import PoolState
from dagfold.tenants import stored_settings

A = "dagfold.allocator."
Applier = Callable[[PoolState, Record], None]


def _node_registered(st: PoolState, e: Record) -> None:
    nid = e["node_id"]
    new = nid not in st.nodes
    n = NodeView(nid, e["gpu_type"], e["gpus"], e["cpu_milli"], e["memory_mib"], e["incarnation"],
                 e["lease_deadline_ms"])
    st.put_node(n)
    st.register_type(n, new)
    st.set_timer("lease", nid, e["lease_deadline_ms"])


def _heartbeat(st: PoolState, e: Record) -> None:
    n = st.nodes.get(e["node_id"])
    if n is None:
        return
    n.lease_until = e["lease_deadline_ms"]
    n.health = e["health"]
    n.ok_streak = n.ok_streak + 1 if e["health"] == "ok" else 0
    cordoned = [i for i in e.get("cordoned_gpus") or [] if 0 <= i < len(n.free)]
    if cordoned != n.cordoned:  # per-GPU cordon: FULL withheld from each cordoned GPU's free milli
        for i in set(n.cordoned) - set(cordoned):
            n.free[i] += FULL
        for i in set(cordoned) - set(n.cordoned):
            n.free[i] -= FULL
        n.cordoned = cordoned
        st.put_node(n)
    else:
        st.put_node(n, capacity_changed=False)
    st.set_timer("lease", n.id, n.lease_until)
    for c in e["checkpoints"]:
        a = st.allocs.get(c["alloc_id"])
        if a is not None:
            a.last_ckpt_ms = c["last_checkpoint_ms"]
            a.last_ckpt_uri = c["checkpoint_uri"]
            st.put_ckpt(a)
    perf = e["perf"]
    if perf is not None and e["health"] == "ok":
        avg = st.perf.get(n.gpu_type)
        st.put_perf(n.gpu_type, perf if avg is None else 0.98 * avg + 0.02 * perf)


def _node_drained(st: PoolState, e: Record) -> None:
    n = st.nodes.get(e["node_id"])
    if n is None:
        return
    n.state = "lost" if e["lost"] else "draining"
    n.draining_reason = e["reason"]
    n.ok_streak = 0
    st.put_node(n)
    if e["lost"]:
        st.set_timer("lease", n.id, None)


def _node_restored(st: PoolState, e: Record) -> None:
    n = st.nodes.get(e["node_id"])
    if n is None:
        return
    n.state = "up"
    n.draining_reason = None
    st.put_node(n)


def _request_queued(st: PoolState, e: Record) -> None:
    key = keys.request_key(e["job_id"], e["task_id"], e["attempt"])
    r = RequestView(key, {
        "job_id": e["job_id"], "task_id": e["task_id"], "attempt": e["attempt"], "tenant": e["tenant"],
        "tier": e["tier"], "gpus": e["gpus"], "gpu_type": e["gpu_type"], "hosts": e["hosts"],
        "gpu_milli": e["gpu_milli"], "cpu_milli": e["cpu_milli"], "memory_mib": e["memory_mib"],
        "max_runtime_ms": e["max_runtime_ms"], "checkpoint": e["checkpoint"], "submitted_ms": e["submitted_ms"],
        "seq": e["seq"], "queued_ms": e["ts_ms"], "resume": e["resume_checkpoint"], "grants": e["grants"],
        "ran_ms": e.get("ran_ms") or 0})
    st.put_request(r)
    if e["requeued"]:
        return
    st.meta["seq"] = max(st.meta["seq"], e["seq"])
    st.put_meta()
    k = shape_key(r.gpus, r.per_gpu_milli() if r.gpus else 0, r.cpu, r.mem, tuple(sorted(r.gpu_types)))
    if k not in st.shape_counts and len(st.shape_counts) >= st.opts.profile_max_keys:
        k = ""
    n = st.profile["n"] + 1
    active = None
    if should_refresh(n, st.opts.profile_refresh):
        counts = dict(st.shape_counts)
        if k:
            counts[k] = counts.get(k, 0) + 1
        active = active_classes(counts, st.opts.profile_max_classes)
        current = st.profile["active"]
        if current and drift(current, active) < st.opts.profile_drift:
            active = None  # the mix has not moved: keep the classes (and every score and ranking built on them)
    st.count_shape(k, n, active)


def _clear_reservation_of(st: PoolState, req_key: str) -> None:
    if st.meta["reservations"].pop(req_key, None) is not None:
        st.put_meta()


def _request_cancelled(st: PoolState, e: Record) -> None:
    key = keys.request_key(e["job_id"], e["task_id"], e["attempt"])
    r = st.requests.get(key)
    if r is not None:
        st.drop_request(r)
        _clear_reservation_of(st, key)


def _allocation_granted(st: PoolState, e: Record) -> None:
    key = keys.request_key(e["job_id"], e["task_id"], e["attempt"])
    r = st.requests[key]
    st.drop_request(r, keep_job_link=True)
    r.grants += 1
    parts = [Part(h["node_id"], list(h["gpu_indices"]), h["gpu_milli"]) for h in e["hosts"]]
    a = AllocView(e["alloc_id"], r, parts, e["epoch"], e["ts_ms"])
    st.allocs[a.id] = a
    for p in parts:
        n = st.nodes[p.node]
        for gi in p.gpus:
            n.free[gi] -= p.milli
        n.cpu_free -= r.cpu
        n.mem_free -= r.mem
        n.allocs.append(a.id)
        st.put_node(n)
    st.put_alloc(a)
    st.link_alloc(a)
    st.add_usage(r.tier, r.tenant, r.total_milli)
    left = r.runtime_left_ms(int(st.opts.runtime_grace_s * 1000))
    if left is not None:
        st.set_timer("runtime", a.id, a.granted_ms + left)
    st.meta["epoch"] = max(st.meta["epoch"], e["epoch"])
    st.meta["reservations"].pop(key, None)
    st.put_meta()


def _allocation_ended(st: PoolState, e: Record) -> None:
    a = st.allocs.get(e["alloc_id"])
    if a is None:
        return
    r = a.req
    for p in a.parts:
        n = st.nodes.get(p.node)
        if n is None or a.id not in n.allocs:
            continue
        for gi in p.gpus:
            n.free[gi] += p.milli
        n.cpu_free += r.cpu
        n.mem_free += r.mem
        n.allocs.remove(a.id)
        st.put_node(n)
    st.unlink_alloc_nodes(a)
    st.add_usage(r.tier, r.tenant, -r.total_milli)
    st.set_timer("runtime", a.id, None)
    st.set_timer("grace", a.id, None)
    st.drop_alloc(a)


def _preemption_requested(st: PoolState, e: Record) -> None:
    a = st.allocs.get(e["alloc_id"])
    if a is None:
        return
    a.state = "preempting"
    a.preempt_deadline = e["grace_deadline_ms"]
    a.preempt_reason = e["reason"]
    st.put_alloc(a)
    st.set_timer("grace", a.id, e["grace_deadline_ms"])
    for p in a.parts:
        n = st.nodes.get(p.node)
        if n is not None:
            st.refresh_free_at(n)


def _reservation_made(st: PoolState, e: Record) -> None:
    st.meta["reservations"][keys.request_key(e["job_id"], e["task_id"], e["attempt"])] = {
        "rank": st.rank(e["tier"]), "start_ms": e["start_ms"], "nodes": list(e["node_ids"]), "kind": e["kind"],
        "made_ms": e["ts_ms"]}
    st.put_meta()


def _reservation_cleared(st: PoolState, e: Record) -> None:
    _clear_reservation_of(st, keys.request_key(e["job_id"], e["task_id"], e["attempt"]))


def _pass_deferred(st: PoolState, e: Record) -> None:
    st.set_timer("pass", st.opts.pool, e["due_ms"])


def _tenant_entitlements_set(st: PoolState, e: Record) -> None:
    t = e["tenant"]
    st.put_tenant(t, stored_settings(st.tenant_settings.get(t), e["entitlements"], e.get("source") or "admin_api"))


def _no_state(st: PoolState, e: Record) -> None:
    """Recorded for the audit only."""


APPLIERS: dict[str, Applier] = {
    A + "NodeRegistered": _node_registered,
    A + "NodeHeartbeatRecorded": _heartbeat,
    A + "NodeDrained": _node_drained,
    A + "NodeRestored": _node_restored,
    A + "RequestQueued": _request_queued,
    A + "RequestRejected": _no_state,
    A + "RequestCancelled": _request_cancelled,
    A + "AllocationGranted": _allocation_granted,
    A + "AllocationReleased": _allocation_ended,
    A + "AllocationExpired": _allocation_ended,
    A + "PreemptionRequested": _preemption_requested,
    A + "ReservationMade": _reservation_made,
    A + "ReservationCleared": _reservation_cleared,
    A + "PassDeferred": _pass_deferred,
    A + "TenantEntitlementsSet": _tenant_entitlements_set,
}


def apply_event(st: PoolState, event: Record) -> None:
    """Apply one event; an unknown type is an error (a newer writer wrote it)."""
    APPLIERS[event["type"]](st, event)
