"""frag's score of a batch of host states, compiled: ``usable`` before and after one part, per signature.

``profile.usable`` is the definition (plain Python, one host state at a time); this module computes the
same integers for many live signatures of the capacity index at once, in a loop compiled by numba. Why
compiled: a decision that meets a new request shape scores every live signature that can hold it (up to
~1,000 on the FGD traces), and a catch-up the signatures born since the shape's last decision. In Python
that is ~8 us per host state (a loop over ~80-130 classes), with numpy ~2-4 us per state plus ~90 us of
fixed cost per batch (a dozen array passes over states x classes); compiled, ~0.5-0.7 us per state and ~6 us
per call. ``usable`` in integer arithmetic (int64; the weights are integers, ``group_classes``), so
it equals the plain one to the last bit whatever the order of the sums; the CPU balance and remainder terms
(``profile.stranded``, ``profile.remainder_waste``) in the same float operations, in the same order, as
their plain definitions (the tests hold the scores equal to the bit).

The kernel is compiled once per machine (numba's on-disk cache; ``warm`` at start-up, so that no decision
pays the compilation) and is deterministic: no wall clock, no randomness, no threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

from dagfold.services.allocator.model import FULL
from dagfold.services.allocator.profile import FILL_RATE, Class, Groups, remainder_waste, share_sizes

F = TypeVar("F", bound=Callable[..., Any])


def _compiled(fn: F) -> F:
    """numba's compilation, cached on disk: next to this file, else in the user's cache folder, else in
    ``NUMBA_CACHE_DIR``. Where none is writable (a read-only install without a home folder), numba refuses
    to cache at import; then the kernel is compiled in each process instead (~1.7 s at start-up)."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)  # type: ignore[no-any-return,return-value]
    except RuntimeError:
        return numba.njit(nogil=True)(fn)  # type: ignore[no-any-return,return-value]


