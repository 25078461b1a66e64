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

from sortedcontainers import SortedList

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
        # Signatures in the order they came into being (a signature whose last host left and that comes back
        # is born again): placement's per-shape rankings catch up on them instead of rescanning the index.
        # ``births[i]`` is birth number ``births_base + i``; the oldest half is dropped when the log is over
        # twice the live signatures (a ranking that fell behind the dropped part is rebuilt).
        self.births: list[tuple[str, L1, Sig]] = []
        self.births_base = 0
        self.n_sigs = 0  # live signatures

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
            births = self.births
            births.append((n.gpu_type, l1, sig))
            if len(births) > 2 * self.n_sigs + 1024:
                drop = len(births) // 2
                del births[:drop]
                self.births_base += drop
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
            if not sigs:
                del by_l1[l1]
        self.free_milli[t] -= sum(sig[2])
        self.by_full[t][l1[0]] -= 1

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
