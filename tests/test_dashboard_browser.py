"""The web dashboard end to end: `dagfold up`, headless Chromium driven by Playwright.

Loads the job list, follows a running job whose graph recolours live (server-sent events, no reload),
opens a failed task's reason, and visits the operations and cluster pages; then renders the cluster page
over events of the GPU allocator's own fold (virtual time). Saves screenshots of each page to a temporary
folder, so that a test run leaves the tree as it was; ``DAGFOLD_SCREENSHOT_DIR=docs/img`` refreshes the
ones docs/operations.md shows.

Chromium is Debian's (``make browser`` installs it); Playwright only drives it (no ``playwright install``).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import playwright.sync_api as playwright_api  # the test extra: a missing install fails, never skips
import pytest

from tests.cli_support import UpProcess

ROOT = Path(__file__).resolve().parents[1]
IMG = Path(os.environ.get("DAGFOLD_SCREENSHOT_DIR", str(Path(tempfile.gettempdir()) / "dagfold-screenshots")))
CHROMIUM = os.environ.get("DAGFOLD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MONTAGE = ROOT.parent / "shared" / "data" / "wfcommons" / "montage-chameleon-2mass-01d-001.json.gz"


def chromium() -> str:
    """The Chromium to launch: a test that needs it fails (never skips) where `make browser` has not run."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (or set DAGFOLD_CHROMIUM)", pytrace=False)
    return CHROMIUM


@pytest.fixture
def stack(up_stack: UpProcess) -> UpProcess:
    """The session's `dagfold up` (tests/conftest.py; the examples it submits use shell): these tests submit
    their own jobs and only read."""
    return up_stack


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert errors == [], errors  # no JavaScript error on any page


def shot(page: Any, name: str, full: bool = False) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / name), full_page=full)


def test_dashboard_end_to_end(stack: UpProcess, page: Any, tmp_path: Path) -> None:
    failing_doc = (ROOT / "examples" / "failing.yaml").read_text()
    import yaml

    failing = stack.submit({**yaml.safe_load(failing_doc), "labels": {"example": "failing"}})
    # extract runs until the test has seen it running in the page (a timed sleep may end before a loaded
    # machine shows the page); at most 60 s, then it fails
    release = tmp_path / "release-extract"
    hold = f"i=0; while [ ! -e '{release}' ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 1; sleep 0.05; done"
    running = stack.submit({"labels": {"example": "live"}, "tasks": [
        {"id": "extract", "handler": "shell", "args": {"cmd": hold}},
        *[{"id": f"transform-{i}", "handler": "sleep", "args": {"seconds": 0.6 + 0.2 * i},
           "depends_on": ["extract"]} for i in range(4)],
        {"id": "load", "handler": "sleep", "args": {"seconds": 0.8},
         "depends_on": [f"transform-{i}" for i in range(4)]}]})
    from dagfold.wfcommons import workflow_spec

    assert MONTAGE.exists(), f"{MONTAGE}: the shared workload data is missing"
    montage = stack.submit(workflow_spec(MONTAGE, time_scale=0.01))  # as `make run`

    # the job list
    page.goto(stack.url + "/")
    page.wait_for_function("window.__dagfold && window.__dagfold.ready")
    page.wait_for_selector(f'tr[data-job="{running}"]')
    assert page.locator("#jobs-table tbody tr").count() >= 2

    # a running job: its graph recolours as events arrive, without reloading the page
    try:
        page.goto(f"{stack.url}/ui/#/jobs/{running}")
        page.wait_for_function("window.__dagfold.graph !== null && window.__dagfold.stateOf('extract') !== null")
        page.wait_for_function("window.__dagfold.stateOf('extract') === 'running'", timeout=20_000)
        assert page.evaluate("window.__dagfold.stateOf('load')") == "pending"
    finally:
        release.touch()
    page.wait_for_function("['running', 'succeeded'].includes(window.__dagfold.stateOf('transform-0'))",
                           timeout=20_000)
    shot(page, "job-running.png")
    navigations = page.evaluate("performance.getEntriesByType('navigation').length")
    page.wait_for_function("window.__dagfold.stateOf('load') === 'succeeded'", timeout=30_000)
    page.wait_for_selector("#job-state .badge.succeeded", timeout=10_000)
    assert page.evaluate("performance.getEntriesByType('navigation').length") == navigations  # no reload
    assert page.locator('#counts [data-state="succeeded"] b').inner_text() == "6"
    assert page.locator("#history tbody tr").count() >= 19  # accepted, 6 x (dispatched, leased, succeeded)

    # a failed job: click the failed task, read its reason and stderr
    stack.wait(failing)
    page.goto(f"{stack.url}/ui/#/jobs/{failing}")
    page.wait_for_function("window.__dagfold.graph !== null && window.__dagfold.stateOf('bad') === 'failed'")
    assert page.evaluate("window.__dagfold.stateOf('after_bad')") == "skipped"
    pos = page.evaluate("window.__dagfold.nodeScreenPos('bad')")
    page.mouse.click(pos["x"], pos["y"])
    page.wait_for_selector("#task-reason")
    assert "exit code 3" in page.locator("#task-reason").inner_text()
    assert "about to fail" in page.locator("#task-panel pre.tail").first.inner_text()
    assert "bad: exit code 3" in page.locator("#job-reason").inner_text()
    shot(page, "failed-task.png")

    # the Montage workflow's graph, as `make run` shows it
    stack.wait(montage)
    page.goto(f"{stack.url}/ui/#/jobs/{montage}")
    page.wait_for_function("window.__dagfold.graph !== null")
    page.wait_for_function("window.__dagfold.stateOf('mViewer_ID0000103') === 'succeeded'")
    time.sleep(0.5)  # the timeline loads after the graph
    shot(page, "job-graph.png")

    page.goto(f"{stack.url}/ui/#/jobs")
    page.wait_for_function("window.__dagfold.ready")
    page.wait_for_selector(f'tr[data-job="{failing}"] .badge.failed')
    shot(page, "jobs.png")

    page.goto(f"{stack.url}/ui/#/ops")
    page.wait_for_function("window.__dagfold.ready")
    assert "exit code 3" in page.locator("#ops-reasons").inner_text()
    assert page.locator("#tenants").count() == 1
    shot(page, "operations.png")

    page.goto(f"{stack.url}/ui/#/cluster")
    page.wait_for_function("window.__dagfold.ready")
    assert page.locator("#cluster-empty").count() == 1  # no allocator events: an empty page, no made-up nodes
    shot(page, "cluster.png")


