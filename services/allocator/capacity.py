"""The capacity index: up hosts bucketed by free capacity, per GPU type.

Two levels, so a placement looks at buckets, never at every host:

* level 1, per GPU type: ``(whole free GPUs, largest partial free milli)``; a
  request skips every level-1 bucket that cannot hold it without looking inside;
* level 2: the exact free-capacity signature ``(cpu free, memory free, free
  milli of each GPU, sorted)``; hosts with equal signatures are interchangeable
  for placement, so each signature is scored once and the lowest host ID in it
  is taken (a SortedList keeps that O(log n) and deterministic).

On 8-GPU hosts without shared GPUs there are at most nine buckets per type;
on the FGD trace (fractional GPUs, CPU and memory) signatures are more varied
but only those that can hold the request are looked at.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from sortedcontainers import SortedDict, SortedList

from dagfold.services.allocator.model import FULL, NodeView

Sig = tuple[int, int, tuple[int, ...]]
L1 = tuple[int, int]


def signature(n: NodeView) -> tuple[L1, Sig]:
    full = 0
    part = 0
    for f in n.free:
        if f == FULL:
            full += 1
        elif f > part:
            part = f
    return (full, part), (n.cpu_free, n.mem_free, tuple(sorted(n.free, reverse=True)))


def l1_fits(l1: L1, gpus: int, milli: int) -> bool:
    """Could a host in this level-1 bucket hold one host-part of ``gpus`` x ``milli``?"""
    if gpus == 0:
        return True
    if gpus == 1 and milli < FULL:
        return l1[0] >= 1 or l1[1] >= milli
    return l1[0] >= gpus


class CapacityIndex:
    """Up hosts by GPU type, level-1 bucket and signature (see module docstring)."""

    def __init__(self) -> None:
        self.types: dict[str, dict[L1, dict[Sig, SortedList]]] = {}
        self.where: dict[str, tuple[str, L1, Sig]] = {}
        self.free_milli: dict[str, int] = {}  # per type, over up hosts
        self.version = 0  # bumped by every change (memos of what the index rules out compare it)
        self.by_full: dict[str, list[int]] = {}  # per type: up hosts by their number of whole free GPUs
        # Live signatures by birth number, the order they came into being (a signature whose last host left
        # and that comes back is born again, with a new number): placement's per-shape rankings catch up on
        # the signatures born since their last query and still alive (``born_since``) instead of rescanning
        # the index or walking every birth since (most are dead again by then).
        # birth number -> (type, level-1 bucket, signature), of every live signature and per number of whole
        # free GPUs (a shape of g whole GPUs reads only the buckets of g and more)
        self.born: SortedDict = SortedDict()
        self.born_full: list[SortedDict] = []
        self.birth_of: dict[tuple[str, Sig], int] = {}
        self.births = 0  # birth numbers given so far
        self.n_sigs = 0  # live signatures
        # The live signatures as rows of arrays too, for placement's compiled scoring: a slot per live
        # signature (reused once it dies), its row ``cpu free, memory free, free milli per GPU (sorted, padded
        # with 0)``, its GPU type (index into ``type_list``) and level-1 bucket; ``at`` maps a slot back.
        # The arrays are written when read (``arrays``).
        self.slot_of: dict[tuple[str, Sig], int] = {}
        self.at: list[tuple[str, L1, Sig] | None] = []
        self.birth_at: list[int] = []  # slot -> birth number of the signature in it (stale once it died)
        self.spare: list[int] = []  # dead slots, reused highest first
        self.type_ids: dict[str, int] = {}
        self.type_list: list[str] = []
        self.rows = np.zeros((0, 2 + 8), dtype=np.int64)
        self.row_type = np.zeros(0, dtype=np.intp)
        self.row_full = np.zeros(0, dtype=np.int64)
        self.row_part = np.zeros(0, dtype=np.int64)
        self.row_birth = np.zeros(0, dtype=np.int64)  # birth number (``birth_at``, for catch-ups that scan)
        self.alive = np.zeros(0, dtype=bool)
        self.pending: dict[int, bool] = {}  # slots born (True) or dead (False) since the arrays were written

    def add(self, n: NodeView) -> None:
        if n.state != "up":
            return
        self.version += 1
        l1, sig = signature(n)
        sigs = self.types.setdefault(n.gpu_type, {}).setdefault(l1, {})
        ids = sigs.get(sig)
        if ids is None:
            ids = sigs[sig] = SortedList()
            self.n_sigs += 1
            born = self.born_full
            while len(born) <= l1[0]:
                born.append(SortedDict())
            born[l1[0]][self.births] = self.born[self.births] = (n.gpu_type, l1, sig)
            self.birth_of[(n.gpu_type, sig)] = self.births
            self._slot_in(n.gpu_type, l1, sig, self.births)
            self.births += 1
        ids.add(n.id)
        self.where[n.id] = (n.gpu_type, l1, sig)
        self.free_milli[n.gpu_type] = self.free_milli.get(n.gpu_type, 0) + n.free_milli()
        counts = self.by_full.setdefault(n.gpu_type, [])
        while len(counts) <= l1[0]:
            counts.append(0)
        counts[l1[0]] += 1

    def remove(self, n: NodeView) -> None:
        loc = self.where.pop(n.id, None)
        if loc is None:
            return
        self.version += 1
        t, l1, sig = loc
        by_l1 = self.types[t]
        sigs = by_l1[l1]
        lst = sigs[sig]
        lst.remove(n.id)
        if not lst:
            del sigs[sig]
            self.n_sigs -= 1
            b = self.birth_of.pop((t, sig))
            del self.born[b]
            del self.born_full[l1[0]][b]
            slot = self.slot_of.pop((t, sig))
            self.at[slot] = None
            self.spare.append(slot)
            self.pending[slot] = False
            if not sigs:
                del by_l1[l1]
        self.free_milli[t] -= sum(sig[2])
        self.by_full[t][l1[0]] -= 1

    def _slot_in(self, t: str, l1: L1, sig: Sig, birth: int) -> None:
        slot = self.spare.pop() if self.spare else len(self.at)
        if slot == len(self.at):
            self.at.append(None)
            self.birth_at.append(-1)
        self.at[slot] = (t, l1, sig)
        self.birth_at[slot] = birth
        self.slot_of[(t, sig)] = slot
        self.pending[slot] = True
        if t not in self.type_ids:
            self.type_ids[t] = len(self.type_list)
            self.type_list.append(t)

    def arrays(self) -> None:
        """Write the slots born or dead since the last call into the arrays (once per compiled scoring,
        not per change: a numpy write per field per signature would cost more than the change itself)."""
        if not self.pending:
            return
        n = len(self.at)
        if n > len(self.alive):  # grow (doubling: amortised O(1) per signature)
            size = max(64, 2 * len(self.alive), n)
            grow = size - len(self.alive)
            self.rows = np.concatenate([self.rows, np.zeros((grow, self.rows.shape[1]), dtype=np.int64)])
            self.row_type = np.concatenate([self.row_type, np.zeros(grow, dtype=np.intp)])
            self.row_full = np.concatenate([self.row_full, np.zeros(grow, dtype=np.int64)])
            self.row_part = np.concatenate([self.row_part, np.zeros(grow, dtype=np.int64)])
            self.row_birth = np.concatenate([self.row_birth, np.zeros(grow, dtype=np.int64)])
            self.alive = np.concatenate([self.alive, np.zeros(grow, dtype=bool)])
        pending = self.pending
        width = self.rows.shape[1] - 2
        if len(pending) <= 16 and all(not up or len(self.at[i][2][2]) <= width  # type: ignore[index]
                                      for i, up in pending.items()):
            # the usual case (a decision changed a host or two): one numpy write per field and slot costs
            # ~0.1-1 us, a fancy-indexed write of a list ~5 us whatever its length
            self.pending = {}
            for i, up in pending.items():
                if up:
                    t, l1, sig = self.at[i]  # type: ignore[misc]  # (born: live)
                    self.rows[i, :2] = sig[:2]
                    self.rows[i, 2:] = sig[2] + (0,) * (width - len(sig[2]))
                    self.row_type[i] = self.type_ids[t]
                    self.row_full[i] = l1[0]
                    self.row_part[i] = l1[1]
                    self.row_birth[i] = self.birth_at[i]
                self.alive[i] = up
            return
        born = [i for i, up in pending.items() if up]
        dead = [i for i, up in pending.items() if not up]
        self.pending = {}
        if dead:
            self.alive[dead] = False
        if born:
            sigs: list[tuple[str, L1, Sig]] = [self.at[i] for i in born]  # type: ignore[misc]  # (born: live)
            width = max(len(s[2][2]) for s in sigs)
            if 2 + width > self.rows.shape[1]:  # a host with more GPUs than any before: wider rows
                self.rows = np.concatenate([self.rows, np.zeros((len(self.rows), 2 + width - self.rows.shape[1]),
                                                                dtype=np.int64)],
                                           axis=1)
            width = self.rows.shape[1] - 2
            self.rows[born] = [s[2][:2] + s[2][2] + (0,) * (width - len(s[2][2])) for s in sigs]
            self.row_type[born] = [self.type_ids[s[0]] for s in sigs]
            self.row_full[born] = [s[1][0] for s in sigs]
            self.row_part[born] = [s[1][1] for s in sigs]
            self.row_birth[born] = [self.birth_at[i] for i in born]
            self.alive[born] = True

    def candidate_slots(self, allowed: tuple[str, ...], gpus: int, milli: int, cpu: int, mem: int,
                        born_from: int = 0) -> np.ndarray:
        """Slots of every live signature that can hold one host-part (``candidate_sigs``, vectorised: a scan
        of the live signatures, for a shape's first ranking, or born at or after ``born_from``, for a
        ranking's catch-up on many births)."""
        self.arrays()
        n = len(self.at)
        rows = self.rows[:n]
        ok = self.alive[:n] & (rows[:, 0] >= cpu) & (rows[:, 1] >= mem)
        if born_from:
            ok &= self.row_birth[:n] >= born_from
        if gpus == 1 and milli < FULL:
            ok &= (self.row_full[:n] >= 1) | (self.row_part[:n] >= milli)
        elif gpus:
            ok &= self.row_full[:n] >= gpus
        if allowed:
            ids = [self.type_ids[t] for t in dict.fromkeys(allowed) if t in self.type_ids]
            ok &= np.isin(self.row_type[:n], ids)
        return np.flatnonzero(ok)

    def update(self, n: NodeView) -> None:
        self.remove(n)
        self.add(n)

    def type_names(self, allowed: tuple[str, ...]) -> list[str]:
        if not allowed:
            return sorted(self.types)
        return [t for t in dict.fromkeys(allowed) if t in self.types]  # once each, even if listed twice

    def candidates(self, allowed: tuple[str, ...], gpus: int, milli: int, cpu: int,
                   mem: int) -> Iterator[tuple[str, Sig, SortedList]]:
        """(type, signature, host IDs) of every signature that can hold one host-part."""
        for t in self.type_names(allowed):
            for l1, sigs in self.types[t].items():
                if not l1_fits(l1, gpus, milli):
                    continue
                for sig, ids in sigs.items():
                    if sig[0] >= cpu and sig[1] >= mem:
                        yield t, sig, ids

    def born_since(self, birth: int, gpus: int, milli: int) -> list[tuple[int, tuple[str, L1, Sig]]]:
        """(birth number, (type, level-1 bucket, signature)) of the live signatures born at or after birth
        number ``birth``, of every GPU type; for whole GPUs, only those with at least ``gpus`` whole free
        GPUs (O(log n + answer); the rest of the fit test is the caller's)."""
        if not gpus or (gpus == 1 and milli < FULL):
            return self.born.items()[self.born.bisect_left(birth):]  # type: ignore[no-any-return]
        out: list[tuple[int, tuple[str, L1, Sig]]] = []
        for b in self.born_full[gpus:]:
            if b and b.keys()[-1] >= birth:
                out += b.items()[b.bisect_left(birth):]
        return out

    def hosts_of(self, t: str, l1: L1, sig: Sig) -> SortedList | None:
        """The up hosts whose free capacity is ``sig`` (None: no host has it now)."""
        by_l1 = self.types.get(t)
        if by_l1 is None:
            return None
        sigs = by_l1.get(l1)
        return None if sigs is None else sigs.get(sig)

    def candidate_sigs(self, allowed: tuple[str, ...], gpus: int, milli: int, cpu: int,
                       mem: int) -> Iterator[tuple[str, L1, Sig]]:
        """(type, level-1 bucket, signature) of every live signature that can hold one host-part."""
        for t in self.type_names(allowed):
            for l1, sigs in self.types[t].items():
                if l1_fits(l1, gpus, milli):
                    for sig in sigs:
                        if sig[0] >= cpu and sig[1] >= mem:
                            yield t, l1, sig

    def max_full(self, allowed: tuple[str, ...]) -> int:
        best = 0
        for t in self.type_names(allowed):
            for l1 in self.types[t]:
                if l1[0] > best:
                    best = l1[0]
        return best

    def hosts_with(self, allowed: tuple[str, ...], gpus: int, milli: int, need: int) -> bool:
        """Are there at least ``need`` up hosts that could hold one part (GPUs only; a necessary condition)?"""
        n = 0
        if not (gpus == 1 and milli < FULL):  # whole GPUs (or none): counted by whole free GPUs
            for t in self.type_names(allowed):
                counts = self.by_full.get(t)
                if counts and len(counts) > gpus:
                    n += sum(counts[gpus:])
                    if n >= need:
                        return True
            return False
        for t in self.type_names(allowed):
            for l1, sigs in self.types[t].items():
                if l1_fits(l1, gpus, milli):
                    for ids in sigs.values():
                        n += len(ids)
                        if n >= need:
                            return True
        return False

    def any_free(self) -> bool:
        return any(v > 0 for v in self.free_milli.values())
