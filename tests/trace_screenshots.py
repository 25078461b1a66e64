"""Screenshots of two real traces in Jaeger's UI for docs/operations.md (Tracing): `make trace-screenshots`
(or ``python -m tests.trace_screenshots --out docs/img --ui-assets DIR``). A tool, not a test.

It starts Jaeger (deploy/jaeger/jaeger.sh, on free loopback ports, serving the built jaeger-ui in
``--ui-assets``: the Go module carries no UI, see the script), a stack with tracing on (OTLP/HTTP to that
Jaeger) and one simulated 2-GPU host, runs Montage 01d (103 tasks, the WfCommons runtimes scaled by
``--time-scale``) and a standard GPU job that an enterprise one preempts, waits until Jaeger holds every
span of both, and has Debian's Chromium (Playwright drives it) take each trace's page.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.screenshots import MONTAGE, ROOT, _wait

JAEGER = ROOT / "deploy" / "jaeger" / "jaeger.sh"
VIEWPORT = {"width": 1400, "height": 1000}


def _spans(query: str, trace_id: str) -> int:
    r = httpx.get(f"{query}/api/traces/{trace_id}", timeout=10)
    return sum(len(t["spans"]) for t in r.json()["data"]) if r.status_code == 200 else 0


def run(out: Path, ui_assets: Path, time_scale: float, montage_file: Path = MONTAGE) -> list[Path]:
    from playwright.sync_api import sync_playwright

    from dagfold.config import Config
    from dagfold.services.stack import Stack, StackOptions
    from dagfold.services.worker.capabilities import parse_handler_list
    from dagfold.services.worker.handlers import default_registry
    from dagfold.wfcommons import workflow_spec
    from tests.cli_support import free_port
    from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

    tmp = Path(tempfile.mkdtemp(prefix="dagfold-traces-"))
    ports = {k: str(free_port()) for k in ("JAEGER_OTLP_GRPC_PORT", "JAEGER_OTLP_HTTP_PORT", "JAEGER_QUERY_PORT",
                                           "JAEGER_QUERY_GRPC_PORT", "JAEGER_HEALTH_PORT")}
    jenv = {**os.environ, **ports, "JAEGER_DATA": str(tmp / "jaeger"), "JAEGER_UI_ASSETS": str(ui_assets)}
    query = f"http://127.0.0.1:{ports['JAEGER_QUERY_PORT']}"
    subprocess.run([str(JAEGER), "start"], env=jenv, check=True, timeout=180)
    written: list[Path] = []
    try:
        os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{ports['JAEGER_OTLP_HTTP_PORT']}",
                           "OTEL_SERVICE_NAME": "dagfold", "OTEL_BSP_SCHEDULE_DELAY": "500"})
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cfg = Config.from_env(log_url="embedded", data_dir=tmp / "data", api_port=port)
        registry = default_registry().select(parse_handler_list("noop,sleep,shell"))
        opts = StackOptions(workers=3, callbacks=False, gpu_nodes=1, gpus_per_node=2, gpu_pool="gpu",
                            registry=registry)
        with Stack(cfg, opts) as stack:
            montage = {**workflow_spec(montage_file, time_scale=time_scale), "id": "montage-01d", "name": "montage-01d"}
            r = httpx.post(f"{base}/v1/jobs", json=montage, timeout=30)
            r.raise_for_status()
            montage_trace = r.json()["trace_id"]
            std = {"job_id": "finetune-std", "model": "llama-8b", "pool": "gpu", "tier": "standard",
                   "params": {"steps": 80, "step_s": 0.05}, "resources": {"gpus": 2}}
            r = httpx.post(f"{base}/v1/gpu-jobs", json=std, timeout=10)
            r.raise_for_status()
            gpu_trace = r.json()["trace_id"]
            _wait("the standard GPU job to run", lambda: stack.agents[0].procs, 60)
            time.sleep(1.5)
            urgent = {**std, "job_id": "finetune-urgent", "tier": "enterprise", "params": {"steps": 10, "step_s": 0.05}}
            httpx.post(f"{base}/v1/gpu-jobs", json=urgent, timeout=10).raise_for_status()
            for job in ("montage-01d", "finetune-urgent", "finetune-std"):
                state = (stack.wait_job(job, timeout_s=600) or {}).get("state")
                print(f"{job}: {state}", file=sys.stderr)
            spans_of = {montage_trace: 0, gpu_trace: 0}
            for trace_id in spans_of:  # the exporter's batches have arrived when the count stops growing
                last = -1
                while (n := _spans(query, trace_id)) != last or n == 0:
                    last = n
                    time.sleep(2.0)
                spans_of[trace_id] = last
            print(f"spans: montage {spans_of[montage_trace]}, gpu {spans_of[gpu_trace]}", file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport=VIEWPORT)
            for name, trace_id in (("trace-montage.png", montage_trace), ("trace-gpu-preempted.png", gpu_trace)):
                page.goto(f"{query}/trace/{trace_id}", wait_until="networkidle")
                page.wait_for_selector("text=Trace Start", timeout=30_000)
                if name == "trace-montage.png":  # the job and its 103 attempts; their phases folded
                    page.locator(".TimelineCollapser--btn-size").nth(1).click()
                else:  # the preempted run's details: its events (checkpointing, preempted) and attributes
                    page.locator(".span-name", has_text="running").first.click()
                    for header in (".AccordianKeyValues--header", ".AccordianLogs--header"):
                        time.sleep(0.5)  # its attributes, then its events (checkpointing, preempted)
                        page.locator(header).first.click()
                page.mouse.move(5, 990)  # no tooltip over the picture
                time.sleep(1.0)
                path = out / name
                page.screenshot(path=str(path))
                written.append(path)
            browser.close()
    finally:
        subprocess.run([str(JAEGER), "stop"], env=jenv, check=False, timeout=60)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--ui-assets", type=Path, required=True, help="a built jaeger-ui (its index.html folder)")
    ap.add_argument("--time-scale", type=float, default=0.02, help="WfCommons runtimes times this, seconds")
    ap.add_argument("--montage", type=Path, default=MONTAGE, help="the WfCommons Montage 01d instance")
    args = ap.parse_args(argv)
    for p in run(args.out, args.ui_assets.resolve(), args.time_scale, args.montage):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
