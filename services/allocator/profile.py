"""The learned request-shape distribution that frag placement scores against.

Placement wants to leave hosts in states that future requests can use. What
"future requests" look like is learned online from the requests this pool has
seen (no trace is consulted): a count per shape ``(gpus, milli, cpu, memory,
allowed GPU types)``, and every ``profile_refresh`` requests the most frequent
``profile_max_classes`` shapes become the active classes with weights
proportional to their counts. The counts live in the store, one key per shape
(updated by the RequestQueued applier), so the profile, and hence every
placement decision, is part of the replayable state.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dagfold.services.allocator.model import FULL

Class = tuple[int, int, int, int, tuple[str, ...], float]  # gpus, per-GPU milli, cpu, mem, types, weight


def shape_key(gpus: int, milli: int, cpu: int, mem: int, types: tuple[str, ...]) -> str:
    return f"{gpus}|{milli}|{cpu}|{mem}|{','.join(types)}"


def parse_key(k: str) -> tuple[int, int, int, int, tuple[str, ...]]:
    g, m, c, mem, t = k.split("|", 4)
    return int(g), int(m), int(c), int(mem), tuple(x for x in t.split(",") if x)


def empty_profile() -> dict[str, Any]:
    return {"n": 0, "active": []}


def should_refresh(n: int, every: int) -> bool:
    """Early refreshes while the profile is young, then every ``every`` requests."""
    return n in (16, 64, 256) or (n > 0 and n % every == 0)


def active_classes(counts: dict[str, int], max_classes: int) -> list[list[Any]]:
    """Top GPU shapes by count (ties by key), as stored records ``[g, milli, cpu, mem, types, weight]``."""
    gpu_shapes = [kv for kv in counts.items() if not kv[0].startswith("0|")]  # CPU-only shapes use no GPU
    top = sorted(gpu_shapes, key=lambda kv: (-kv[1], kv[0]))[:max_classes]
    total = sum(c for _, c in top) or 1
    out: list[list[Any]] = []
    for k, c in top:
        g, m, cpu, mem, types = parse_key(k)
        out.append([g, m, cpu, mem, list(types), c / total])
    return out


def drift(old: list[list[Any]], new: list[list[Any]]) -> float:
    """Total variation distance between two active profiles' class weights (0: same mix, 1: disjoint)."""
    w: dict[tuple[Any, ...], float] = {}
    for a in old:
        k = (a[0], a[1], a[2], a[3], tuple(a[4]))
        w[k] = w.get(k, 0.0) + a[5]
    for a in new:
        k = (a[0], a[1], a[2], a[3], tuple(a[4]))
        w[k] = w.get(k, 0.0) - a[5]
    return 0.5 * sum(abs(v) for v in w.values())


def to_classes(active: list[list[Any]]) -> list[Class]:
    return [(a[0], a[1], a[2], a[3], tuple(a[4]), a[5]) for a in active]


