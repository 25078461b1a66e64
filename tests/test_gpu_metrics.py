"""The GPU panels of the Grafana dashboard have data: after GPU jobs ran on a stack (its allocator and
simulated agents), a scrape of its /metrics holds a non-zero sample of every metric those panels chart,
fed by the running allocator (decision latency, queue wait) and the agents' heartbeats (utilisation)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gpu_support import gpu_stack

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dagfold.json"


def gpu_panel_metrics() -> set[str]:
    """Metric names the dashboard's GPU and allocator panels chart (histograms by their base name)."""
    names = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        title = panel.get("title", "")
        if "GPU" not in title and "Allocator" not in title:
            continue
        for t in panel.get("targets", []):
            for name in re.findall(r"dagfold_[a-z_]+", t["expr"]):
                names.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return names


def nonzero(text: str) -> set[str]:
    """Metric families with at least one non-zero sample (a histogram: a non-zero count)."""
    out = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.type == "histogram" and not s.name.endswith("_count"):
                continue
            if s.value:
                out.add(fam.name)
    return out


def test_every_gpu_panel_of_the_dashboard_has_data_after_gpu_jobs_ran(tmp_path: Path) -> None:
    wanted = gpu_panel_metrics()
    assert {"dagfold_gpus", "dagfold_gpu_utilization_ratio", "dagfold_allocator_decision_latency_seconds",
            "dagfold_allocator_queue_wait_seconds"} <= wanted, wanted
    with gpu_stack(tmp_path) as stack:
        base = f"http://127.0.0.1:{stack.config.api_port}"
        short = {"job_id": "quick", "model": "m", "pool": "gpu", "params": {"steps": 3, "step_s": 0.01},
                 "resources": {"gpus": 1}}
        assert httpx.post(f"{base}/v1/gpu-jobs", json=short, timeout=10).status_code == 202
        assert (stack.wait_job("quick", timeout_s=60) or {}).get("state") == "succeeded"
        long = {**short, "job_id": "long", "tier": "enterprise", "params": {"steps": 400, "step_s": 0.05}}
        assert httpx.post(f"{base}/v1/gpu-jobs", json=long, timeout=10).status_code == 202
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        while time.monotonic() < deadline:  # the running job's GPU in use, reported by the next heartbeats
            seen = nonzero(httpx.get(f"{base}/metrics", timeout=10).text)
            if wanted <= seen:
                break
            time.sleep(0.3)
        assert wanted <= seen, f"no data for {sorted(wanted - seen)}"
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'dagfold_allocator_queue_wait_seconds_count{tier="enterprise"}' in text
        assert 'dagfold_allocator_decision_latency_seconds_count{decision="grant"}' in text
        assert re.search(r'dagfold_agent_gpu_utilization_ratio\{gpu="\d",node="gpu-node-0"\} 0\.9', text)
        assert not stack.failed, stack.errors
