"""Victim selection: which lower-tier allocations to checkpoint and stop so a request fits.

Rules that make preemption safe:

* only strictly lower tiers are ever victims, so a requeued victim can never
  preempt its preemptor (or anyone of its tier): the "preempts" relation goes
  strictly down the tier order and cannot form a cycle;
* victims already being preempted are not chosen twice, and hosts already
  claimed by another reservation of the same or a higher tier are skipped;
* per host, victims are added in order of least importance (lowest tier,
  least work lost since their last checkpoint, most over their fair share)
  until the request's part fits; hosts are then ranked by the work they would
  lose (GPU-minutes since last checkpoint; since start for jobs that cannot
  checkpoint), then the highest tier touched, then the fair-share excess.

The scan is bounded by ``preempt_scan_limit`` hosts, lowest tiers first.
"""

from __future__ import annotations

import heapq

from dagfold.services.allocator.model import FULL, AllocView, RequestView
from dagfold.services.allocator.state import PoolState


def lost_work_gpu_min(a: AllocView, now_ms: int) -> float:
    """GPU-minutes of work ``a`` loses if stopped now (since its last checkpoint, or its start)."""
    since = a.last_ckpt_ms if (a.req.checkpoint and a.last_ckpt_ms is not None) else a.granted_ms
    return a.req.total_milli / 1000 * max(0, now_ms - since) / 60000


def find_victims(st: PoolState, r: RequestView, now_ms: int,
                 excluded: set[str]) -> tuple[list[str], list[AllocView]] | None:
    """(hosts, victims) that make ``r`` fit once the victims stop, or None."""
    rank = st.rank(r.tier)
    ntiers = len(st.opts.tiers) + 1
    g, milli, cpu, mem = r.gpus, r.per_gpu_milli(), r.cpu, r.mem
    share_req = g == 1 and milli < FULL
    types = set(r.gpu_types)
    limit = st.opts.preempt_scan_limit
    nodes, allocs, rank_of = st.nodes, st.allocs, st.rank
    excess: dict[tuple[str, str], float] = {}  # (tier, tenant) -> share_excess, once per scan
    scanned = 0
    seen: set[str] = set()
    options: list[tuple[tuple[float, int, float], str, list[AllocView]]] = []
    for low in range(ntiers, rank, -1):
        hosts = st.tier_hosts.get(low)
        if not hosts:
            continue
        for nid in hosts:  # sorted host IDs
            if nid in seen or nid in excluded:
                continue
            seen.add(nid)
            n = nodes[nid]
            if n.state != "up" or (types and n.gpu_type not in types) or len(n.free) < g:
                continue
            scanned += 1
            # (-tier rank, lost work, -fair-share excess, ID): the order in which victims are added
            cands: list[tuple[int, float, float, str, AllocView]] = []
            for x in n.allocs:
                a = allocs[x]
                if a.state != "running":
                    continue
                if n.cordoned and any(gi in n.cordoned for p in a.parts if p.node == nid for gi in p.gpus):
                    continue  # its GPUs are cordoned: stopping it frees nothing placeable (it is moving anyway)
                q = a.req
                ar = rank_of(q.tier)
                if ar <= rank:
                    continue
                tk = (q.tier, q.tenant)
                ex = excess.get(tk)
                if ex is None:
                    ex = excess[tk] = share_excess(st, a)
                cands.append((-ar, lost_work_gpu_min(a, now_ms), -ex, a.id, a))
            if not cands:
                continue
            if len(cands) > 1:
                cands.sort()  # IDs are unique: the views themselves are never compared
            # add victims until the part fits (reservations.part_fits). A whole-GPU part's GPUs are its own,
            # so freeing it makes exactly its GPUs whole again: counted, until a GPU share needs the list.
            nfree = n.free
            full = nfree.count(FULL)
            freed: list[int] = []  # GPUs made whole so far
            free: list[int] | None = None
            cpu_free, mem_free = n.cpu_free, n.mem_free
            for k, c in enumerate(cands):
                a = c[4]
                for p in a.parts:
                    if p.node != nid:
                        continue
                    if free is None and p.milli == FULL:
                        full += len(p.gpus)
                        freed.extend(p.gpus)
                        continue
                    if free is None:
                        free = list(nfree)
                        for gi in freed:
                            free[gi] += FULL
                    for gi in p.gpus:
                        free[gi] += p.milli
                cpu_free += a.req.cpu
                mem_free += a.req.mem
                if cpu_free < cpu or mem_free < mem:
                    continue
                if free is not None:
                    ok = g == 0 or (max(free) >= milli if share_req else free.count(FULL) >= g)
                else:
                    ok = g == 0 or ((full > 0 or max(nfree) >= milli) if share_req else full >= g)
                if ok:
                    if k == 0:  # one victim (the common case): the same key without the sums
                        options.append(((round(c[1], 1), ntiers + c[0], c[2]), nid, [a]))
                    else:
                        chosen = cands[:k + 1]
                        options.append(((round(sum(c[1] for c in chosen), 1), ntiers + max(c[0] for c in chosen),
                                         -sum(-c[2] for c in chosen)), nid, [c[4] for c in chosen]))
                    break
            if scanned >= limit:
                break
        if scanned >= limit:
            break
    if len(options) < r.hosts:
        return None
    # by key, then host ID (unique: the victim lists are never compared)
    best = [min(options)] if r.hosts == 1 else heapq.nsmallest(r.hosts, options)
    victims: dict[str, AllocView] = {}
    for _, _, vs in best:
        for v in vs:
            victims[v.id] = v
    return sorted(nid for _, nid, _ in best), [victims[k] for k in sorted(victims)]


def share_excess(st: PoolState, a: AllocView) -> float:
    """How far ``a``'s tenant is into its tier: usage over weight (more is preempted first)."""
    return st.usage.get((a.req.tier, a.req.tenant), 0) / st.weight(a.req.tenant)