def fit_count(gpu_type: str, cpu_free: int, mem_free: int, free: tuple[int, ...], c: Class) -> int:
    """How many requests of class ``c`` a host in this state could hold at once, if only they came."""
    g, milli, cpu, mem, types, _ = c
    if g == 0 or (types and gpu_type not in types):
        return 0
    if g == 1 and milli < FULL:
        n = 0
        for f in free:
            n += f // milli
    else:
        n = sum(1 for f in free if f == FULL) // g
    if cpu and n:
        n = min(n, cpu_free // cpu)
    if mem and n:
        n = min(n, mem_free // mem)
    return n


def gpu_per_cpu(classes: list[Class]) -> float:
    """GPU milli the learned mix asks per mCPU it asks (classes weighted by frequency; 0.0 when none asks CPU):
    the ratio at which a host's free CPU serves its free GPUs (``stranded``)."""
    gpu = cpu = 0.0
    for g, milli, c, _mem, _types, w in classes:
        gpu += w * g * milli
        cpu += w * c
    return gpu / cpu if cpu else 0.0


def stranded(gpu_free: int, cpu_free: int, ratio: float) -> float:
    """GPU milli of a host that its free CPU cannot serve at the mix's ``ratio`` (``gpu_per_cpu``): what stays
    idle if requests like the mix's come. frag adds ``frag_balance_weight`` times its change to a placement's
    score. ``usable`` caps each class by the CPU left, one class at a time, so it does not see a host's CPU
    going to pods that ask more CPU per GPU than the mix while its GPUs wait for the rest of the mix: on the
    FGD protocol's multigpu50 trace the 470/650-milli pods (8-11 cores each) took the CPU of 12-cores-per-GPU
    hosts and left their GPUs' remainders unusable. The same formula serves one state (floats) and arrays of
    states (``scoring``), so both give the same score to the last bit. ``ratio`` 0 (no class asks CPU): 0."""
    return max(0.0, gpu_free - cpu_free * ratio) if ratio > 0.0 else 0.0


# How many GPU remainders compete for each arriving request that fits them (remainder_waste): fitted on the FGD
# protocol's default trace (10 seeds, remainder weight 10: rate 10 -> 4.05% unallocated, 30 -> 3.99%)
FILL_RATE = 30.0


def share_sizes(classes: list[Class], gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
    """The GPU-share classes a host of ``gpu_type`` may serve: their sizes (milli, ascending, int64) and the
    frequency of each size (float64), for ``remainder_waste``."""
    freq: dict[int, float] = {}
    for g, milli, _cpu, _mem, types, w in classes:
        if g == 1 and milli < FULL and (not types or gpu_type in types):
            freq[milli] = freq.get(milli, 0.0) + w
    sizes = sorted(freq)
    return np.array(sizes, dtype=np.int64), np.array([freq[m] for m in sizes], dtype=np.float64)


def remainder_waste(sizes: np.ndarray, freq: np.ndarray, rate: float) -> np.ndarray:
    """Expected milli a GPU with ``r`` milli free (r = 0..1000) ends up leaving idle, if GPU-share requests
    like the mix's (``share_sizes``) go on filling it: with probability ``min(1, rate x F(r))``, ``F(r)`` the
    frequency of the sizes that fit, one more request comes, drawn by frequency among those, and the GPU
    continues from ``r - size``; otherwise the ``r`` milli stay idle.

    frag adds ``frag_remainder_weight`` times the change of this on the GPU that takes a share: a
    pairing-aware view of the remainder that ``usable`` values class by class. E.g. on the FGD default
    trace a 320-milli share left in a 470's remainder (530 -> 210: only the rare <= 190-milli pods fit
    there) is worse than in a 650's (350 -> 30) or in another 320's (680 -> 360, which a 320 fills), and a
    470 beside another 470 (530 -> 60) is good: 60 milli is what that GPU was going to lose anyway. A whole
    GPU's value (r = 1000) comes from the same model, so the term is about even between a fresh GPU and a
    used one; keeping whole GPUs for whole-GPU requests is ``usable``'s part. Plain Python here (the
    definition); ``scoring`` runs this same function compiled, once per GPU type and profile."""
    e = np.zeros(FULL + 1, dtype=np.float64)
    for r in range(1, FULL + 1):
        fit = 0.0
        acc = 0.0
        for j in range(sizes.shape[0]):
            m = sizes[j]
            if m > r:
                break
            fit += freq[j]
            acc += freq[j] * e[r - m]
        if fit > 0.0:
            p = min(1.0, rate * fit)
            e[r] = (1.0 - p) * r + p * (acc / fit)
        else:
            e[r] = r
    return e


def remainder_change(free: tuple[int, ...], gpus: int, milli: int, waste: np.ndarray) -> float:
    """The change of ``remainder_waste`` (``waste``: the host type's table) on the GPU that takes one part of
    ``gpus x milli``: the fullest GPU that holds a share (``placement.after_sig``); 0.0 for whole GPUs."""
    if gpus != 1 or milli >= FULL:
        return 0.0
    g = min(f for f in free if f >= milli)
    return float(waste[g - milli] - waste[g])


Groups = list[tuple[int, int, frozenset[str], list[tuple[int, int, int]]]]
WEIGHT_BITS = 24  # class weights are integers in units of 2**-24 (fewer bits when the pool's sums would not fit)


def group_classes(classes: list[Class], type_gpus: dict[str, int] | None = None,
                  max_gpus: int = 8) -> tuple[Groups, int]:
    """Classes grouped by their GPU part ``(gpus, milli, types)``: the GPU fit count is computed once per
    group, and only the CPU/memory limits per class (``(cpu, mem, weight)``, see ``usable``).

    Weights are integers, the float weight times the returned ``scale`` (a power of two): ``usable`` is
    then an exact integer whatever the order of its sum, so the compiled scoring of many signatures at
    once (``scoring``) and the one-signature ``usable`` give the same value to the last bit and pick the
    same hosts. ``scale`` is ``2**WEIGHT_BITS``, or less when a host of ``max_gpus`` GPUs could make
    a sum reach 2**53 (float64 would round).

    Scarcity: a class that may only use some GPU types weighs more, by the
    square of the pool's GPUs over the GPUs of its types, so capacity that only
    few requests can use is kept for them and the others go elsewhere (the
    square: on gpuspec33, a third of the pods typed, the linear weight still
    let untyped pods take typed hosts first: 5.6% unallocated on seed 42, 5.2%
    with the square)."""
    total = sum((type_gpus or {}).values())
    groups: dict[tuple[int, int, tuple[str, ...]], list[tuple[int, int, float]]] = {}
    bound = 1.0  # the largest usable() could be, in float units
    for g, milli, cpu, mem, types, w in classes:
        if g == 0:
            continue
        per_unit = milli if g == 1 and milli < FULL else FULL  # a slot's milli; a whole GPU's
        scarcity = 1.0
        if types and total and type_gpus is not None:
            eligible = sum(type_gpus.get(t, 0) for t in types)
            scarcity = (total / eligible) ** 2 if eligible else 0.0
        wt = w * per_unit * scarcity
        bound += wt * (max_gpus * FULL // per_unit if per_unit < FULL else max_gpus)
        groups.setdefault((g, milli, types), []).append((cpu, mem, wt))
    bits = max(0, min(WEIGHT_BITS, 52 - math.ceil(math.log2(bound))))
    scale = 1 << bits
    return [(g, m, frozenset(t), [(c, mm, round(wt * scale)) for c, mm, wt in members])
            for (g, m, t), members in groups.items()], scale


TypeGroups = list[tuple[bool, int, int, list[tuple[int, int, int]]]]


def for_type(gpu_type: str, groups: Groups) -> TypeGroups:
    """The groups a host of ``gpu_type`` can serve, as ``(share, milli, gpus, members)``: what ``usable``
    loops over for every signature of that type (computed once per type and profile)."""
    return [(g == 1 and milli < FULL, milli, g, members) for g, milli, types, members in groups
            if not types or gpu_type in types]


def usable(sig: tuple[int, int, tuple[int, ...]], groups: TypeGroups) -> int:
    """Expected GPU milli of this host state that the learned request mix could still use (times the
    groups' weight scale: an integer, see ``group_classes``). This is the definition; placement computes
    it compiled, for many host states at once (``scoring``), and the tests hold the two equal.

    Per class, weighted by its frequency and scarcity:

    * a GPU-share class (one GPU, ``milli < 1000``) can use ``n x milli``, ``n``
      the slots it could take at once (free milli of each GPU over ``milli``,
      capped by the CPU and memory left);
    * a whole-GPU class of ``g`` GPUs can use every whole free GPU of the host
      as long as one request of it still fits there (``g`` whole GPUs, its CPU
      and memory), and nothing otherwise. Counting only ``g x floor(free/g)``
      (what that class alone could pack) penalised leaving, say, 7 free GPUs
      for a 2-GPU class, though the rest of the mix fills the odd one; the
      whole-GPU view cut multigpu50's unallocated share from 3.2-3.4% to 2.8%
      (seeds 42, 43) while GPU shares keep the exact slot count, which packs
      the default trace's fractional pods better than a free-milli view.
    """
    cpu_free, mem_free, free = sig
    full = free.count(FULL)
    partial = [f for f in free if 0 < f < FULL]
    u = 0
    for share, milli, g, members in groups:
        if share:
            n0 = full * (FULL // milli)
            for f in partial:
                n0 += f // milli
        else:
            n0 = full // g
        if not n0:
            continue
        for cpu, mem, wt in members:
            n = n0
            if cpu and cpu_free < cpu * n:
                n = cpu_free // cpu
            if mem and mem_free < mem * n:
                n = mem_free // mem
            if n:
                u += wt * (n if share else full)
    return u
