"""Dashboard views of issue 17 in headless Chromium, over a stack in this process (scheduler, projector, API,
two workers with noop/sleep/shell on the embedded log): a rejected job drawn from its spec with the cycle in
red, task groups collapsed and expanded on the 1,738-task Montage, the Gantt's rows grouped by worker and by
task type, and the dead-letter page showing hostile records as text.

Records an upstream producer writes (a SubmitJob the API would refuse, undecodable bytes) go straight to the
commands topic, as they do in production. Browser and page fixtures are test_dashboard_browser's (Debian's
Chromium, `make browser`; Playwright only drives it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import tests.test_dashboard_browser as base
from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import COMMANDS, Config
from dagfold.jobspec import load_spec_text, parse_spec, to_job_spec
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.worker.capabilities import parse_handler_list
from dagfold.services.worker.handlers import default_registry
from tests.api_support import wait_js
from tests.cli_support import free_port
from tests.test_dashboard_browser import ROOT, shot

browser = base.browser
page = base.page

MONTAGE_05D = ROOT.parent / "shared" / "data" / "wfcommons" / "montage-chameleon-2mass-05d-001.json.gz"
# counts red-ish pixels of a canvas: the marked edges' colour (#dc2626) and its anti-aliased edges
RED_PIXELS = """(sel) => {
  const c = document.querySelector(sel), d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] > 180 && d[i + 1] < 70 && d[i + 2] < 70 && d[i + 3] > 200) n++;
  return n;
}"""


class Local:
    def __init__(self, st: Stack, url: str) -> None:
        self.st, self.url = st, url

    def produce(self, key: bytes, value: bytes) -> None:
        """As an upstream producer: straight to the commands topic, past the API's own checks."""
        assert self.st.log is not None
        prod = self.st.log.producer("upstream")
        prod.send(COMMANDS, key, value)
        prod.flush()
        prod.close()

    def wait_job(self, job_id: str, states: set[str], timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/v1/jobs/{job_id}", timeout=10)
            job = r.json() if r.status_code == 200 else None
            if job and job["state"] in states:
                return job
            time.sleep(0.1)
        raise AssertionError(f"{job_id} not in {states}: {job}")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Local]:
    port = free_port()
    cfg = Config.from_env(log_url="embedded", data_dir=tmp_path_factory.mktemp("views") / "data", api_port=port)
    registry = default_registry().select(parse_handler_list("noop,sleep,shell"))
    with Stack(cfg, StackOptions(workers=2, callbacks=False, registry=registry)) as st:
        yield Local(st, f"http://127.0.0.1:{port}")


def test_the_cycle_example_shows_its_graph_with_the_cycle_in_red(local: Local, page: Any) -> None:
    spec = to_job_spec(load_spec_text((ROOT / "examples" / "cycle.yaml").read_text()))
    job_id = spec["job_id"]
    local.produce(job_id.encode(), default_codec().encode(submit_job(spec, source="upstream")))
    job = local.wait_job(job_id, {"rejected"})
    assert job["code"] == "cycle"
    page.goto(f"{local.url}/ui/#/jobs/{job_id}")
    wait_js(page, "window.__dagfold.graph && window.__dagfold.graph.data.ids.length === 4")
    g = page.evaluate("(() => { const g = window.__dagfold.graph; g.fit(); g.draw();"
                      " return {ids: g.data.ids, marked: g.rejected.marked_edges, drawn: g.drawnMarked}; })()")
    ids, m = g["ids"], g["marked"]
    assert sorted(ids) == ["a", "b", "c", "d"]
    assert {(ids[m[k]], ids[m[k + 1]]) for k in range(0, len(m), 2)} == {("a", "b"), ("b", "c"), ("c", "a")}
    assert g["drawn"] == 3
    assert page.evaluate(RED_PIXELS, "#dag") > 200  # the three edges are on the canvas, in red
    assert "red edges" in page.inner_text("#rejected-note")
    assert "dependency cycle" in page.inner_text("#job-reason")
    shot(page, "dashboard-rejected.png")


