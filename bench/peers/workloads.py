"""The DAGs every system runs, as plain data (stdlib only: the peers' venv imports this too).

A workload is ``[(task_id, [parent ids]), ...]`` in a topological order. Tasks are
noops: the bench measures the scheduler, not the work.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WF = ROOT.parent / "shared" / "data" / "wfcommons"

Dag = list[tuple[str, list[str]]]


def wfcommons(name: str) -> Dag:
    with gzip.open(WF / f"{name}.json.gz", "rt") as fh:
        tasks = json.load(fh)["workflow"]["tasks"]
    parents = {t["name"]: list(dict.fromkeys(t.get("parents") or [])) for t in tasks}
    return topological(parents)


def topological(parents: dict[str, list[str]]) -> Dag:
    """Kahn's order, stable in the input order."""
    indeg = {t: len(ps) for t, ps in parents.items()}
    downs: dict[str, list[str]] = {t: [] for t in parents}
    for t, ps in parents.items():
        for p in ps:
            downs[p].append(t)
    ready = [t for t, n in indeg.items() if n == 0]
    out: Dag = []
    i = 0
    while i < len(ready):
        t = ready[i]
        i += 1
        out.append((t, parents[t]))
        for d in downs[t]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    if len(out) != len(parents):
        raise ValueError("workflow has a cycle")
    return out


def independent(n: int) -> Dag:
    return [(f"t{i}", []) for i in range(n)]


def chain(n: int) -> Dag:
    return [(f"c{i}", [f"c{i - 1}"] if i else []) for i in range(n)]


def layered(width: int, depth: int) -> Dag:
    """Every task of level l depends on every task of level l-1 (width^2 edges per level)."""
    out: Dag = []
    for lv in range(depth):
        prev = [f"l{lv - 1}-{j}" for j in range(width)] if lv else []
        out.extend((f"l{lv}-{i}", prev) for i in range(width))
    return out


def layered_sparse(width: int, depth: int, fan_in: int = 2) -> Dag:
    """Level l task i depends on tasks i..i+fan_in-1 (mod width) of level l-1: O(tasks) edges (scale runs)."""
    out: Dag = []
    for lv in range(depth):
        for i in range(width):
            ps = [f"l{lv - 1}-{(i + k) % width}" for k in range(min(fan_in, width))] if lv else []
            out.append((f"l{lv}-{i}", ps))
    return out


WORKLOADS: dict[str, Callable[[], Dag]] = {
    "montage": lambda: wfcommons("montage-chameleon-2mass-05d-001"),
    "epigenomics": lambda: wfcommons("epigenomics-chameleon-ilmn-6seq-50k-001"),
    "independent-10k": lambda: independent(10_000),
    "chain-1k": lambda: chain(1_000),
    "layered-100x100": lambda: layered(100, 100),
}

# small versions with the same shapes, for `--smoke` (building and debugging)
SMOKE: dict[str, Callable[[], Dag]] = {
    "montage": lambda: wfcommons("montage-chameleon-2mass-01d-001"),
    "epigenomics": lambda: wfcommons("epigenomics-chameleon-ilmn-6seq-50k-001")[:200],
    "independent-10k": lambda: independent(500),
    "chain-1k": lambda: chain(50),
    "layered-100x100": lambda: layered(10, 10),
}

WARMUP: Callable[[], Dag] = lambda: layered(4, 4)  # noqa: E731


def load(name: str, smoke: bool = False) -> Dag:
    table = SMOKE if smoke else WORKLOADS
    if name == "warmup":
        return WARMUP()
    return table[name]()


def levels(dag: Dag) -> list[list[str]]:
    """Tasks grouped by depth (longest path from a root): what a level-synchronous canvas runs."""
    depth: dict[str, int] = {}
    for t, ps in dag:
        depth[t] = 1 + max((depth[p] for p in ps), default=-1)
    out: list[list[str]] = [[] for _ in range(max(depth.values()) + 1)]
    for t, _ in dag:
        out[depth[t]].append(t)
    return out


def edges(dag: Dag) -> int:
    return sum(len(ps) for _, ps in dag)
