"""The scheduling pass: which queued requests get placed now.

Run after every command that may have freed capacity or queued work. Tiers go
strictly in priority order. Within a tier:

1. reservation owners first (the head-of-line request blocked earlier, and
   requests waiting for their preemption victims), so capacity freed for them
   goes to them;
2. then tenants in weighted-DRF order: the tenant with the smallest GPU usage
   divided by its weight goes next (GPU is the dominant resource), FIFO within
   a tenant, and its share is updated after each grant. A tenant that floods
   the queue only ever gets its turn when its share is the smallest, so a small
   tenant's next request waits for capacity, not for the flood.
3. A request that does not fit may preempt lower tiers if its tier is allowed
   to (``preempt_after_s``: enterprise at once, standard after a wait). The
   first request of the tier that does not fit is the head of line; if it
   preempts nothing it gets a reservation (earliest start from
   running allocations' runtime limits), and later requests are placed only
   around it (backfill, see ``reservations``). Without backfill (the FIFO
   baseline) the pass stops at the head of line.

Quotas: a request that would take its tenant past its GPU quota of the pool
waits (the tenant's later requests are still looked at); one that would pass
the quota of some GPU types is placed only on the others (``within_quota``).

Work per pass is bounded (``pass_budget`` placement attempts, a look-ahead per
tenant, and request shapes that already failed in this pass are skipped
without a second attempt); when the budget runs out after progress, a
``PassDeferred`` timer continues at once in the next command.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from dagfold.services.allocator.ctx import Ctx
from dagfold.services.allocator.model import FULL, RequestView
from dagfold.services.allocator.placement import feasible_shapes, place
from dagfold.services.allocator.preemption import find_victims
from dagfold.services.allocator.reservations import Exclusions, earliest_start, excluded_for, is_stale

MAX_PREEMPTIONS_PER_PASS = 2


def grant(ctx: Ctx, r: RequestView, excluded: set[str]) -> bool:
    """Place ``r`` if it fits now, all hosts at once; emit AllocationGranted."""
    ctx.attempts += 1
    parts = place(ctx.st, r, excluded)
    if parts is None:
        return False
    st = ctx.st
    epoch = st.meta["epoch"] + 1
    lease = min(st.nodes[p.node].lease_until for p in parts)
    ctx.granted += 1
    hosts = [p.record() for p in parts]
    ctx.event("AllocationGranted", alloc_id=f"{ctx.opts.pool}:{epoch}", epoch=epoch, job_id=r.job_id,
              task_id=r.task_id, attempt=r.attempt, tenant=r.tenant, tier=r.tier,
              hosts=hosts, gpus=r.gpus, gpu_milli=r.milli, cpu_milli=r.cpu,
              memory_mib=r.mem, lease_deadline_ms=lease,
              max_runtime_s=None if r.max_runtime_ms is None else r.max_runtime_ms / 1000,
              checkpoint=r.checkpoint, resume_checkpoint=r.resume, waited_ms=ctx.now_ms - r.queued_ms,
              grants=r.grants + 1)
    ctx.notify("granted", r.job_id, r.task_id, r.attempt, alloc_id=f"{ctx.opts.pool}:{epoch}", epoch=epoch,
               hosts=hosts, checkpoint_uri=r.resume)
    return True


def _ident(r: RequestView) -> dict[str, object]:
    return {"job_id": r.job_id, "task_id": r.task_id, "attempt": r.attempt, "tier": r.tier}


def preempt_for(ctx: Ctx, r: RequestView, excluded: set[str]) -> bool:
    """Ask lower-tier victims to checkpoint and stop so ``r`` fits; claim their hosts for ``r``."""
    st = ctx.st
    found = find_victims(st, r, ctx.now_ms, excluded)
    if found is None:
        return False
    hosts, victims = found
    deadline = ctx.now_ms + int(ctx.opts.grace_s * 1000)
    for v in victims:
        ctx.event("PreemptionRequested", alloc_id=v.id, epoch=v.epoch, job_id=v.req.job_id, task_id=v.req.task_id,
                  attempt=v.req.attempt, tenant=v.req.tenant, tier=v.req.tier, grace_deadline_ms=deadline,
                  reason=f"preempted by {r.job_id}/{r.task_id} ({r.tier})",
                  preemptor_job_id=r.job_id, preemptor_task_id=r.task_id, preemptor_tier=r.tier)
        ctx.stop(v, "preempted", checkpoint=True, deadline_ms=deadline)
    ctx.event("ReservationMade", **_ident(r), start_ms=deadline, node_ids=hosts, kind="preemption")
    return True


def reserve_for(ctx: Ctx, r: RequestView, excluded: set[str]) -> bool:
    found = earliest_start(ctx.st, r, ctx.now_ms, excluded)
    if found is None:
        return False
    start, hosts = found
    ctx.event("ReservationMade", **_ident(r), start_ms=start, node_ids=hosts, kind="backfill")
    return True


def may_preempt(ctx: Ctx, r: RequestView) -> bool:
    """Tiers listed in ``preempt_after_s`` preempt lower tiers once their request waited that long."""
    after = ctx.opts.preempt_after_s.get(r.tier)
    if after is None or not ctx.opts.preemption or not ctx.opts.strict_tiers:
        return False
    return ctx.now_ms - r.queued_ms >= after * 1000 and ctx.st.rank(r.tier) < len(ctx.opts.tiers) - 1


def _blocked(ctx: Ctx, r: RequestView, rank: int, *, head: bool, preempt: bool) -> bool:
    """``r`` does not fit: preempt for it if allowed, else reserve for the head of line.

    Returns True when a reservation (backfill or preemption claim) was made.
    """
    st = ctx.st
    excluded = excluded_for(st, r, ctx.now_ms)
    if preempt and preempt_for(ctx, r, excluded):
        return True
    if head and ctx.opts.backfill and not any(v["rank"] == rank and v["kind"] == "backfill"
                                              for v in st.meta["reservations"].values()):
        return reserve_for(ctx, r, excluded)
    return False


def within_quota(ctx: Ctx, r: RequestView) -> RequestView | None:
    """``r`` as its tenant's GPU quotas let it be placed now: None while it would exceed the pool quota or
    the quota of every GPU type it may use; else ``r``, or a copy narrowed to the GPU types still under
    their quota (``pool/type`` entries). Cost: the tenant's per-type quotas (a handful), never a scan."""
    st = ctx.st
    tenant, need = r.tenant, r.total_milli
    quota = st.quota_milli(tenant)
    if quota is not None and st.tenant_usage.get(tenant, 0) + need > quota:
        return None
    per_type = st.type_quotas(tenant)
    if not per_type:
        return r
    usage = st.type_usage
    types = r.gpu_types or tuple(st.gpu_types)
    ok = tuple(t for t in types if t not in per_type or usage.get((tenant, t), 0) + need <= per_type[t])
    if len(ok) == len(types):
        return r
    if not ok:
        return None
    return RequestView(r.key, {**r.record(), "gpu_type": list(ok)})