def test_task_groups_collapse_and_expand_on_the_large_montage(local: Local, page: Any) -> None:
    from dagfold.wfcommons import workflow_spec

    assert MONTAGE_05D.exists(), MONTAGE_05D
    spec = workflow_spec(MONTAGE_05D, 0.0)
    assert len(spec["tasks"]) == 1738
    for t in spec["tasks"]:
        t["queue"] = "parked"  # no worker takes them: this test needs the graph, not the run
    r = httpx.post(f"{local.url}/v1/jobs", json=spec, timeout=60)
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    local.wait_job(job_id, {"running"})
    page.goto(f"{local.url}/ui/#/jobs/{job_id}")
    wait_js(page, "window.__dagfold.graph && window.__dagfold.graph.data.ids.length === 1738")
    drawn = "(() => { const g = window.__dagfold.graph; g.draw(); return [g.drawnNodes, g.nodeCount]; })()"
    page.evaluate("window.__dagfold.graph.fit()")
    assert page.evaluate(drawn) == [1738, 1738]  # every task a node, all on screen at fit zoom
    bar = page.inner_text("#dag-groups")
    assert "mProject" in bar and "mDiffFit" in bar

    page.click("#dag-collapse")  # every group one node a layer
    nodes, count = page.evaluate(drawn)
    assert nodes == count and nodes < 40, nodes
    assert page.evaluate("window.__dagfold.stateOf('mViewer_ID0000001') || window.__dagfold.graph.states[0]")
    diff_fit = page.evaluate("window.__dagfold.graph.data.ids.filter((id) => id.startsWith('mDiffFit'))")
    shot(page, "dashboard-groups.png")

    pos = page.evaluate("(id) => window.__dagfold.nodeScreenPos(id)", diff_fit[0])  # the group's node
    page.mouse.click(pos["x"], pos["y"])  # a click on a group expands it
    assert page.evaluate(drawn) == [nodes - 1 + len(diff_fit)] * 2
    assert page.locator('#dag-groups button[data-group="mDiffFit"][aria-pressed="false"]').count() == 1
    page.click('#dag-groups button[data-group="mDiffFit"]')  # and its toggle collapses it again
    assert page.evaluate(drawn) == [nodes, nodes]

    assert "groups=" in page.evaluate("location.hash")  # the collapsed groups are in the address: a reload keeps them
    page.reload()
    wait_js(page, "window.__dagfold.graph && window.__dagfold.graph.data.ids.length === 1738")
    assert page.evaluate(drawn) == [nodes, nodes]

    page.click("#dag-expand")
    assert page.evaluate(drawn) == [1738, 1738]  # every task back
    assert "groups=" not in page.evaluate("location.hash")
    assert page.evaluate("window.__dagfold.graph.groupLabels") >= 3  # the layer headers of the fit zoom


def _held_until(release: Path) -> dict[str, Any]:
    """Shell args of a task that runs until the test creates ``release`` (at most 60 s, then it fails)."""
    return {"cmd": f"i=0; while [ ! -e '{release}' ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 1; sleep 0.05; done"}