@_compiled
def _usable(cpu_free: int, mem_free: int, free: np.ndarray, width: int, share_milli: np.ndarray,
            whole_gpus: np.ndarray, col: np.ndarray, cpu: np.ndarray, mem: np.ndarray, share: np.ndarray,
            wt: np.ndarray, n0: np.ndarray) -> int:  # pragma: no cover  (compiled; equals profile.usable)
    full = 0
    for j in range(width):
        if free[j] == FULL:
            full += 1
    ns = share_milli.shape[0]
    for s in range(ns):  # slots of each GPU-share size: whole GPUs' first, then each partial GPU's
        m = share_milli[s]
        n = full * (FULL // m)
        for j in range(width):
            f = free[j]
            if 0 < f < FULL:
                n += f // m
        n0[s] = n
    for g in range(whole_gpus.shape[0]):
        n0[ns + g] = full // whole_gpus[g]
    u = 0
    for c in range(col.shape[0]):
        w = wt[c]
        if w == 0:  # a class this host's GPU type may not serve
            continue
        n = n0[col[c]]
        if n == 0:
            continue
        if cpu[c] and cpu_free < cpu[c] * n:
            n = cpu_free // cpu[c]
        if mem[c] and mem_free < mem[c] * n:
            n = mem_free // mem[c]
        if n:
            u += w * (n if share[c] else full)
    return u


_remainder_waste = _compiled(remainder_waste)  # the same function as profile's, compiled


@_compiled
def _scores(rows: np.ndarray, row_type: np.ndarray, slots: np.ndarray, gpus: int, milli: int, cpu: int,
            mem: int, share_milli: np.ndarray, whole_gpus: np.ndarray, col: np.ndarray, ccpu: np.ndarray,
            cmem: np.ndarray, share: np.ndarray, weights: np.ndarray, scale: int, pw: float, bw: float,
            ratio: float, waste: np.ndarray, rw: float) -> np.ndarray:  # pragma: no cover  (compiled)
    width = rows.shape[1] - 2
    n0 = np.zeros(share_milli.shape[0] + whole_gpus.shape[0], dtype=np.int64)
    after = np.zeros(width, dtype=np.int64)
    out = np.empty(slots.shape[0], dtype=np.float64)
    for k in range(slots.shape[0]):
        row = rows[slots[k]]
        wt = weights[row_type[slots[k]]]
        free = row[2:]
        before = _usable(row[0], row[1], free, width, share_milli, whole_gpus, col, ccpu, cmem, share, wt, n0)
        left = 0
        for j in range(width):
            after[j] = free[j]
            left += free[j]
        gpu_free = left
        rest = 0.0  # profile.remainder_change
        if gpus == 1 and milli < FULL:  # the fullest GPU that holds the share: the last of those >= milli
            i = -1
            for j in range(width):
                if free[j] >= milli:
                    i = j
            after[i] -= milli
            left -= milli
            tw = waste[row_type[slots[k]]]
            rest = tw[after[i]] - tw[free[i]]
        elif gpus:  # sorted from the most free: the first ``gpus`` are whole
            for j in range(gpus):
                after[j] = 0
            left -= gpus * FULL
        u = _usable(row[0] - cpu, row[1] - mem, after, width, share_milli, whole_gpus, col, ccpu, cmem, share,
                    wt, n0)
        balance = 0.0  # profile.stranded after minus before
        if ratio > 0.0:
            balance = max(0.0, left - (row[0] - cpu) * ratio) - max(0.0, gpu_free - row[0] * ratio)
        out[k] = (before - u) / scale + pw * left + bw * balance + rw * rest
    return out


class Scorer:
    """One profile's classes as the kernel's tables: per class (a column) its size's slot in the fit counts,
    CPU, memory, whether it takes a GPU share, and per GPU type its integer weight (0 where the class may
    not use the type; a row per type of the capacity index, added as types appear), with the score's
    weights, the mix's GPU milli per mCPU (``profile.gpu_per_cpu``) and, per GPU type, the expected idle
    milli of a GPU remainder (``profile.remainder_waste`` of the profile's ``classes``)."""

    def __init__(self, groups: Groups, scale: int, pack_weight: float, balance_weight: float = 0.0,
                 ratio: float = 0.0, classes: list[Class] | None = None, remainder_weight: float = 0.0) -> None:
        shares = sorted({m for g, m, _, _ in groups if g == 1 and m < FULL})
        wholes = sorted({g for g, m, _, _ in groups if not (g == 1 and m < FULL)})
        self.share_milli = np.array(shares, dtype=np.int64)
        self.whole_gpus = np.array(wholes, dtype=np.int64)
        members: list[tuple[int, int, int, bool, int, frozenset[str]]] = []
        for g, m, types, ms in groups:
            is_share = g == 1 and m < FULL
            c = shares.index(m) if is_share else len(shares) + wholes.index(g)
            members += [(c, mc, mm, is_share, w, types) for mc, mm, w in ms]
        self.col = np.array([x[0] for x in members], dtype=np.int64)
        self.cpu = np.array([x[1] for x in members], dtype=np.int64)
        self.mem = np.array([x[2] for x in members], dtype=np.int64)
        self.share = np.array([x[3] for x in members], dtype=np.bool_)
        self._members = [(x[4], x[5]) for x in members]
        self.weights = np.zeros((0, len(members)), dtype=np.int64)  # GPU type (capacity index's number) x class
        # the kernel's argument types fixed (an int weight would make numba compile a second version of it
        # inside a decision, after ``warm``)
        self.scale = int(scale)
        self.pack_weight = float(pack_weight)
        self.balance_weight = float(balance_weight)
        self.ratio = float(ratio)
        self.classes = classes or []
        self.remainder_weight = float(remainder_weight)
        self.waste = np.zeros((0, FULL + 1), dtype=np.float64)  # GPU type (capacity index's number) x remainder
        self._tables: dict[bytes, np.ndarray] = {}  # types that serve the same share sizes share a table

    def _types(self, type_list: list[str]) -> None:
        rows = [[w if not ts or t in ts else 0 for w, ts in self._members] for t in type_list[len(self.weights):]]
        self.weights = np.concatenate([self.weights, np.array(rows, dtype=np.int64).reshape(len(rows), -1)])
        tables = []
        for t in type_list[len(self.waste):]:
            sizes, freq = share_sizes(self.classes, t)
            key = sizes.tobytes() + freq.tobytes()
            if key not in self._tables:
                self._tables[key] = _remainder_waste(sizes, freq, FILL_RATE)
            tables.append(self._tables[key])
        self.waste = np.concatenate([self.waste, np.array(tables, dtype=np.float64).reshape(len(tables), FULL + 1)])

    def scores(self, rows: np.ndarray, row_type: np.ndarray, type_list: list[str], slots: np.ndarray, gpus: int,
               milli: int, cpu: int, mem: int) -> np.ndarray:
        """frag's score of one part ``gpus x milli, cpu, mem`` on each of these live signatures (rows of the
        capacity index): ``(usable(s) - usable(s')) / scale + pack_weight x GPU milli left + balance_weight x
        (stranded(s') - stranded(s)) + remainder_weight x remainder_change`` (``profile``)."""
        if len(type_list) > len(self.weights):
            self._types(type_list)
        return _scores(rows, row_type, slots, gpus, milli, cpu, mem, self.share_milli, self.whole_gpus,  # type: ignore[no-any-return]
                       self.col, self.cpu, self.mem, self.share, self.weights, self.scale, self.pack_weight,
                       self.balance_weight, self.ratio, self.waste, self.remainder_weight)


def warm() -> None:
    """Compile (or load from numba's cache) the kernel now, not in the first decision that scores."""
    sc = Scorer([(1, 500, frozenset(), [(1000, 1000, 1)]), (2, FULL, frozenset(), [(0, 0, 1)])], 1, 0.001, 4.0, 0.5,
                [(1, 500, 1000, 1000, (), 0.5), (2, FULL, 0, 0, (), 0.5)], 20.0)
    rows = np.array([[4000, 4000, FULL, FULL, 700, 0]], dtype=np.int64)
    sc.scores(rows, np.zeros(1, dtype=np.intp), ["A"], np.zeros(1, dtype=np.intp), 1, 500, 0, 0)