def test_cluster_page_with_allocator_events(page: Any, tmp_path: Path) -> None:
    """The cluster page over the allocator's real events (its virtual-time harness, not a live pool)."""
    from dagfold.projections import cluster as cluster_model
    from dagfold.services.allocator.harness import AllocatorHarness
    from tests.api_support import ApiHarness, LiveServer

    h = AllocatorHarness()
    for i in range(24):
        h.register(f"gpu-{i:02d}", gpu_type="H100" if i < 16 else "A100", gpus=8)
    tenants = ["studio", "research", "free-tier"]
    for j in range(30):
        h.request(f"job-{j}", tenant=tenants[j % 3], tier="free" if j % 3 == 2 else "enterprise",
                  gpus=[1, 2, 4, 8][j % 4], hosts=2 if j % 7 == 0 else 1)
    for _ in range(4):  # gpu-23 stops heartbeating and is lost; gpu-05 reports throttling and is drained
        for i in range(23):
            h.heartbeat(f"gpu-{i:02d}", health="throttled" if i == 5 else "ok")
        h.advance(10_000)
    assert h.of_type("AllocationGranted") and h.of_type("NodeDrained")
    api = ApiHarness(tmp_path)
    try:
        txn = api.projector.store.txn()
        for e in h.events:
            cluster_model.apply(txn, e)
        api.projector.store.commit(txn)
        with LiveServer(api.app) as srv:
            page.goto(f"{srv.url}/ui/#/cluster")
            page.wait_for_function("window.__dagfold.ready")
            page.wait_for_selector("#nodemap")
            totals = page.locator("#cl-totals").inner_text()
            tot = api.client.get("/v1/cluster").json()["totals"]
            assert f"{tot['allocated']} of {tot['healthy_gpus']} healthy GPUs allocated" in totals
            assert "studio" in page.locator("#cl-legend").inner_text()
            assert page.locator("#tenants th").filter(has_text="GPU share").count() == 1
            time.sleep(0.3)
            shot(page, "cluster-gpus.png")
    finally:
        api.close()
