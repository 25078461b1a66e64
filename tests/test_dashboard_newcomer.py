"""The dashboard for mid-size DAGs in headless Chromium (issue 17): a 1,738-task Montage readable at fit zoom
(layer headers name the task groups where node boxes are too small for their IDs), a Gantt with task names
on its row axis, job names, and the job page at 900 px without a horizontal scroll bar.

Uses the stack, browser and page fixtures of test_dashboard_browser (Debian's Chromium, `make browser`).
"""

from __future__ import annotations

import time
from typing import Any

import tests.test_dashboard_browser as base
from tests.api_support import wait_js
from tests.cli_support import UpProcess
from tests.test_dashboard_browser import ROOT, shot

MONTAGE_05D = ROOT.parent / "shared" / "data" / "wfcommons" / "montage-chameleon-2mass-05d-001.json.gz"


# The browser and page fixtures are test_dashboard_browser's own (one Chromium launch, one JS-error check);
# the stack is the session's `dagfold up` (tests/conftest.py), which these tests only submit to and read.
browser = base.browser
page = base.page
stack = base.stack


def test_large_montage_is_readable_at_fit_zoom(stack: UpProcess, page: Any) -> None:
    from dagfold.wfcommons import workflow_spec

    assert MONTAGE_05D.exists(), MONTAGE_05D
    spec = workflow_spec(MONTAGE_05D, 0.0)
    assert len(spec["tasks"]) == 1738
    job_id = stack.submit(spec)
    stack.wait(job_id, timeout=120)
    page.goto(f"{stack.url}/ui/#/jobs/{job_id}")
    wait_js(page, "window.__dagfold.graph && window.__dagfold.graph.data.ids.length === 1738")
    page.evaluate("window.__dagfold.graph.fit(); window.__dagfold.graph.draw()")
    # node boxes are a few pixels tall at fit zoom: each layer's header names its groups instead
    assert page.evaluate("window.__dagfold.graph.groupLabels") >= 3  # the wide layers; narrow ones on hover
    groups = page.evaluate("window.__dagfold.graph.layerGroups().map((m) => [...m.keys()])")
    assert ["mProject"] in groups and ["mDiffFit"] in groups, groups
    t0 = time.perf_counter()
    page.evaluate("for (let i = 0; i < 20; i++) window.__dagfold.graph.draw()")
    per_draw_ms = (time.perf_counter() - t0) / 20 * 1000
    assert per_draw_ms < 200, per_draw_ms  # a redraw stays interactive (a bound, not a timing goal)
    shot(page, "dashboard-montage-05d.png")


def test_gantt_has_task_names_and_the_job_page_fits_900px(stack: UpProcess, page: Any) -> None:
    job_id = stack.submit({"name": "gantt-demo", "tasks": [
        {"id": "extract", "handler": "sleep", "args": {"seconds": 0.2}},
        {"id": "transform", "handler": "sleep", "args": {"seconds": 0.4}, "depends_on": ["extract"]},
        {"id": "side", "handler": "noop", "depends_on": ["extract"]},
        {"id": "load", "handler": "noop", "depends_on": ["transform", "side"]}]})
    stack.wait(job_id)
    page.set_viewport_size({"width": 900, "height": 900})
    page.goto(f"{stack.url}/ui/#/jobs/{job_id}")
    wait_js(page, "window.__dagfold.timeline && window.__dagfold.timeline.rows.length === 4")
    page.evaluate("window.__dagfold.timeline.fit(); window.__dagfold.timeline.draw()")
    assert page.evaluate("window.__dagfold.timeline.rowLabels") == 4
    rows = page.evaluate("window.__dagfold.timeline.rows")
    assert rows[0] == "extract" and rows[-1] == "load" and set(rows) == {"extract", "transform", "side", "load"}
    assert "gantt-demo" in page.inner_text("#job-head")
    wait_js(page, "window.__dagfold.graph && window.__dagfold.graph.criticalIds")
    # the longest chain by attempt times: through the 0.4 s transform, not the noop side branch
    assert page.evaluate("window.__dagfold.graph.criticalIds") == ["extract", "transform", "load"]
    page.click("#grid-toggle")  # the grid: one row per task, a cell per attempt
    wait_js(page, "window.__dagfold.gridRows === 4")
    assert page.locator("#grid tr[data-task] i.cell").count() == 4
    assert page.evaluate("document.documentElement.scrollWidth") <= 900  # no horizontal scroll at 900 px
    shot(page, "dashboard-900px.png", full=True)
    page.goto(f"{stack.url}/ui/#/jobs")
    page.wait_for_selector(f"tr[data-job='{job_id}']")
    assert "gantt-demo" in page.inner_text(f"tr[data-job='{job_id}']")


def test_api_docs_are_served_without_a_cdn(stack: UpProcess, page: Any) -> None:
    import httpx

    for path in ("/docs", "/redoc"):
        html = httpx.get(stack.url + path, timeout=10).text
        assert "cdn.jsdelivr.net" not in html and "fonts.googleapis" not in html, html[:400]
    outside: list[str] = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(stack.url) else None)
    page.goto(stack.url + "/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)  # rendered from local files
    assert "/v1/jobs" in page.inner_text(".swagger-ui")
    assert outside == [], outside
