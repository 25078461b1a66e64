"""A rejected job keeps a drawing of what was refused (issue 17): JobRejected carries the submitted graph,
bounded, with the offending edges and tasks marked; the read model keeps it and GET /graph lays it out.

Before this, a rejected job had an empty graph (JobRejected carried no spec).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import load_schema

from dagfold.codec import MAGIC, default_codec, make, schema_fingerprint
from dagfold.config import Limits
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.jobspec.validation import (
    REJECTED_GRAPH_BYTES,
    REJECTED_GRAPH_EDGES,
    REJECTED_GRAPH_TASKS,
    Rejection,
    rejected_graph,
)
from dagfold.services.api.graph import layout
from dagfold.services.scheduler.harness import FoldHarness
from tests.api_support import T0, ApiHarness, accepted

ROOT = Path(__file__).resolve().parents[1]


def rejection_of(text: str) -> dict[str, Any]:
    h = FoldHarness()
    h.submit(to_job_spec(load_spec_text(text)))
    [ev] = h.events
    assert ev["type"] == "dagfold.event.JobRejected"
    return ev


def edges(graph: dict[str, Any], key: str = "edges") -> set[tuple[str, str]]:
    ids, e = graph["task_ids"], graph[key]
    return {(ids[e[k]], ids[e[k + 1]]) for k in range(0, len(e), 2)}


def test_the_cycle_example_is_rejected_with_its_graph_and_the_cycle_marked() -> None:
    ev = rejection_of((ROOT / "examples" / "cycle.yaml").read_text())
    g = ev["graph"]
    assert ev["code"] == "cycle"
    assert sorted(g["task_ids"]) == ["a", "b", "c", "d"] and g["total_tasks"] == 4 and g["total_edges"] == 3
    assert edges(g) == {("c", "a"), ("a", "b"), ("b", "c")}
    assert edges(g, "marked_edges") == {("c", "a"), ("a", "b"), ("b", "c")}
    assert sorted(g["task_ids"][i] for i in g["marked_tasks"]) == ["a", "b", "c"] and g["missing_tasks"] == []
    codec = default_codec()
    assert codec.decode(codec.encode(ev, validate_record=True))["graph"] == g  # valid against the schema


def test_an_unknown_dependency_is_drawn_as_a_missing_task_with_its_edge_marked() -> None:
    g = rejection_of("tasks: [{id: a}, {id: b, depends_on: [a, nope]}, {id: c, depends_on: [b]}]")["graph"]
    ids = g["task_ids"]
    assert [ids[i] for i in g["missing_tasks"]] == ["nope"]
    assert edges(g, "marked_edges") == {("nope", "b")}
    assert edges(g) == {("nope", "b"), ("a", "b"), ("b", "c")}
    assert [ids[i] for i in g["marked_tasks"]] == ["b"]


def test_a_self_loop_and_a_duplicate_are_marked() -> None:
    g = rejection_of("tasks: [{id: a, depends_on: [a]}]")["graph"]
    assert edges(g, "marked_edges") == {("a", "a")}
    g = rejection_of("tasks: [{id: a}, {id: b, depends_on: [a]}, {id: b}]")["graph"]
    assert [g["task_ids"][i] for i in g["marked_tasks"]] == ["b"] and g["marked_edges"] == []


def test_refusals_about_an_existing_job_carry_no_graph() -> None:
    h = FoldHarness()
    spec = to_job_spec(load_spec_text("id: J\ntasks: [{id: a}]"))
    h.submit(spec)
    h.submit({**spec, "tasks": [{**spec["tasks"][0], "handler": "sleep"}]})
    assert h.events[-1]["code"] == "job_exists" and h.events[-1].get("graph") is None


def test_a_million_task_spec_makes_a_small_event_that_still_draws_its_cycle() -> None:
    """Hostile input: a 1M-task spec whose last three tasks form a cycle; the rejection stays small and the
    cycle (with its neighbours) is what it draws."""
    n = 1_000_000
    # the two fields of a TaskSpec the drawing reads (a full TaskSpec a task would be 1 GB of dicts here)
    tasks = [{"task_id": f"t{i:07d}", "depends_on": [f"t{i - 1:07d}"] if i else []} for i in range(n)]
    tasks[-3]["depends_on"] = [f"t{n - 4:07d}", f"t{n - 1:07d}"]  # t[n-3] -> t[n-2] -> t[n-1] -> t[n-3]
    spec = {"job_id": "huge", "tasks": tasks}
    cycle = [f"t{i:07d}" for i in (n - 3, n - 2, n - 1)]
    rej = Rejection("cycle", "dependency cycle", tuple(cycle), ((cycle[0], cycle[1]), (cycle[1], cycle[2]),
                                                                (cycle[2], cycle[0])))
    g = rejected_graph(spec, rej, Limits())
    assert len(g["task_ids"]) == REJECTED_GRAPH_TASKS and g["total_tasks"] == n and g["total_edges"] == n
    assert g["task_ids"][:3] == cycle and f"t{n - 4:07d}" in g["task_ids"]  # the cycle and its neighbours
    assert len(edges(g, "marked_edges")) == 3 and len(g["edges"]) // 2 <= REJECTED_GRAPH_EDGES
    ev = make("dagfold.event.JobRejected", job_id="huge", ts_ms=T0, code="cycle", reason="x", graph=g)
    assert len(default_codec().encode(ev)) < 64 * 1024


def test_long_task_ids_are_cut_and_bounded_in_bytes() -> None:
    limits = Limits(max_task_id_len=256)
    tasks = [make("dagfold.common.TaskSpec", task_id=f"{i:05d}" + "x" * 5000, handler="noop") for i in range(3000)]
    spec = make("dagfold.common.JobSpec", job_id="long", tasks=tasks)
    g = rejected_graph(spec, Rejection("invalid_field", "task id too long", (tasks[7]["task_id"],)), limits)
    assert all(len(t) <= 256 for t in g["task_ids"])
    assert sum(len(t) for t in g["task_ids"]) <= REJECTED_GRAPH_BYTES
    assert g["task_ids"][0].startswith("00007") and g["marked_tasks"] == [0]


def test_a_rejection_written_before_the_graph_field_still_decodes_and_projects(tmp_path: Path) -> None:
    old = load_schema(str(ROOT / "schemas/history/v1-rejected-no-graph/dagfold.event.JobRejected.avsc"))
    buf = io.BytesIO()
    buf.write(MAGIC + schema_fingerprint(old))
    fastavro.schemaless_writer(buf, old, {"job_id": "old", "ts_ms": T0, "cause_offset": 1, "tenant": "acme",
                                          "code": "cycle", "reason": "dependency cycle: a -> b -> a"})
    rec = default_codec().decode(buf.getvalue())
    assert rec["graph"] is None and rec["code"] == "cycle"
    api = ApiHarness(tmp_path)
    try:
        api.project(rec)
        g = api.client.get("/v1/jobs/old/graph").json()
        assert g["state"] == "rejected" and g["ids"] == [] and g["rejected"] is None
    finally:
        api.close()


def test_the_read_model_keeps_the_refused_graph_and_the_api_lays_it_out(tmp_path: Path) -> None:
    ev = rejection_of("id: cyc\ntenant: acme\ntasks: [{id: a, depends_on: [c]}, {id: b, depends_on: [a]}, "
                      "{id: c, depends_on: [b]}, {id: d, depends_on: [c]}]")
    api = ApiHarness(tmp_path)
    try:
        api.project(ev)
        g = api.client.get("/v1/jobs/cyc/graph").json()
        assert g["state"] == "rejected" and sorted(g["ids"]) == ["a", "b", "c", "d"]
        ids = g["ids"]
        got = {(ids[g["edges"][k]], ids[g["edges"][k + 1]]) for k in range(0, len(g["edges"]), 2)}
        assert got == {("c", "a"), ("a", "b"), ("b", "c"), ("c", "d")}
        m = g["rejected"]["marked_edges"]
        assert {(ids[m[k]], ids[m[k + 1]]) for k in range(0, len(m), 2)} == {("c", "a"), ("a", "b"), ("b", "c")}
        assert len(set(g["layer"][ids.index(t)] for t in "abc")) == 3  # the cycle reads left to right
        assert g["rejected"]["total_tasks"] == 4
        # the same job ID accepted later: its own graph, the refused one gone
        api.project(accepted("cyc", ["x", "y"], ts=T0 + 5, deps={"y": ["x"]}))
        g = api.client.get("/v1/jobs/cyc/graph").json()
        assert g["ids"] == ["x", "y"] and "rejected" not in g
        assert api.rm.get_rejected_graph("cyc") is None
    finally:
        api.close()


@pytest.mark.parametrize(("deps", "cycles"), [
    ({"a": ["c"], "b": ["a"], "c": ["b"]}, 1),
    ({"a": ["b"], "b": ["a"], "c": ["a", "b"], "d": ["c", "d"]}, 2),
    ({"a": [], "b": ["a", "d"], "c": ["b"], "d": ["c"], "e": ["d"]}, 1),
])
def test_layout_breaks_cycles_and_places_every_task(deps: dict[str, list[str]], cycles: int) -> None:
    lay = layout(deps.items())
    assert sorted(lay.ids) == sorted(deps) and sum(lay.layers) == len(deps)
    for lvl, count in enumerate(lay.layers):  # positions in a layer are 0..count-1
        assert sorted(p for p, layer in zip(lay.pos, lay.layer, strict=True) if layer == lvl) == list(range(count))
    back = sum(lay.layer[lay.edges[k]] >= lay.layer[lay.edges[k + 1]] for k in range(0, len(lay.edges), 2))
    assert back == cycles  # one edge goes back per cycle (a self-loop counts as its own)
