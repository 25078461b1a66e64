"""Reservations: the earliest start of a blocked head-of-line request, and who may use reserved hosts.

A reservation names the hosts that will first be able to hold the request,
computed from the running allocations' ``max_runtime_s`` (plus the runtime
grace, after which the allocator stops them), and the time that happens. Until
the request is placed, a request of the same or a lower tier may use a
reserved host only if its own ``max_runtime_s`` ends before that time (EASY
backfill): so backfill never delays the reservation. Higher tiers ignore lower
tiers' reservations (strict priority). Preemption claims are reservations too:
the hosts whose victims were asked to checkpoint are held for the preemptor.

The search is bounded (``reservation_scan_limit`` hosts, most free first), so
the reservation found may be later than the optimum, never earlier than real.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from dagfold.services.allocator.model import FULL, NodeView, RequestView
from dagfold.services.allocator.state import NEVER, PoolState


def part_fits(free: list[int], cpu_free: int, mem_free: int, gpus: int, milli: int, cpu: int, mem: int) -> bool:
    if cpu_free < cpu or mem_free < mem:
        return False
    if gpus == 0:
        return True
    if gpus == 1 and milli < FULL:
        return any(f >= milli for f in free)
    return sum(1 for f in free if f == FULL) >= gpus


def excluded_for(st: PoolState, r: RequestView, now_ms: int) -> set[str]:
    """Hosts ``r`` must leave alone: reserved for another request of its tier or a higher one."""
    res: dict[str, Any] = st.meta["reservations"]
    if not res:
        return set()
    rank = st.rank(r.tier)
    grace = int(st.opts.runtime_grace_s * 1000)
    out: set[str] = set()
    for key, v in res.items():
        if key == r.key or v["rank"] > rank:
            continue
        if v["kind"] == "backfill" and r.max_runtime_ms is not None \
                and now_ms + r.max_runtime_ms + grace <= v["start_ms"]:
            continue
        out.update(v["nodes"])
    return out


class Exclusions:
    """The reserved hosts each request of one tier must avoid, computed once per pass.

    A request must avoid a backfill reservation unless it ends before the
    reservation's start, i.e. unless its ``max_runtime_s`` is within that
    reservation's slack. Sorted by slack, the reservations a request must
    avoid are a prefix, so requests differ only in the length of that prefix:
    the sets are cached by it (usually one or two reservations)."""

    def __init__(self, st: PoolState, rank: int, now_ms: int) -> None:
        self.base: set[str] = set()
        self.backfill: list[tuple[int, list[str]]] = []
        self.owners: set[str] = set()
        grace = int(st.opts.runtime_grace_s * 1000)
        for key, v in st.meta["reservations"].items():
            if v["rank"] > rank:
                continue
            self.owners.add(key)
            if v["kind"] == "backfill":
                self.backfill.append((v["start_ms"] - now_ms - grace, v["nodes"]))
            else:
                self.base.update(v["nodes"])
        self.backfill.sort(key=lambda b: b[0])
        self.slacks = [slack for slack, _ in self.backfill]
        self.cache: dict[int, set[str]] = {0: set(self.base)}

    def pattern(self, r: RequestView) -> int:
        """How many backfill reservations (by slack) ``r`` may not run past: requests with equal patterns
        avoid the same hosts. ``r`` must not own a reservation of this tier."""
        mrt = r.max_runtime_ms
        slacks = self.slacks
        if not slacks:
            return 0
        return len(slacks) if mrt is None else bisect_left(slacks, mrt)  # reservations with slack < mrt

    def hosts(self, pattern: int) -> set[str]:
        """The hosts to avoid for a pattern (do not mutate: shared by the requests of that pattern)."""
        s = self.cache.get(pattern)
        if s is None:
            s = set(self.base)
            for _, nodes in self.backfill[:pattern]:
                s.update(nodes)
            self.cache[pattern] = s
        return s


def time_when_fits(st: PoolState, n: NodeView, r: RequestView, now_ms: int) -> int:
    """When host ``n`` could hold one part of ``r`` if every allocation there ran to its limit."""
    g, milli = r.gpus, r.per_gpu_milli()
    free = list(n.free)
    cpu_free, mem_free = n.cpu_free, n.mem_free
    if part_fits(free, cpu_free, mem_free, g, milli, r.cpu, r.mem):
        return now_ms
    grace = int(st.opts.runtime_grace_s * 1000)
    ends = []
    for aid in n.allocs:
        a = st.allocs[aid]
        end = a.end_by_ms(grace)
        ends.append((NEVER if end is None else max(end, now_ms), aid))
    ends.sort()
    for end, aid in ends:
        if end >= NEVER:
            return NEVER
        a = st.allocs[aid]
        for p in a.parts:
            if p.node == n.id:
                for gi in p.gpus:
                    free[gi] += p.milli
        cpu_free += a.req.cpu
        mem_free += a.req.mem
        if part_fits(free, cpu_free, mem_free, g, milli, r.cpu, r.mem):
            return end
    return NEVER


def earliest_start(st: PoolState, r: RequestView, now_ms: int,
                   excluded: set[str]) -> tuple[int, list[str]] | None:
    """(start, hosts) of the earliest reservation found for ``r``, or None if none can be promised.

    Two bounded sources of candidates: the hosts that will be entirely free
    first (the ``free_at`` index, exact for whole-host parts), and the hosts
    with the most free capacity now (``reservation_scan_limit`` of them).
    """
    limit = st.opts.reservation_scan_limit
    types = set(r.gpu_types)
    cands: dict[str, int] = {}

    def consider(nid: str, full_free_at: int | None = None) -> None:
        if nid in excluded or nid in cands:
            return
        n = st.nodes[nid]
        if (types and n.gpu_type not in types) or n.cpu < r.cpu or n.mem < r.mem or n.gpus < r.gpus:
            return
        if full_free_at is not None and n.gpus == r.gpus:
            cands[nid] = max(full_free_at, now_ms)  # a whole-host part fits exactly when the host is empty
            return
        tw = time_when_fits(st, n, r, now_ms)
        if tw < NEVER:
            cands[nid] = tw

    exact = 0
    for looked, (t, nid) in enumerate(st.free_at):
        if t >= NEVER or looked >= 4 * limit or exact >= r.hosts or len(cands) >= r.hosts + limit:
            break
        before = len(cands)
        consider(nid, t)
        if len(cands) > before and st.nodes[nid].gpus == r.gpus:
            exact += 1
    if exact < r.hosts:  # partial parts may fit on busy hosts earlier: look at the freest ones too
        scanned = 0
        for t in st.capacity.type_names(r.gpu_types):
            by_l1 = st.capacity.types[t]
            for l1 in sorted(by_l1, reverse=True):
                for ids in by_l1[l1].values():
                    for nid in ids:
                        consider(nid)
                        scanned += 1
                        if scanned >= limit:
                            break
                    if scanned >= limit:
                        break
                if scanned >= limit:
                    break
    if len(cands) < r.hosts:
        return None
    chosen = sorted((tw, nid) for nid, tw in cands.items())[:r.hosts]
    return max(tw for tw, _ in chosen), sorted(nid for _, nid in chosen)


def is_stale(st: PoolState, v: dict[str, Any], now_ms: int) -> bool:
    """A reservation whose time has come without its request fitting, or that lost a host."""
    if now_ms > v["start_ms"]:
        return True
    return any(st.nodes.get(nid) is None or st.nodes[nid].state != "up" for nid in v["nodes"])