def _share_of(ctx: Ctx, tier_name: str) -> Callable[[str], float]:
    """The tenants' fair-share key in a tier: usage over weight, in this tier with strict tiers, else over all
    tiers (0 without fair share). One closure per tier walk over the live usage dicts: a pass asks it for every
    queued tenant and reservation owner (~15 times a pass, 655,000 calls in the 2,000-GPU day), and the
    option checks and attribute reads of a plain function were a third of its cost."""
    st = ctx.st
    if not ctx.opts.fair_share:
        return _no_share
    weight = st.weight
    if ctx.opts.strict_tiers:
        usage = st.usage
        return lambda tenant: usage.get((tier_name, tenant), 0) / weight(tenant)
    tenant_usage = st.tenant_usage
    return lambda tenant: tenant_usage.get(tenant, 0) / weight(tenant)


def _no_share(tenant: str) -> float:
    return 0.0


def _owners_first(ctx: Ctx, rank: int) -> tuple[int, bool]:
    """Try the tier's reservation owners; returns (attempts used, head of line still blocked).

    A backfill reservation follows the head of line: when weighted fair share
    has moved another tenant ahead of its owner by more than the owner's own
    request, it is cleared (the pass then reserves for the new head if that
    one is blocked too).
    """
    st = ctx.st
    reservations = st.meta["reservations"]
    if not reservations:
        return 0, False
    owners = sorted((v["made_ms"], k) for k, v in reservations.items() if v["rank"] == rank)
    used = 0
    blocked = False
    q = st.queues.get(rank, {})
    tier_name = ctx.opts.tiers[rank] if rank < len(ctx.opts.tiers) else ""
    shares: dict[str, float] = {}  # share_of, until a grant to that tenant
    share_of = _share_of(ctx, tier_name)

    def share(tenant: str) -> float:
        v = shares.get(tenant)
        if v is None:
            v = shares[tenant] = share_of(tenant)
        return v

    for _, key in owners:
        r = st.requests.get(key)
        v = reservations.get(key)
        if r is None or v is None:
            continue
        if v["kind"] == "backfill" and ctx.opts.fair_share and len(q) > 1:
            # hysteresis for gangs: only when the owner is ahead by more than its own request
            size = r.total_milli if r.total_milli > FULL else 0
            mine = share(r.tenant) - size / st.weight(r.tenant)
            if any(share(t) < mine - 1e-9 for t in q if t != r.tenant):
                ctx.event("ReservationCleared", **_ident(r), reason="fair share moved another tenant ahead")
                continue
        if st.has_quotas:
            rq = within_quota(ctx, r)
            if rq is None:  # over a quota now (its tenant got GPUs since, or a quota was lowered): it waits,
                # and holds no hosts back from others meanwhile
                ctx.event("ReservationCleared", **_ident(r), reason="over its tenant's GPU quota")
                continue
            r = rq
        used += 1
        if grant(ctx, r, excluded_for(st, r, ctx.now_ms)):
            shares.pop(r.tenant, None)
            continue
        blocked = True
        if is_stale(st, v, ctx.now_ms):
            ctx.event("ReservationCleared", **_ident(r), reason="start passed or a reserved host was lost")
            _blocked(ctx, r, rank, head=True, preempt=may_preempt(ctx, r))
    return used, blocked


