"""Layered layout of a job's DAG for the dashboard, computed once per job on the server.

Why on the server: the graph of a job never changes after acceptance, a
layout of 100k tasks is O(V + E log E) here and cached, and the browser then
only draws (canvas) and recolours nodes as states change.

Layers are longest paths from the roots (Sugiyama's first step); within a
layer, nodes are ordered by the barycentre of their parents' positions (one
downward sweep), which keeps fan-in/fan-out workflows like Montage readable.
A cycle (only in a rejected job's graph) is broken where Kahn's algorithm gets stuck: the first task
left (in input order) is placed as if its unplaced upstreams were not there, so a cycle a -> b -> c -> a
reads left to right with one edge back (Eades' greedy cycle breaking, simplified).
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
    placed = [False] * n
    order: list[int] = []
    stuck = 0  # the next task to force when a cycle stops the walk: O(n) over all cycles together
    while len(order) < n:
        while queue:
            i = queue.popleft()
            placed[i] = True
            order.append(i)
            for c in children[i]:
                if placed[c]:
                    continue  # an edge back into a broken cycle
                layer[c] = max(layer[c], layer[i] + 1)
                indeg[c] -= 1
                if indeg[c] == 0:
                    queue.append(c)
        while stuck < n and (placed[stuck] or indeg[stuck] <= 0):
            stuck += 1
        if stuck < n:  # a cycle: place its first task as if its unplaced upstreams were not there
            indeg[stuck] = 0
            queue.append(stuck)
    depth = (max(layer) + 1) if n else 0
    members: list[list[int]] = [[] for _ in range(depth)]
    for i in range(n):
        members[layer[i]].append(i)
    pos = [0] * n
    widths = [len(m) for m in members]
    for lvl, nodes in enumerate(members):
        if lvl == 0:
            nodes.sort(key=lambda i: ids[i])
        else:
            def bary(i: int, lvl: int = lvl) -> tuple[float, str]:
                ps = [p for p in parents[i] if layer[p] < lvl]  # placed already (an edge back is not)
                # parents' positions relative to their layer's width: layers differ in size
                return (sum(pos[p] / widths[layer[p]] for p in ps) / len(ps) if ps else 0.0), ids[i]

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


def graph_json(lay: Layout, states: dict[str, str], marked: set[str] | None = None) -> dict[str, Any]:
    """The drawing of a job: the layout, each task's state, and ``marked``, the tasks recorded as succeeded by
    an operator without running (indexes into ``ids``)."""
    return {"ids": lay.ids, "layer": lay.layer, "pos": lay.pos, "layers": lay.layers, "edges": lay.edges,
            "states": [states.get(t, "pending") for t in lay.ids],
            "marked": [i for i, t in enumerate(lay.ids) if t in marked] if marked else []}


def rejected_graph_json(graph: dict[str, Any] | None) -> dict[str, Any]:
    """A rejected job's refused graph (``JobRejected.graph``, bounded by the scheduler) laid out like an
    accepted one, with ``rejected``: the offending edges and tasks (indexes into ``ids``), the tasks named
    but not defined, and the spec's own totals. Not cached: at most a few thousand tasks, and a later
    rejection under the same job ID replaces it. None (a record from before the field): an empty graph."""
    if graph is None:
        return {**graph_json(layout([]), {}), "rejected": None}
    ids: list[str] = graph["task_ids"]
    deps: list[list[str]] = [[] for _ in ids]
    e = graph["edges"]
    for k in range(0, len(e) - 1, 2):
        if 0 <= e[k] < len(ids) and 0 <= e[k + 1] < len(ids):
            deps[e[k + 1]].append(ids[e[k]])
    lay = layout(zip(ids, deps, strict=True))
    missing = set(graph["missing_tasks"])
    return {**graph_json(lay, {}), "states": ["missing" if i in missing else "pending" for i in range(len(ids))],
            "rejected": {k: graph[k] for k in ("marked_edges", "marked_tasks", "missing_tasks", "total_tasks",
                                               "total_edges")}}
