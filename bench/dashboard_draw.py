"""The dashboard's DAG view on Montage 05d (1,738 tasks) in headless Chromium: time per redraw at fit zoom,
every task drawn and every task group collapsed, and the time to collapse and expand (the view rebuilt).

``python -m bench.dashboard_draw [--runs 5] [--baseline REV]``: the job is projected from its JobAccepted
event (no workers; the graph is what is measured), the page is the real dashboard over the real API. With
``--baseline``, the same page with app.js of git revision REV (served in its place) is measured in the same
run, for comparison (default a0ffad6: before task groups). Each figure is the median of ``runs`` runs of 20
redraws (or 5 collapse+expand toggles); the load average is recorded beside them. Writes
bench/results/dashboard_draw.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MONTAGE_05D = ROOT.parent / "shared" / "data" / "wfcommons" / "montage-chameleon-2mass-05d-001.json.gz"
OUT = ROOT / "bench" / "results" / "dashboard_draw.json"

DRAWS = "(() => { const g = window.__dagfold.graph, t = performance.now();" \
        " for (let i = 0; i < 20; i++) g.draw(); return (performance.now() - t) / 20; })()"
TOGGLES = "(() => { const g = window.__dagfold.graph, t = performance.now();" \
          " for (let i = 0; i < 5; i++) { g.collapseAll(); g.expandAll(); } return (performance.now() - t) / 10; })()"


def measure(runs: int, app_js: str | None = None) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from dagfold.jobspec import parse_spec, to_job_spec
    from dagfold.wfcommons import workflow_spec
    from tests.api_support import ApiHarness, LiveServer, accepted
    from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

    spec = to_job_spec(parse_spec(workflow_spec(MONTAGE_05D, 0.0)))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        api = ApiHarness(Path(tmp))
        try:
            api.project(accepted(spec["job_id"], spec=spec))
            with LiveServer(api.app) as srv, sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                if app_js is not None:  # another revision's dashboard code, same page and API
                    page.route("**/ui/static/app.js", lambda r: r.fulfill(
                        body=app_js, headers={"content-type": "text/javascript"}))
                page.goto(f"{srv.url}/ui/#/jobs/{spec['job_id']}")
                page.wait_for_function("window.__dagfold.graph && window.__dagfold.graph.data.ids.length === 1738")
                result: dict[str, Any] = {}
                page.evaluate("window.__dagfold.graph.fit()")
                result["expanded_draw_ms"] = [page.evaluate(DRAWS) for _ in range(runs)]
                if page.evaluate("typeof window.__dagfold.graph.collapseAll === 'function'"):
                    result["expanded_nodes"] = page.evaluate("window.__dagfold.graph.nodeCount")
                    page.evaluate("window.__dagfold.graph.collapseAll()")
                    result["collapsed_draw_ms"] = [page.evaluate(DRAWS) for _ in range(runs)]
                    result["collapsed_nodes"] = page.evaluate("window.__dagfold.graph.nodeCount")
                    result["toggle_ms"] = [page.evaluate(TOGGLES) for _ in range(runs)]
                browser.close()
        finally:
            api.close()
    out: dict[str, Any] = {"tasks": 1738, "runs": runs}
    for k, v in result.items():
        out[k] = round(statistics.median(v), 2) if isinstance(v, list) else v
        if isinstance(v, list):
            out[k + "_all"] = [round(x, 2) for x in v]
    out["load_average_before"] = [round(x, 1) for x in load_before]
    out["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.dashboard_draw", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", default="a0ffad6", help="git revision whose app.js is measured too ('' for none)")
    args = ap.parse_args()
    res = {"this_checkout": measure(args.runs)}
    if args.baseline:
        old = subprocess.run(["git", "show", f"{args.baseline}:services/api/static/app.js"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        res["baseline"] = {"revision": args.baseline, **measure(args.runs, old)}
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