def schedule(ctx: Ctx, *, arrival: bool = False) -> None:
    """One scheduling pass over all tiers (see module docstring).

    After an arrival alone no capacity was freed, so only a short pass runs
    (``arrival_examine_limit``): it places the newcomer if its turn comes early,
    and otherwise leaves it to the next pass that follows a release.
    """
    st = ctx.st
    opts = ctx.opts
    budget = opts.pass_budget
    ctx.examine_limit = opts.arrival_examine_limit if arrival else opts.pass_examine_limit
    before = ctx.granted
    for rank in sorted(st.queues):
        if not st.queues.get(rank):
            continue
        budget, stop = _tier(ctx, rank, budget)
        if stop or budget <= 0:
            break
    if budget <= 0 and ctx.granted > before and st.requests and ("pass", opts.pool) not in st.timers \
            and st.capacity.any_free():
        ctx.event("PassDeferred", due_ms=ctx.now_ms)


def _tier(ctx: Ctx, rank: int, budget: int) -> tuple[int, bool]:
    st = ctx.st
    opts = ctx.opts
    used, blocked = _owners_first(ctx, rank)
    budget -= used
    q = st.queues.get(rank)
    if not q:
        return budget, False
    tier_name = opts.tiers[rank] if rank < len(opts.tiers) else ""
    share = _share_of(ctx, tier_name)
    feasible = feasible_shapes(st, rank)
    limit = ctx.examine_limit
    if not feasible:  # nothing queued here fits anywhere now: only the head of line and preemptions matter
        can = opts.preemption and tier_name in opts.preempt_after_s
        limit = min(limit, 1 + (MAX_PREEMPTIONS_PER_PASS if can else 0))
        if blocked and not can:
            return budget, False
    lookahead = opts.tenant_lookahead
    # The first ``lookahead`` entries of each tenant's queue, copied when the tenant is first reached: in
    # this loop a queue changes only when one of these entries is granted (the copy is then retaken).
    heads: dict[str, list[tuple[int, str]]] = {}
    # At most one entry per tenant: (share, seq, tenant, index). A tenant's share changes in this loop only
    # with a grant to that tenant, in the iteration that popped its entry: otherwise the popped share is current.
    heap: list[tuple[float, int, str, int]] = [(share(tenant), lst[0][0], tenant, 0) for tenant, lst in q.items()]
    heapq.heapify(heap)
    heappop, heappush = heapq.heappop, heapq.heappush
    failed: set[tuple[object, ...]] = set()
    excl = Exclusions(st, rank, ctx.now_ms)
    preemptions = 0
    examined = 0
    reserved = st.meta["reservations"]
    requests = st.requests
    has_quotas = st.has_quotas
    while heap and budget > 0 and examined < limit:
        sh, _, tenant, i = heappop(heap)
        h = heads.get(tenant)
        if h is None:
            lst = q.get(tenant)
            h = heads[tenant] = [] if lst is None else lst[:lookahead]
        if i >= len(h):
            continue
        examined += 1
        key = h[i][1]
        nxt = i + 1
        if key not in reserved:
            r0 = requests[key]
            r = within_quota(ctx, r0) if has_quotas else r0
            if r is not None:
                pattern = excl.pattern(r)
                fkey = (r.shape, pattern)
                if fkey not in failed:
                    granted = False
                    if r0.gpu_shape in feasible:  # (r may be r0 narrowed to the GPU types under quota)
                        budget -= 1
                        granted = grant(ctx, r, excl.hosts(pattern))
                    if granted:
                        nxt = i  # the granted entry left the queue
                        lst = q.get(tenant)
                        h = heads[tenant] = [] if lst is None else lst[:lookahead]
                        sh = share(tenant)
                        feasible = feasible_shapes(st, rank)  # capacity shrank
                    else:
                        failed.add(fkey)
                        head = not blocked
                        blocked = True
                        can_preempt = preemptions < MAX_PREEMPTIONS_PER_PASS and may_preempt(ctx, r)
                        if head or can_preempt:
                            preemptions += can_preempt
                            if _blocked(ctx, r, rank, head=head, preempt=can_preempt):
                                excl = Exclusions(st, rank, ctx.now_ms)  # a reservation was made
                                failed.clear()
                        if head and not opts.backfill:
                            return budget, True
                        if not st.capacity.any_free():
                            break
        if nxt < len(h):
            heappush(heap, (sh, h[nxt][0], tenant, nxt))
    return budget, False
