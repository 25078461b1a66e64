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
  packing. Unlike FGD, which scores the *fragmented* GPU share of a node per
  class, this counts what stays *usable*, including capacity stranded by CPU
  or memory: a host whose CPU is nearly gone counts its idle GPUs as unusable.

Hosts with equal signatures are interchangeable, so each signature is scored
once (memoised per signature until the profile changes); gangs over several
hosts take the best signatures' hosts in order. Within a host, whole GPUs are
the lowest free indices and a GPU share goes to the fullest GPU that holds it.
"""

from __future__ import annotations

from collections.abc import Collection

from dagfold.services.allocator.capacity import Sig
from dagfold.services.allocator.model import FULL, NodeView, Part, RequestView
from dagfold.services.allocator.profile import usable
from dagfold.services.allocator.state import PoolState


def after_sig(sig: Sig, gpus: int, milli: int, cpu: int, mem: int) -> Sig:
    """The signature of a host in ``sig`` once one host-part is placed on it."""
    free = list(sig[2])
    if gpus == 1 and milli < FULL:
        best = -1
        for i, f in enumerate(free):
            if f >= milli and (best < 0 or f < free[best]):
                best = i
        free[best] -= milli
    elif gpus:
        took = 0
        for i, f in enumerate(free):
            if f == FULL:
                free[i] = 0
                took += 1
                if took == gpus:
                    break
    free.sort(reverse=True)
    return sig[0] - cpu, sig[1] - mem, tuple(free)


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


def _usable(st: PoolState, t: str, sig: Sig) -> float:
    k = (t, sig)
    u = st.usable_memo.get(k)
    if u is None:
        u = usable(t, sig, st.groups)
        st.usable_memo[k] = u
    return u


def place(st: PoolState, r: RequestView, excluded: Collection[str] = ()) -> list[Part] | None:
    """Parts for all ``r.hosts`` hosts, or None: all-or-nothing, nothing is held on failure."""
    gpus, milli, cpu, mem, hosts = r.gpus, r.per_gpu_milli(), r.cpu, r.mem, r.hosts
    policy = st.opts.placement
    alpha = st.opts.frag_pack_weight
    scored: list[tuple[tuple[float, ...], str, Sig, object]] = []
    for t, sig, ids in st.capacity.candidates(r.gpu_types, gpus, milli, cpu, mem):
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
            left = float(sum(after[2]))
            if policy == "bestfit":
                key = (left, float(after[0]))
            else:
                key = (_usable(st, t, sig) - _usable(st, t, after) + alpha * left,)
        scored.append((key, first, sig, ids))
    if not scored:
        return None
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
    if len(chosen) < hosts:
        return None
    parts = []
    for nid in chosen:
        n = st.nodes[nid]
        parts.append(Part(nid, choose_gpus(n, gpus, milli), milli if gpus else 0))
    return parts


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
