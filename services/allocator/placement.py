"""Where a request goes: feasibility through the capacity index, then a score per signature.

Policies (``AllocatorOptions.placement``):

* ``firstfit``: the lowest host ID that fits (the FIFO baseline's placement);
* ``bestfit``: the host left with the least free GPU (then CPU) after placement;
* ``frag`` (default): *usable-capacity-preserving* placement. For a host state
  ``s`` let ``U(s)`` be the GPU milli that the learned request mix could still
  use there: for each request class, how many such requests fit at once
  (counting whole GPUs, fractional GPU slots, CPU and memory), times their size,
  weighted by the class's frequency (``profile``). Placing the request takes
  ``s`` to ``s'``; frag picks the host that loses the least usable capacity,
  ``U(s) - U(s')``, plus a small best-fit term that breaks near-ties towards
  packing, plus a balance term (the change in the host's GPU milli that its
  free CPU could not serve at the mix's CPU per GPU, ``profile.stranded``) and,
  for a GPU share, a remainder term (the change in the expected idle milli of
  the GPU that takes it, ``profile.remainder_waste``). Unlike FGD, which scores the *fragmented* GPU share of a node per
  class, this counts what stays *usable*, including capacity stranded by CPU
  or memory: a host whose CPU is nearly gone counts its idle GPUs as unusable.

Hosts with equal signatures are interchangeable, so frag scores signatures, not
hosts, and keeps them ranked per request shape (``Ranking``: incremental, a
decision scores only the signatures born since the shape's last decision);
ties go to the signature with the least CPU then memory free. The baselines
score every signature that fits at each decision, ties to the lowest host
ID. Gangs over several hosts take the best signatures' hosts in order. Within a host, whole GPUs are
the lowest free indices and a GPU share goes to the fullest GPU that holds it.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

import numpy as np

from dagfold.services.allocator.capacity import L1, CapacityIndex, Sig, l1_fits
from dagfold.services.allocator.model import FULL, NodeView, Part, RequestView
from dagfold.services.allocator.scoring import Scorer
from dagfold.services.allocator.state import PoolState


def after_sig(sig: Sig, gpus: int, milli: int, cpu: int, mem: int) -> Sig:
    """The signature of a host in ``sig`` once one host-part is placed on it (``sig[2]`` is sorted from the
    most free GPU down, so whole GPUs come first and a GPU share goes to the last GPU that holds it)."""
    free = sig[2]
    if gpus == 1 and milli < FULL:
        i = len(free) - 1
        while free[i] < milli:
            i -= 1
        v = free[i] - milli
        rest = free[:i] + free[i + 1:]
        j = i
        while j < len(rest) and rest[j] > v:
            j += 1
        return sig[0] - cpu, sig[1] - mem, rest[:j] + (v,) + rest[j:]
    if gpus:
        return sig[0] - cpu, sig[1] - mem, free[gpus:] + (0,) * gpus
    return sig[0] - cpu, sig[1] - mem, free


def choose_gpus(n: NodeView, gpus: int, milli: int) -> list[int]:
    if gpus == 0:
        return []
    if gpus == 1 and milli < FULL:
        best = -1
        for i, f in enumerate(n.free):
            if f >= milli and (best < 0 or f < n.free[best]):
                best = i
        return [best]
    return [i for i, f in enumerate(n.free) if f == FULL][:gpus]


RankKey = tuple[float, int, int, str, tuple[int, ...], int]  # score, CPU, memory, type, GPUs, birth
Cand = tuple[str, L1, Sig]
DEAD_POPS = 64  # a query that meets this many dead entries drops every dead entry of the heap at once
SCAN_BIRTHS = 32  # a catch-up over more births than this scans the capacity rows (numpy) instead of the births


def frag_scores(st: PoolState, cands: list[Cand], gpus: int, milli: int, cpu: int, mem: int,
                slots: np.ndarray | None = None) -> list[float]:
    """frag's score of placing one part on each live signature (lower is better): the usable capacity lost,
    ``U(s) - U(s')``, plus the best-fit, balance and remainder terms; computed over the capacity index's rows
    (``slots``: theirs, if the caller has them) by the compiled kernel (``scoring``), equal to the numbers of
    ``profile.usable``, ``profile.stranded`` and ``profile.remainder_change``."""
    cap = st.capacity
    sc = st.scorer
    if sc is None:
        sc = st.scorer = Scorer(st.groups, st.weight_scale, st.opts.frag_pack_weight, st.opts.frag_balance_weight,
                                st.gpu_per_cpu, st.classes, st.opts.frag_remainder_weight)
    cap.arrays()
    if slots is None:
        slot_of = cap.slot_of
        slots = np.array([slot_of[(t, sig)] for t, _, sig in cands], dtype=np.intp)
    return sc.scores(cap.rows, cap.row_type, cap.type_list, slots, gpus, milli, cpu, mem).tolist()  # type: ignore[no-any-return]


class Ranking:
    """frag's live signatures that can hold one part of a shape, best score first (a cache of the state).

    A signature's score for a shape depends on the signature and the learned profile only, so an entry
    stays right for as long as the profile does (``PoolState.regroup`` drops every ranking). The ranking
    is kept incrementally: a query first scores the signatures born in the capacity index since its last
    query (``CapacityIndex.births``), then takes the best entries of a heap, dropping those of signatures
    no host has any more as it meets them. Per decision that is the births since the shape's last query
    plus the dead entries met, not the number of hosts or signatures; the full scan is paid once per shape
    and profile (and when the shape fell behind the births log, or its heap holds over twice the live
    signatures), compiled (``frag_scores``, ``scoring``). Ties go to the signature with the least CPU, then memory,
    free: packing.

    An entry carries its signature's birth number: it is live while the capacity index has that number
    (an int lookup, no hashing of the signature), and a signature that died and was born again since
    comes back as a new entry with the same score and a new number (the old entry is dropped when met,
    so the live entries, and the order in which they come, are those of a ranking rebuilt from scratch).
    """

    __slots__ = ("cursor", "heap")

    def __init__(self, cursor: int) -> None:
        self.heap: list[RankKey] = []
        self.cursor = cursor


def _keys(st: PoolState, births: list[int], cands: list[Cand], gpus: int, milli: int, cpu: int, mem: int,
          slots: np.ndarray | None = None) -> list[RankKey]:
    scores = frag_scores(st, cands, gpus, milli, cpu, mem, slots)
    return [(score, sig[0], sig[1], t, sig[2], b)
            for score, (t, _l1, sig), b in zip(scores, cands, births, strict=True)]


def _at_slots(cap: CapacityIndex, slots: np.ndarray) -> tuple[list[Cand], list[int]]:
    """The signatures in these live slots of the capacity index, and their birth numbers."""
    at, birth_at = cap.at, cap.birth_at
    order = slots.tolist()
    return [at[i] for i in order], [birth_at[i] for i in order]  # type: ignore[misc]  # (live slots)


def _ranking(st: PoolState, r: RequestView, gpus: int, milli: int, cpu: int, mem: int) -> Ranking:
    cap = st.capacity
    q = (r.gpu_types, gpus, milli, cpu, mem)
    end = cap.births
    rk = st.rankings.get(q)
    if rk is None:
        rk = st.rankings[q] = Ranking(end)
        every = cap.candidate_slots(r.gpu_types, gpus, milli, cpu, mem)
        cands, births = _at_slots(cap, every)
        rk.heap = _keys(st, births, cands, gpus, milli, cpu, mem, every)
        heapq.heapify(rk.heap)
        return rk
    born = cap.born
    if len(rk.heap) > 2 * cap.n_sigs + 64:
        # mostly dead entries (a shape seldom asked for while hosts change): keep the live ones, scores and
        # all, instead of popping the dead one by one in later queries
        live = [k for k in rk.heap if k[5] in born]
        heapq.heapify(live)
        rk.heap = live
    if rk.cursor >= end:
        return rk
    slots: np.ndarray | None = None
    if end - rk.cursor > SCAN_BIRTHS:
        # a shape seldom asked for, many births behind: one numpy scan of the live signatures born since
        # (and that fit) instead of a Python loop over the births; the same entries, so the same ranking
        slots = cap.candidate_slots(r.gpu_types, gpus, milli, cpu, mem, born_from=rk.cursor)
        new, births = _at_slots(cap, slots)
    else:
        types = r.gpu_types
        new, births = [], []
        for b, c in cap.born_since(rk.cursor, gpus, milli):
            t, l1, sig = c
            if (types and t not in types) or sig[0] < cpu or sig[1] < mem or not l1_fits(l1, gpus, milli):
                continue
            new.append(c)
            births.append(b)
    if new:
        heap = rk.heap
        for key in _keys(st, births, new, gpus, milli, cpu, mem, slots):
            heapq.heappush(heap, key)
    rk.cursor = end
    return rk


def _place_ranked(st: PoolState, r: RequestView, excluded: Collection[str], gpus: int, milli: int, cpu: int,
                  mem: int) -> list[str]:
    """frag: hosts for the gang from the shape's ranking, best signature first."""
    rk = _ranking(st, r, gpus, milli, cpu, mem)
    cap = st.capacity
    born = cap.born
    hosts = r.hosts
    heap = rk.heap
    chosen: list[str] = []
    seen: list[RankKey] = []
    dead = 0
    while heap and len(chosen) < hosts:
        key = heapq.heappop(heap)
        loc = born.get(key[5])
        if loc is None:  # no host has this signature any more (or it was born again: a newer entry)
            dead += 1
            if dead == DEAD_POPS:  # the top is mostly dead (hosts placed on since): drop them all at once
                heap[:] = [k for k in heap if k[5] in born]
                heapq.heapify(heap)
            continue
        seen.append(key)
        for nid in cap.hosts_of(*loc):  # type: ignore[union-attr]  # (a live signature has hosts)
            if nid not in excluded:
                chosen.append(nid)
                if len(chosen) == hosts:
                    break
    for key in seen:
        heapq.heappush(heap, key)
    return chosen


def place(st: PoolState, r: RequestView, excluded: Collection[str] = ()) -> list[Part] | None:
    """Parts for all ``r.hosts`` hosts, or None: all-or-nothing, nothing is held on failure."""
    gpus, milli, cpu, mem, hosts = r.gpus, r.per_gpu_milli(), r.cpu, r.mem, r.hosts
    policy = st.opts.placement
    if policy == "frag":
        chosen = _place_ranked(st, r, excluded, gpus, milli, cpu, mem)
    else:
        chosen = _place_scanned(st, r, excluded, policy)
    if len(chosen) < hosts:
        return None
    parts = []
    for nid in chosen:
        n = st.nodes[nid]
        parts.append(Part(nid, choose_gpus(n, gpus, milli), milli if gpus else 0))
    return parts


def _place_scanned(st: PoolState, r: RequestView, excluded: Collection[str], policy: str) -> list[str]:
    """The baselines (best-fit, first-fit): every signature that fits, scored at each decision."""
    gpus, milli, cpu, mem, hosts = r.gpus, r.per_gpu_milli(), r.cpu, r.mem, r.hosts
    scored: list[tuple[tuple[float, ...], str, Sig, object]] = []
    for _t, sig, ids in st.capacity.candidates(r.gpu_types, gpus, milli, cpu, mem):
        first = None
        for nid in ids:
            if nid not in excluded:
                first = nid
                break
        if first is None:
            continue
        if policy == "firstfit":
            key: tuple[float, ...] = (0.0,)
        else:
            after = after_sig(sig, gpus, milli, cpu, mem)
            key = (float(sum(after[2])), float(after[0]))
        scored.append((key, first, sig, ids))
    scored.sort(key=lambda s: (s[0], s[1]))
    chosen: list[str] = []
    for _key, first, _sig, ids in scored:
        if hosts == 1:
            chosen.append(first)
            break
        for nid in ids:  # type: ignore[attr-defined]
            if nid not in excluded:
                chosen.append(nid)
                if len(chosen) == hosts:
                    break
        if len(chosen) == hosts:
            break
    return chosen


def fits_now(st: PoolState, r: RequestView) -> bool:
    """Cheap necessary condition (no scoring): enough hosts could each hold one part right now."""
    return st.capacity.hosts_with(r.gpu_types, r.gpus, r.per_gpu_milli(), r.hosts)


def feasible_shapes(st: PoolState, rank: int) -> set[tuple[object, ...]]:
    """GPU shapes queued in a tier that the capacity index does not rule out right now (do not mutate:
    the set is memoised until the capacity index or the tier's queued shapes change)."""
    cap = st.capacity
    stamp = (cap.version, st.shapes_version)
    memo = st.feasible_memo.get(rank)
    if memo is not None and memo[0] == stamp:
        return memo[1]
    out = {gs for gs in st.queued_shapes.get(rank, {}) if cap.hosts_with(gs[0], gs[1], gs[2], gs[3])}
    st.feasible_memo[rank] = (stamp, out)
    return out


def could_ever_fit(st: PoolState, r: RequestView) -> str | None:
    """Why ``r`` can never be placed with the registered inventory, or None if it could.

    A pool with no host registered yet (an allocator started before its agents) judges nothing:
    requests wait for the inventory instead of failing on a start-up race.
    """
    if not st.gpu_types:
        return None
    types = [t for t in (r.gpu_types or tuple(st.gpu_types)) if t in st.gpu_types]
    if not types:
        want = "|".join(r.gpu_types) if r.gpu_types else "any"
        return f"no registered host has GPU type {want}"
    if max(st.gpu_types[t] for t in types) < r.gpus:
        return f"{r.gpus} GPUs per host requested; the largest host of {'|'.join(types)} has " \
               f"{max(st.gpu_types[t] for t in types)}"
    # hosts big enough for one part of the gang (a handful of distinct host sizes per type)
    hosts = sum(c for t in types for g, c in st.type_sizes.get(t, {}).items() if g >= r.gpus)
    if hosts < r.hosts:
        return f"{r.hosts} hosts of {r.gpus} GPUs requested; the pool has {hosts} such hosts of {'|'.join(types)}"
    if r.cpu > st.max_cpu or r.mem > st.max_mem:
        return f"{r.cpu} mCPU / {r.mem} MiB requested; the largest host has {st.max_cpu} mCPU / {st.max_mem} MiB"
    return None
