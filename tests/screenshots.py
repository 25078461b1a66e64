"""Screenshots of every dashboard view for docs/operations.md: `make screenshots` (or
``python -m tests.screenshots --out docs/img``). A tool, not a test: it asserts nothing beyond what it needs
to reach each view, and writes PNGs.

It runs what `make run` runs, in this process: the whole stack on the embedded log in a temporary folder
(scheduler, projector, API, three workers with noop/sleep/shell, the GPU pool's allocator and two simulated
8-GPU hosts), submits the examples (examples/cycle.yaml is rejected: an upstream producer's SubmitJob is not
checked by the API), a small ETL job to watch live, Montage 01d (103 tasks) and 05d (1,738 tasks), and writes
two hostile records to the commands topic for the dead-letter page. Then Debian's Chromium (`make browser`;
Playwright only drives it, no `playwright install`) visits each view.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
WF = ROOT.parent / "shared" / "data" / "wfcommons"
MONTAGE = WF / "montage-chameleon-2mass-01d-001.json.gz"
MONTAGE_05D = WF / "montage-chameleon-2mass-05d-001.json.gz"
VIEWPORT = {"width": 1400, "height": 1000}
VIEWS = ("jobs.png", "job-running.png", "failed-task.png", "job-graph.png", "job-graph-05d.png",
         "job-graph-grouped.png", "job-gantt.png", "job-gantt-workers.png", "job-grid.png", "job-rejected.png",
         "deadletters.png", "operations.png", "cluster-live.png")


def _wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"screenshots: gave up waiting for {what} after {timeout:.0f} s")


class Demo:
    """The stack and the jobs the views show."""

    def __init__(self, data: Path) -> None:
        from dagfold.config import Config
        from dagfold.services.stack import Stack, StackOptions
        from dagfold.services.worker.capabilities import parse_handler_list
        from dagfold.services.worker.handlers import default_registry
        from tests.cli_support import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cfg = Config.from_env(log_url="embedded", data_dir=data, api_port=port)
        registry = default_registry().select(parse_handler_list("noop,sleep,shell"))
        self.stack = Stack(cfg, StackOptions(workers=3, callbacks=False, gpu_nodes=2, registry=registry))
        self.jobs: dict[str, str] = {}

    def __enter__(self) -> Demo:
        self.stack.start()
        _wait("the API", self._healthy, 60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def job(self, job_id: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.url}/v1/jobs/{job_id}", timeout=10)
        return r.json() if r.status_code == 200 else None

    def wait_state(self, job_id: str, states: set[str], timeout: float, soft: bool = False) -> None:
        """Until the job is in one of ``states``; ``soft``: or the time is up (the view shows it as it is)."""
        try:
            _wait(f"job {job_id} in {states}", lambda: (j := self.job(job_id)) is not None and j["state"] in states,
                  timeout)
        except SystemExit:
            if not soft:
                raise
            print(f"screenshots: job {job_id} still not in {states} after {timeout:.0f} s; shown as it is")

    def submit(self, name: str, spec: dict[str, Any]) -> str:
        r = httpx.post(self.url + "/v1/jobs", json=spec, timeout=60)
        if r.status_code != 202:
            raise SystemExit(f"screenshots: {name} was refused: {r.status_code} {r.text[:300]}")
        self.jobs[name] = str(r.json()["job_id"])
        return self.jobs[name]

    def produce(self, key: bytes, value: bytes) -> None:
        from dagfold.config import COMMANDS

        assert self.stack.log is not None
        prod = self.stack.log.producer("screenshots")
        prod.send(COMMANDS, key, value)
        prod.flush()
        prod.close()

    def live(self) -> None:
        """A small ETL job, first, so that the running view finds it running."""
        self.submit("etl", {"name": "etl-live", "tasks": [
            {"id": "extract", "handler": "sleep", "args": {"seconds": 2.0}},
            *[{"id": f"transform-{i}", "handler": "sleep", "args": {"seconds": 10.0 + 3.0 * i},
               "depends_on": ["extract"]} for i in range(4)],
            {"id": "load", "handler": "sleep", "args": {"seconds": 1.0},
             "depends_on": [f"transform-{i}" for i in range(4)]}]})

    def populate(self) -> None:
        import yaml

        from dagfold.cli.main import submit_examples
        from dagfold.codec import default_codec
        from dagfold.commands import submit_job
        from dagfold.jobspec import load_spec_text, to_job_spec
        from dagfold.wfcommons import workflow_spec

        self.submit("montage-05d", {**workflow_spec(MONTAGE_05D, time_scale=0.0), "name": "montage-05d"})  # longest
        submit_examples(self.stack)  # as `make run`: examples/cycle.yaml among them, written past the API
        self.submit("failing", {**yaml.safe_load((ROOT / "examples" / "failing.yaml").read_text()),
                                "labels": {"example": "failing"}})
        self.jobs["montage"] = _wait("the Montage example", lambda: [j["job_id"] for j in httpx.get(
            self.url + "/v1/jobs?limit=100", timeout=10).json()["jobs"] if j["total_tasks"] == 103], 60)[0]
        # what an upstream producer gets wrong: a SubmitJob keyed by another ID, bytes that are not Avro
        bad = to_job_spec(load_spec_text("id: orders-42\ntasks: [{id: a, handler: noop}]"))
        self.produce(b"orders/42", default_codec().encode(submit_job(bad, source="upstream")))
        self.produce(b"<img src=x>", b"<script>alert(1)</script>" + b"\x00" * 64)


def shoot(out: Path, only: set[str] | None) -> list[Path]:
    from playwright.sync_api import sync_playwright

    from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="dagfold-shots-") as tmp, Demo(Path(tmp) / "data") as demo, \
            sync_playwright() as pw:
        demo.live()
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)

        def save(name: str, target: Any = None, full: bool = False) -> None:
            if only and name not in only:
                return
            time.sleep(0.4)  # the last frame and the attempts' timeline
            path = out / name
            (target or page).screenshot(path=str(path), timeout=120_000, **({"full_page": True} if full else {}))
            written.append(path)
            print(f"screenshots: {path}")

        def job_page(name: str, ready: str = "window.__dagfold.graph !== null") -> None:
            page.goto(f"{demo.url}/ui/#/jobs/{demo.jobs[name]}")
            page.wait_for_function(ready, timeout=60_000)

        job_page("etl", "window.__dagfold.stateOf('extract') === 'succeeded'"
                        " && window.__dagfold.graph.states.includes('running')")
        save("job-running.png")
        demo.populate()

        demo.wait_state(demo.jobs["failing"], {"failed"}, 180)
        job_page("failing", "window.__dagfold.stateOf('bad') === 'failed'")
        pos = page.evaluate("window.__dagfold.nodeScreenPos('bad')")
        page.mouse.click(pos["x"], pos["y"])
        page.wait_for_selector("#task-reason")
        save("failed-task.png")
        page.click("#grid-toggle")
        page.wait_for_function("window.__dagfold.gridRows > 0")
        save("job-grid.png", page.locator("#grid"))

        job_page("etl", "window.__dagfold.stateOf('load') === 'succeeded'"
                        " && window.__dagfold.timeline && window.__dagfold.timeline.rows.length === 6")
        page.evaluate("window.__dagfold.timeline.fit()")
        save("job-gantt.png", page.locator("#gantt").locator(".."))
        page.select_option("#gantt-group", "worker")  # rows grouped by the worker that ran them
        save("job-gantt-workers.png", page.locator("#gantt").locator(".."))
        page.select_option("#gantt-group", "")

        demo.wait_state(demo.jobs["montage"], {"succeeded"}, 300, soft=True)
        job_page("montage", "window.__dagfold.timeline && window.__dagfold.timeline.rows.length > 0")
        save("job-graph.png")

        demo.wait_state(demo.jobs["montage-05d"], {"succeeded", "failed"}, 420, soft=True)
        job_page("montage-05d", "window.__dagfold.graph && window.__dagfold.graph.data.ids.length === 1738")
        save("job-graph-05d.png")
        page.click("#dag-collapse")
        save("job-graph-grouped.png")

        demo.jobs["cycle"] = _wait("the rejected cycle example", lambda: [j["job_id"] for j in httpx.get(
            demo.url + "/v1/jobs?state=rejected", timeout=10).json()["jobs"] if j["code"] == "cycle"], 60)[0]
        job_page("cycle", "window.__dagfold.graph && window.__dagfold.graph.data.ids.length > 0")
        save("job-rejected.png")

        page.goto(f"{demo.url}/ui/#/deadletters")
        page.wait_for_function("document.querySelectorAll('#deadletters tbody tr').length >= 2", timeout=60_000)
        page.locator("#deadletters summary").first.click()
        save("deadletters.png")

        page.goto(f"{demo.url}/ui/#/jobs")
        page.wait_for_selector(f'tr[data-job="{demo.jobs["failing"]}"] .badge.failed')
        save("jobs.png")

        page.goto(f"{demo.url}/ui/#/ops")
        page.wait_for_function("window.__dagfold.ready")
        save("operations.png")

        page.goto(f"{demo.url}/ui/#/cluster")
        page.wait_for_selector("#nodemap", timeout=60_000)  # the two simulated GPU hosts
        save("cluster-live.png")
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.screenshots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the PNGs (docs/img)")
    ap.add_argument("--only", action="append", choices=VIEWS, help="just this view; repeatable")
    args = ap.parse_args(argv)
    for f in (MONTAGE, MONTAGE_05D):
        if not f.exists():
            print(f"screenshots: {f} is missing (the workload data)", file=sys.stderr)
            return 2
    written = shoot(args.out, set(args.only) if args.only else None)
    print(f"screenshots: {len(written)} views in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