def test_gantt_rows_grouped_by_worker_and_by_task_type(local: Local, page: Any, tmp_path: Path) -> None:
    release = tmp_path / "release"
    # two held tasks: a worker runs one slow task at a time, so they run on the two workers at once
    r = httpx.post(f"{local.url}/v1/jobs", json={"name": "gantt-groups", "tasks": [
        *[{"id": f"extract-{i}", "handler": "shell", "args": _held_until(release)} for i in range(2)],
        *[{"id": f"load-{i}", "handler": "noop", "depends_on": ["extract-0", "extract-1"]} for i in range(3)]]},
        timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    attempts_url = f"{local.url}/v1/jobs/{job_id}/attempts?limit=1000"
    try:
        deadline = time.monotonic() + 60
        # accepted is not yet projected: until the read model has the job, its attempts answer 404
        while sum(a["started_ms"] is not None
                  for a in httpx.get(attempts_url, timeout=10).json().get("attempts", [])) < 2:
            assert time.monotonic() < deadline, "the two held tasks did not both start"
            time.sleep(0.1)
    finally:
        release.touch()
    local.wait_job(job_id, {"succeeded"})
    attempts = httpx.get(attempts_url, timeout=10).json()["attempts"]
    pairs = {(a["worker_id"], a["task_id"]) for a in attempts}
    workers = {w for w, _ in pairs}
    assert len(workers) == 2, pairs  # the held tasks ran side by side

    page.goto(f"{local.url}/ui/#/jobs/{job_id}")
    wait_js(page, "window.__dagfold.timeline && window.__dagfold.timeline.rows.length === 5")
    page.select_option("#gantt-group", "worker")
    lines = page.evaluate("window.__dagfold.timeline.lines")
    headers = [ln["header"] for ln in lines if "header" in ln]
    assert sorted(headers) == sorted(workers)  # one header per worker
    assert "header" in lines[0]
    under, seen = None, set()
    for ln in lines:
        if "header" in ln:
            under = ln["header"]
            assert ln["count"] == sum(w == under for w, _ in pairs)
        else:  # a task row sits under the header of the worker that ran it
            assert (under, ln["task"]) in pairs, (under, ln)
            seen.add((under, ln["task"]))
    assert seen == pairs and len(lines) == len(pairs) + len(workers)
    page.evaluate("window.__dagfold.timeline.draw()")
    assert page.evaluate("[window.__dagfold.timeline.headerLabels, window.__dagfold.timeline.rowLabels]") == [
        len(workers), len(pairs)]  # every header and row named on the canvas
    page.locator("#gantt").scroll_into_view_if_needed()
    shot(page, "dashboard-gantt-workers.png")

    assert "rows=worker" in page.evaluate("location.hash")  # the choice is in the address: a reload keeps it
    page.reload()
    wait_js(page, "window.__dagfold.timeline && window.__dagfold.timeline.rows.length === 5")
    assert page.input_value("#gantt-group") == "worker"
    assert len(page.evaluate("window.__dagfold.timeline.lines")) == len(pairs) + len(workers)

    page.select_option("#gantt-group", "type")  # the graph's groups: task-name prefixes
    lines = page.evaluate("window.__dagfold.timeline.lines")
    assert [ln["header"] for ln in lines if "header" in ln] == ["extract", "load"]
    assert [ln["task"] for ln in lines if "header" not in ln][:2] in (["extract-0", "extract-1"],
                                                                      ["extract-1", "extract-0"])
    page.select_option("#gantt-group", "")
    assert all("header" not in ln for ln in page.evaluate("window.__dagfold.timeline.lines"))
    assert "rows=" not in page.evaluate("location.hash")


def test_dead_letters_show_hostile_records_as_text(local: Local, page: Any) -> None:
    hostile_key = b'<img src=x onerror="window.__pwned=1">'
    spec = to_job_spec(parse_spec({"id": "dl-1", "tasks": [{"id": "a", "handler": "noop"}]}))
    spec["job_id"] = "dl-<b id=pwn>x</b>"  # an upstream producer writes what it likes; the spec model would refuse it
    # a SubmitJob keyed by something else than its job ID, and bytes that are not Avro at all
    local.produce(hostile_key, default_codec().encode(submit_job(spec, source="upstream")))
    local.produce(b"raw", b"<script>window.__pwned=2</script>" + b"\x00" * 300)
    page.goto(f"{local.url}/ui/#/deadletters")
    wait_js(page, "document.querySelectorAll('#deadletters tbody tr').length >= 2")
    table = page.locator("#deadletters")
    text = table.inner_text()
    assert "<img src=x onerror=" in text  # the key, in the reason, as text
    assert "dl-<b id=pwn>x</b>" in text  # the job ID as text
    assert table.locator("img, script, b#pwn").count() == 0
    page.locator("#deadletters summary").first.click()
    assert page.evaluate("window.__pwned") is None
    shot(page, "dashboard-deadletters.png")
