"""Command processors: one function per allocator command, deciding which events follow.

A processor reads state, emits events through ``Ctx.event`` (each applied at
once) and control records for node agents (``Ctx.stop``/``Ctx.fence``). It
never writes state directly, never reads a clock and never does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dagfold.codec import Record
from dagfold.services.allocator import keys
from dagfold.services.allocator.ctx import Ctx
from dagfold.services.allocator.exceptions import InvalidCommandError
from dagfold.services.allocator.model import FULL, AllocView, NodeView, RequestView
from dagfold.services.allocator.options import DRAIN_HEALTH, STICKY_HEALTH
from dagfold.services.allocator.passes import schedule
from dagfold.services.allocator.placement import could_ever_fit
from dagfold.tenants import Entitlements, EntitlementsError, settings_unchanged

C = "dagfold.allocator."


PACES = "paces of "  # how a slow verdict from the jobs' paces starts its detail (_perf_from_paces)


def _host_failed(reason: str) -> bool:
    """Whether an allocation moved for ``reason`` was moved by its host's failure, on the host's own
    evidence (lost, re-registered, a GPU cordoned, drained for throttling, ECC or Xid errors or its own
    slow figure): its run there does not count against the job's runtime, since the host slowed it. A
    drain on its jobs' paces counts (those jobs' tenants said so), and so does a preemption."""
    if reason.startswith(("node re-registered", "GPU cordoned on node ", "not running on ")):
        return True
    head, drained, rest = reason.partition(" drained: ")
    if not head.startswith("node "):
        return False
    if not drained:
        return reason.endswith(" lease expired")
    health, _, detail = rest.partition(": ")
    return health in DRAIN_HEALTH and not detail.startswith(PACES)


def _kept_ms(ctx: Ctx, a: AllocView, checkpoint_uri: str | None, reason: str) -> int:
    """How much of ``a``'s run counts against its job's runtime when it is moved: none if its host
    failed (``_host_failed``); else up to now if it checkpointed as it stopped, else up to its last
    checkpoint of this grant (the work after it is done again: not the job's doing)."""
    if _host_failed(reason):
        return 0
    if checkpoint_uri:
        return ctx.now_ms - a.granted_ms
    ck = a.last_ckpt_ms
    return ck - a.granted_ms if ck is not None and a.granted_ms <= ck <= ctx.now_ms else 0


def _requeue(ctx: Ctx, a: AllocView, checkpoint_uri: str | None, reason: str) -> None:
    """Put an allocation's request back in its queue at its original position, to resume from a checkpoint.
    The run it keeps counts against its declared runtime (``ran_ms``: the limit spans its grants)."""
    r = a.req
    ctx.event("RequestQueued", job_id=r.job_id, task_id=r.task_id, attempt=r.attempt, tenant=r.tenant, tier=r.tier,
              gpus=r.gpus, gpu_type=list(r.gpu_types), hosts=r.hosts, gpu_milli=r.milli, cpu_milli=r.cpu,
              memory_mib=r.mem, max_runtime_ms=r.max_runtime_ms, checkpoint=r.checkpoint,
              submitted_ms=r.submitted_ms, seq=r.seq, requeued=True,
              resume_checkpoint=checkpoint_uri or a.last_ckpt_uri, grants=r.grants,
              ran_ms=r.ran_ms + _kept_ms(ctx, a, checkpoint_uri, reason))


def _end(ctx: Ctx, a: AllocView, name: str, reason: str, *, requeue: bool, stop_nodes: list[str] | None,
         checkpoint_uri: str | None = None, tell_scheduler: bool = False) -> None:
    """Release or expire ``a``; stop it on ``stop_nodes`` (None: all its hosts); requeue it if asked,
    unless it has held GPUs for its whole declared runtime over all its grants (then it ends here)."""
    left = a.req.runtime_left_ms(int(ctx.opts.runtime_grace_s * 1000))
    if requeue and left is not None and ctx.now_ms - a.granted_ms >= left and not _host_failed(reason):
        ran = a.req.ran_ms + ctx.now_ms - a.granted_ms
        declared = (a.req.max_runtime_ms or 0) / 1000
        reason = (f"{reason}; not requeued: max_runtime_s exceeded ({declared:g} s declared, "
                  f"GPUs held {ran / 1000:g} s over {a.req.grants} grant(s))")
        requeue, tell_scheduler = False, True
    ctx.event(name, alloc_id=a.id, epoch=a.epoch, job_id=a.req.job_id, task_id=a.req.task_id,
              attempt=a.req.attempt, tenant=a.req.tenant, tier=a.req.tier, reason=reason,
              node_ids=[p.node for p in a.parts], requeued=requeue, held_ms=ctx.now_ms - a.granted_ms)
    if stop_nodes is None or stop_nodes:
        ctx.stop(a, reason, nodes=stop_nodes)
    if requeue:
        _requeue(ctx, a, checkpoint_uri, reason)
    # completions, failures and cancels are reported by their own authors (the gang's first host, the
    # scheduler); what only the allocator sees is told here
    if requeue or name == "AllocationExpired" or tell_scheduler:
        ctx.notify("requeued" if requeue else "ended", a.req.job_id, a.req.task_id, a.req.attempt, alloc_id=a.id,
                   epoch=a.epoch, reason=reason, checkpoint_uri=checkpoint_uri or a.last_ckpt_uri)


# -- nodes ------------------------------------------------------------------------------------

def register_node(ctx: Ctx, cmd: Record) -> None:
    st = ctx.st
    nid = cmd["node_id"]
    old = st.nodes.get(nid)
    if old is not None:
        for aid in list(old.allocs):
            a = st.allocs[aid]
            others = [p.node for p in a.parts if p.node != nid]
            _end(ctx, a, "AllocationExpired", "node re-registered: its processes are gone",
                 requeue=True, stop_nodes=others)
    ctx.event("NodeRegistered", node_id=nid, gpu_type=cmd["gpu_type"], gpus=cmd["gpus"],
              cpu_milli=cmd["cpu_milli"], memory_mib=cmd["memory_mib"], incarnation=cmd["incarnation"],
              lease_deadline_ms=ctx.now_ms + int(ctx.opts.lease_s * 1000))
    schedule(ctx)


def _drain(ctx: Ctx, nid: str, reason: str) -> None:
    """Stop placing on a node and move its jobs off from their checkpoints (grace, then stop)."""
    st = ctx.st
    ctx.event("NodeDrained", node_id=nid, reason=reason, lost=False)
    deadline = ctx.now_ms + int(ctx.opts.grace_s * 1000)
    for aid in list(st.nodes[nid].allocs):
        _move_off(ctx, st.allocs[aid], deadline, f"node {nid} drained: {reason}", f"node drained: {reason}")


def _move_off(ctx: Ctx, a: AllocView, deadline: int, reason: str, stop_reason: str) -> None:
    """Ask a running allocation to checkpoint and stop (it is requeued and resumes elsewhere)."""
    if a.state == "preempting":
        return
    ctx.event("PreemptionRequested", alloc_id=a.id, epoch=a.epoch, job_id=a.req.job_id,
              task_id=a.req.task_id, attempt=a.req.attempt, tenant=a.req.tenant, tier=a.req.tier,
              grace_deadline_ms=deadline, reason=reason,
              preemptor_job_id=None, preemptor_task_id=None, preemptor_tier=None)
    ctx.stop(a, stop_reason, checkpoint=True, deadline_ms=deadline)


def _gpu_report(cmd: Record, n: NodeView) -> tuple[list[int], float | None]:
    """The GPUs of a heartbeat's per-GPU report that are not ok (sorted, on the node), and their mean
    utilisation (None: none reported). One pass over the report: it runs for every heartbeat."""
    report = cmd.get("gpus")
    if not report:  # an agent without NVML, the simulator: nothing to pass over
        return [], None
    bad: set[int] = set()
    total = 0.0
    count = 0
    size = n.gpus
    for g in report:
        if g.get("health", "ok") != "ok" and 0 <= g["index"] < size:
            bad.add(g["index"])
        u = g.get("utilization")
        if u is not None:
            total += float(u)
            count += 1
    return sorted(bad), (round(min(1.0, max(0.0, total / count)), 4) if count else None)


def _end_orphans(ctx: Ctx, n: NodeView, listed: set[str]) -> bool:
    """Requeue allocations whose first host does not run them long after their grant.

    A grant reaches its hosts through the scheduler (TaskAllocation, then
    GpuTaskDispatch); a dispatch lost on the way or a process that never
    started would otherwise hold the GPUs for as long as the node heartbeats.
    Only the first host counts: a gang's other parts may end before it.
    """
    grace = ctx.opts.orphan_grace_s
    if grace is None:
        return False
    ended = False
    for aid in list(n.allocs):
        a = ctx.st.allocs[aid]
        if a.parts[0].node != n.id or aid in listed or a.state == "preempting" \
                or ctx.now_ms - a.granted_ms < grace * 1000:
            continue
        others = [p.node for p in a.parts if p.node != n.id]
        _end(ctx, a, "AllocationExpired", f"not running on {n.id} {grace:g} s after its grant "
             "(dispatch lost or process never started)", requeue=True, stop_nodes=others)
        ended = True
    return ended


def _perf_from_paces(ctx: Ctx, paces: list[tuple[str, float]], avg: float | None,
                     health: str) -> tuple[float | None, str, str | None]:
    """The host's throughput from its jobs' paces (their median) and its health: ``slow`` only when
    jobs of ``slow_min_tenants`` tenants go below the ratio of the fleet average. Below it with fewer
    tenants, the paces say something about those jobs (slower than they declared: their runtime limit
    stops them), nothing about the host: no verdict, and no figure for the fleet average either.
    Returns the perf to record, the health, and the detail of a slow verdict (None: none here)."""
    values = sorted(p for _, p in paces)
    mid = len(values) // 2
    perf = round(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2, 4)
    if health != "ok" or not avg or perf >= ctx.opts.slow_perf_ratio * avg:
        return perf, health, None
    slow_tenants = {t for t, p in paces if p < ctx.opts.slow_perf_ratio * avg}
    if len(slow_tenants) >= ctx.opts.slow_min_tenants:
        ratio = ctx.opts.slow_perf_ratio
        return perf, "slow", f"{PACES}{len(slow_tenants)} tenants' jobs below {ratio:g} of the fleet's"
    return None, health, None


def node_heartbeat(ctx: Ctx, cmd: Record) -> None:
    st = ctx.st
    nid = cmd["node_id"]
    n = st.nodes.get(nid)
    if n is None or n.state == "lost" or n.incarnation != cmd["incarnation"]:
        why = "node unknown" if n is None else ("node lease expired" if n.state == "lost"
                                                 else f"stale incarnation {cmd['incarnation']}")
        for s in cmd["allocations"]:
            ctx.fence(nid, s["alloc_id"], s["epoch"], f"fenced: {why}; re-register")
        if not cmd["allocations"]:
            ctx.fence(nid, "", 0, f"fenced: {why}; re-register")
        return
    ckpts = []
    listed = set()
    paces: list[tuple[str, float]] = []  # (tenant, pace) of this host's current allocations that report one
    for s in cmd["allocations"]:
        aid = s["alloc_id"]
        listed.add(aid)
        a = st.allocs.get(aid)
        if a is None or a.epoch != s["epoch"] or (a.parts[0].node != nid and all(p.node != nid for p in a.parts)):
            ctx.fence(nid, aid, s["epoch"], "fenced: allocation is not current")
            continue
        pace = s.get("pace")
        if pace is not None and math.isfinite(pace) and pace >= 0:
            paces.append((a.req.tenant, pace))
        ck = s["last_checkpoint_ms"]
        if ck is not None and ck != a.last_ckpt_ms:
            ckpts.append({"alloc_id": aid, "last_checkpoint_ms": ck, "checkpoint_uri": s["checkpoint_uri"]})
    health = cmd["health"]
    perf = cmd["perf"]
    if perf is not None and not (math.isfinite(perf) and perf >= 0):
        perf = None  # NaN or infinite from a hostile or broken agent: no measurement, not a poisoned average
    avg = st.perf.get(n.gpu_type)
    pace_detail = None
    if paces:  # the jobs' paces, where they tell it (the device model's figure is for a host without them)
        perf, health, pace_detail = _perf_from_paces(ctx, paces, avg, health)
    elif health == "ok" and perf is not None and avg and perf < ctx.opts.slow_perf_ratio * avg:
        health = "slow"
    cordoned, utilization = _gpu_report(cmd, n)
    lease_deadline = ctx.now_ms + int(ctx.opts.lease_s * 1000)
    if not ckpts and n.state == "up" and health == n.health and cordoned == n.cordoned \
            and lease_deadline - n.lease_until < ctx.opts.lease_renew_ms() \
            and (perf is None or health != "ok"
                 or (avg is not None and abs(perf - avg) <= ctx.opts.perf_record_tolerance * avg)):
        # Nothing new and the lease is fresh: no event, no state write (options.lease_renew_s). What a
        # heartbeat tells beyond its state is still acted on: unknown processes are fenced (above) and
        # processes missing long after their grant are requeued (below).
        if _end_orphans(ctx, n, listed):
            schedule(ctx)
        return
    newly = set(cordoned) - set(n.cordoned)
    restored = bool(set(n.cordoned) - set(cordoned))
    ctx.event("NodeHeartbeatRecorded", node_id=nid, lease_deadline_ms=lease_deadline,
              health=health, perf=perf, checkpoints=ckpts, cordoned_gpus=cordoned, utilization=utilization)
    if newly:  # jobs on a GPU just cordoned checkpoint and move; the node's other GPUs keep serving
        bad = {g["index"]: g.get("detail") or g.get("health") for g in cmd["gpus"] if g["index"] in newly}
        deadline = ctx.now_ms + int(ctx.opts.grace_s * 1000)
        for aid in list(n.allocs):
            a = ctx.st.allocs[aid]
            hit = sorted({gi for p in a.parts if p.node == nid for gi in p.gpus} & newly)
            if hit:
                why = "; ".join(f"GPU {gi}: {bad[gi]}" for gi in hit)
                _move_off(ctx, a, deadline, f"GPU cordoned on node {nid}: {why}", f"GPU cordoned: {why}")
    if restored:
        schedule(ctx)  # a GPU came back
    if _end_orphans(ctx, n, listed):
        schedule(ctx)
    if n.state == "up" and health in DRAIN_HEALTH:
        detail = pace_detail or cmd["detail"] or health
        _drain(ctx, nid, f"{health}: {detail}")
        schedule(ctx)
    elif n.state == "draining" and health == "ok" and n.draining_reason is not None \
            and n.draining_reason.split(":", 1)[0] not in STICKY_HEALTH \
            and n.ok_streak >= ctx.opts.undrain_ok_heartbeats:
        ctx.event("NodeRestored", node_id=nid, reason=f"healthy for {n.ok_streak} heartbeats")
        schedule(ctx)


# -- requests ---------------------------------------------------------------------------------

def _validate(ctx: Ctx, cmd: Record) -> str | None:
    g, milli, hosts = cmd["gpus"], cmd["gpu_milli"], cmd["hosts"]
    if g < 0 or hosts < 1:
        return f"gpus must be >= 0 and hosts >= 1 (got gpus={g}, hosts={hosts})"
    if not 0 < milli <= FULL:
        return f"gpu_milli must be in 1..1000 (got {milli})"
    if milli < FULL and (g != 1 or hosts != 1):
        return "a GPU share (gpu_milli < 1000) needs gpus == 1 and hosts == 1"
    if g == 0 and not (cmd["cpu_milli"] or cmd["memory_mib"]):
        return "the request asks for nothing (gpus == 0, no CPU, no memory)"
    if ctx.opts.tier_rank(cmd["tier"]) is None:
        return f"unknown tier {cmd['tier']!r}; known: {', '.join(ctx.opts.tiers)}"
    mrt = cmd["max_runtime_s"]
    if mrt is not None and not (math.isfinite(mrt) and 0 < mrt <= 10 * 365 * 24 * 3600):
        return f"max_runtime_s must be a finite number > 0 (at most 10 years), got {mrt}"
    return None


def _over_quota(ctx: Ctx, r: RequestView) -> str | None:
    """Why ``r`` could never be granted under its tenant's quotas (bigger than the pool quota, or than the
    quota of every GPU type it names), or None. A request that fits a quota waits for it while it is used."""
    st, need = ctx.st, r.total_milli
    quota = st.quota_milli(r.tenant)
    if quota is not None and need > quota:
        return f"asks for {need / 1000:g} GPUs; tenant quota is {quota / 1000:g}"
    per_type = st.type_quotas(r.tenant)
    if per_type and r.gpu_types and all(t in per_type and need > per_type[t] for t in r.gpu_types):
        caps = ", ".join(f"{ctx.opts.pool}/{t}: {per_type[t] / 1000:g}" for t in r.gpu_types)
        return f"asks for {need / 1000:g} GPUs of {'|'.join(r.gpu_types)}; tenant quota is {caps}"
    return None


def request_allocation(ctx: Ctx, cmd: Record) -> None:
    st = ctx.st
    key = keys.request_key(cmd["job_id"], cmd["task_id"], cmd["attempt"])
    if key in st.requests or key in st.alloc_of_req:
        return  # a duplicate of a request in flight: idempotent
    ident = {"job_id": cmd["job_id"], "task_id": cmd["task_id"], "attempt": cmd["attempt"],
             "tenant": cmd["tenant"], "tier": cmd["tier"]}
    why = _validate(ctx, cmd)
    mrt = cmd["max_runtime_s"]
    fields = {"gpus": cmd["gpus"], "gpu_type": sorted(cmd["gpu_type"]), "hosts": cmd["hosts"],
              "gpu_milli": cmd["gpu_milli"], "cpu_milli": cmd["cpu_milli"], "memory_mib": cmd["memory_mib"],
              "max_runtime_ms": None if mrt is None or why else int(mrt * 1000), "checkpoint": cmd["checkpoint"],
              "submitted_ms": cmd["submitted_ms"]}
    probe = RequestView(key, {**ident, **fields, "seq": 0, "queued_ms": ctx.now_ms, "resume": None, "grants": 0})
    if why is None:
        why = _over_quota(ctx, probe)
    if why is None and ctx.opts.reject_unfittable:
        why = could_ever_fit(st, probe)
    if why is not None:
        ctx.event("RequestRejected", **ident, reason=why)
        ctx.notify("rejected", cmd["job_id"], cmd["task_id"], cmd["attempt"], reason=why)
        return
    ctx.event("RequestQueued", **ident, **fields, seq=st.meta["seq"] + 1, requeued=False,
              resume_checkpoint=cmd["resume_checkpoint"], grants=0)
    schedule(ctx, arrival=True)
    if not cmd["wait"] and key in st.requests:
        ctx.event("RequestCancelled", job_id=cmd["job_id"], task_id=cmd["task_id"], attempt=cmd["attempt"],
                  reason="fits nowhere now and the request does not wait")


def release_allocation(ctx: Ctx, cmd: Record) -> None:
    st = ctx.st
    a = st.allocs.get(cmd["alloc_id"])
    if a is None or a.epoch != cmd["epoch"]:
        return  # stale or duplicate: the allocation already ended
    others = [p.node for p in a.parts if p.node != cmd["node_id"]]
    leader = a.parts[0].node
    if cmd["reason"] == "completed" and cmd["node_id"] != leader and a.state != "preempting":
        return  # one part of a gang finished: the gang holds its hosts until its first host's process ends
    if a.state == "preempting" or cmd["reason"] == "preempted":
        _end(ctx, a, "AllocationReleased", "preempted" if a.preempt_reason is None else a.preempt_reason,
             requeue=True, stop_nodes=others, checkpoint_uri=cmd["checkpoint_uri"])
    else:
        # a failed part of a gang fails the attempt now: its first host, which reports to the scheduler,
        # is stopped with the allocation and would leave it to the scheduler's lease to notice
        why = cmd["reason"] if cmd["node_id"] == leader else f"{cmd['reason']} on {cmd['node_id']}"
        _end(ctx, a, "AllocationReleased", why, requeue=False, stop_nodes=others,
             tell_scheduler=cmd["reason"] != "completed" and cmd["node_id"] != leader)
    schedule(ctx)


def cancel_request(ctx: Ctx, cmd: Record) -> None:
    st = ctx.st
    job, task, upto = cmd["job_id"], cmd["task_id"], cmd.get("attempt")
    freed = False
    for key in sorted(st.by_job.get(job, ())):
        r = st.requests.get(key)
        aid = st.alloc_of_req.get(key)
        target: RequestView | None = r if r is not None else (st.allocs[aid].req if aid else None)
        if target is None or (task is not None and target.task_id != task):
            continue
        if upto is not None and target.attempt > upto:
            continue  # a later attempt's: a late (delayed or duplicated) cancel must not withdraw it
        if r is not None:
            ctx.event("RequestCancelled", job_id=r.job_id, task_id=r.task_id, attempt=r.attempt,
                      reason=cmd["reason"])
        elif aid is not None:
            _end(ctx, st.allocs[aid], "AllocationReleased", f"cancelled: {cmd['reason']}", requeue=False,
                 stop_nodes=None)
            freed = True
    if freed:
        schedule(ctx)


# -- settings -------------------------------------------------------------------------------------

def set_tenant_entitlements(ctx: Ctx, cmd: Record) -> None:
    """A tenant's weight and quotas from now on (the copy of ``allocator.commands``' partition; every pool's
    allocator folds it). Settings that do not parse raise (the runtime dead-letters the command); the
    auth file's, re-sent at every API start, change nothing when the file did not change. A pass follows:
    a raised quota or weight serves the waiting requests at once."""
    tenant = cmd["tenant"]
    try:
        ent = Entitlements.parse(cmd["entitlements"], f"tenant {tenant[:60]!r}")
    except EntitlementsError as exc:
        raise InvalidCommandError(str(exc)) from None
    rec = ent.to_record()
    if settings_unchanged(ctx.st.tenant_settings.get(tenant), rec, cmd["source"]):
        return
    ctx.event("TenantEntitlementsSet", tenant=tenant, entitlements=rec, source=cmd["source"])
    schedule(ctx)


# -- timers -------------------------------------------------------------------------------------

def timer_fired(ctx: Ctx, cmd: Record) -> None:
    """Decide what a due timer means now; a timer made stale by later events does nothing."""
    st = ctx.st
    kind, target = cmd["timer"], cmd["target"]
    if st.timers.get((kind, target)) != cmd["due_ms"] or cmd["due_ms"] > ctx.now_ms:
        return
    if kind == "lease":
        n = st.nodes.get(target)
        if n is None or n.state == "lost" or n.lease_until > ctx.now_ms:
            return
        for aid in list(n.allocs):
            a = st.allocs[aid]
            others = [p.node for p in a.parts if p.node != target]
            _end(ctx, a, "AllocationExpired", f"node {target} lease expired", requeue=True, stop_nodes=others)
        ctx.event("NodeDrained", node_id=target, reason="lease expired: no heartbeat", lost=True)
    elif kind == "grace":
        g = st.allocs.get(target)
        if g is None or g.state != "preempting":
            return
        _end(ctx, g, "AllocationReleased", f"{g.preempt_reason} (grace expired, stopped)", requeue=True,
             stop_nodes=None)
    elif kind == "runtime":
        x = st.allocs.get(target)
        if x is None:
            return
        why = "max_runtime_s exceeded" + (f" over {x.req.grants} grants" if x.req.grants > 1 else "")
        _end(ctx, x, "AllocationExpired", why, requeue=False, stop_nodes=None)
    elif kind == "pass":
        ctx.event("PassDeferred", due_ms=None)
    schedule(ctx)


PROCESSORS: dict[str, Callable[[Ctx, Record], None]] = {
    C + "RegisterNode": register_node,
    C + "NodeHeartbeat": node_heartbeat,
    C + "RequestAllocation": request_allocation,
    C + "ReleaseAllocation": release_allocation,
    C + "CancelRequest": cancel_request,
    C + "AllocatorTimerFired": timer_fired,
    C + "SetTenantEntitlements": set_tenant_entitlements,
}
