"""Layered layout of a job's DAG for the dashboard, computed once per job on the server.

Why on the server: the graph of a job never changes after acceptance, a
layout of 100k tasks is O(V + E log E) here and cached, and the browser then
only draws (canvas) and recolours nodes as states change.

Layers are longest paths from the roots (Sugiyama's first step); within a
layer, nodes are ordered by the barycentre of their parents' positions (one
downward sweep), which keeps fan-in/fan-out workflows like Montage readable.
Tasks on a cycle (impossible for an accepted job) go to a last layer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    ids: list[str]
    layer: list[int]
    pos: list[int]
    layers: list[int]
    edges: list[int]  # flattened [parent, child, parent, child, ...] indexes into ids


def layout(tasks: Iterable[tuple[str, list[str]]]) -> Layout:
    """Layers and in-layer positions for ``(task_id, depends_on)`` pairs."""
    ids: list[str] = []
    deps: list[list[str]] = []
    for tid, d in tasks:
        ids.append(tid)
        deps.append(d)
    index = {t: i for i, t in enumerate(ids)}
    n = len(ids)
    parents: list[list[int]] = [[index[p] for p in d if p in index] for d in deps]
    children: list[list[int]] = [[] for _ in range(n)]
    indeg = [len(p) for p in parents]
    for c, ps in enumerate(parents):
        for p in ps:
            children[p].append(c)
    layer = [0] * n
    queue = deque(i for i in range(n) if indeg[i] == 0)
    order: list[int] = []
    while queue:
        i = queue.popleft()
        order.append(i)
        for c in children[i]:
            layer[c] = max(layer[c], layer[i] + 1)
            indeg[c] -= 1
            if indeg[c] == 0:
                queue.append(c)
    if len(order) < n:  # a cycle: park the rest after the deepest layer
        last = (max(layer) + 1) if n else 0
        placed = set(order)
        for i in range(n):
            if i not in placed:
                layer[i] = last
                order.append(i)
    depth = (max(layer) + 1) if n else 0
    members: list[list[int]] = [[] for _ in range(depth)]
    for i in range(n):
        members[layer[i]].append(i)
    pos = [0] * n
    for lvl, nodes in enumerate(members):
        if lvl == 0:
            nodes.sort(key=lambda i: ids[i])
        else:
            def bary(i: int) -> tuple[float, str]:
                ps = parents[i]
                # parents' positions relative to their layer's width: layers differ in size
                return (sum(pos[p] / len(members[layer[p]]) for p in ps) / len(ps) if ps else 0.0), ids[i]

            nodes.sort(key=bary)
        for k, i in enumerate(nodes):
            pos[i] = k
    edges: list[int] = []
    for c, ps in enumerate(parents):
        for p in ps:
            edges += (p, c)
    return Layout(ids, layer, pos, [len(m) for m in members], edges)


class LayoutCache:
    """The last ``size`` layouts by job ID (a job's graph is immutable once accepted)."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._items: OrderedDict[str, Layout] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, job_id: str) -> Layout | None:
        with self._lock:
            lay = self._items.get(job_id)
            if lay is not None:
                self._items.move_to_end(job_id)
            return lay

    def put(self, job_id: str, lay: Layout) -> None:
        with self._lock:
            self._items[job_id] = lay
            self._items.move_to_end(job_id)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


def graph_json(lay: Layout, states: dict[str, str]) -> dict[str, Any]:
    return {"ids": lay.ids, "layer": lay.layer, "pos": lay.pos, "layers": lay.layers, "edges": lay.edges,
            "states": [states.get(t, "pending") for t in lay.ids]}
