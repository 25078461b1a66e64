"""End to end on the project's real Kafka broker (started by the session fixture)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dagfold.commands import submit_job
from dagfold.config import Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.services.stack import Stack, StackOptions
from dagfold.tracing import job_trace_id
from dagfold.wfcommons import workflow_spec
from tests.cli_support import ROOT, UpProcess, dagfold, kafka_url

pytestmark = pytest.mark.kafka
WF = ROOT.parent / "shared" / "data" / "wfcommons"


def test_montage_runs_to_success_on_kafka(kafka_bootstrap: str, tmp_path: Path) -> None:
    job_id = f"montage-kafka-{int(time.time() * 1000)}"
    spec = to_job_spec(parse_spec(workflow_spec(WF / "montage-chameleon-2mass-05d-001.json.gz", job_id=job_id)))
    cfg = Config.from_env(log_url=f"kafka://{kafka_bootstrap}", data_dir=tmp_path / "data")
    with Stack(cfg, StackOptions(workers=2, api=False)) as stack:
        stack.sender.send(submit_job(spec, source="test"))
        job = stack.wait_job(job_id, timeout_s=300)
        assert job is not None and job["state"] == "succeeded", job
        assert job["counts"]["succeeded"] == 1738
        # the submission and every task's report went through the log (a noop reports once: its outcome)
        assert stack.runner.folded >= 1 + 1738


def test_up_on_kafka_submit_wait_upstream_producer_and_kill9(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = kafka_url(kafka_bootstrap)  # the killed stack's members leave the group after 6 s, not 45 s
    data = tmp_path / "data"
    up = UpProcess(data, log=url, args=("--handlers", "noop,sleep,shell")).start()  # the examples run shell
    try:
        r = dagfold("submit", "examples/diamond.yaml", "--wait", "--api", up.api, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        r = dagfold("submit", "examples/cycle.yaml", "--api", up.api)
        assert r.returncode == 2 and "b -> c -> a -> b" in r.stderr
        r = dagfold("submit", "examples/failing.yaml", "--wait", "--api", up.api, "--json", timeout=300)
        assert r.returncode == 1, r.stdout + r.stderr
        job_id = r.stdout.split('"job_id": "', 1)[1].split('"', 1)[0]
        h = dagfold("history", job_id, "--api", up.api)
        assert "exit code 3" in h.stdout and "TaskSkipped" in h.stdout

        # an upstream system with only confluent-kafka, fastavro and the .avsc files
        p = subprocess.run([sys.executable, "examples/upstream_producer.py", "--bootstrap", kafka_bootstrap],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        upstream_job = p.stdout.strip()
        assert up.wait(upstream_job, timeout=120)["state"] == "succeeded"

        # kill -9 in the middle of a chain, restart on the same data folder: the job finishes
        chain = "retry: {max_attempts: 3, initial_interval_s: 0.2}\ntimeouts: {heartbeat_s: 3}\ntasks:\n" + "".join(
            f"  - {{id: t{i}, handler: sleep, args: {{seconds: 0.3}}"
            f"{', depends_on: [t' + str(i - 1) + ']' if i else ''}}}\n" for i in range(10))
        chain_job = up.submit(chain)
        up.wait(chain_job, timeout=120, states={"running"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (up.job(chain_job) or {}).get("counts", {}).get("succeeded", 0) < 3:
            time.sleep(0.05)
        up.kill9()
    finally:
        up.stop()
    up2 = UpProcess(data, log=url, port=up.port).start()
    try:
        job = up2.wait(chain_job, timeout=180)
        assert job["state"] == "succeeded" and job["counts"]["succeeded"] == 10, job
    finally:
        up2.stop()


def test_an_upstream_producers_traceparent_header_is_the_jobs_trace(kafka_bootstrap: str, tmp_path: Path) -> None:
    """An upstream system writes SubmitJob with no traceparent field and the W3C context in a record
    header (examples/upstream_producer.py --traceparent): the job continues that trace. An invalid
    header is ignored, as the REST header's is: the job starts a trace of its own."""
    header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    stamp = int(time.time() * 1000)
    cfg = Config.from_env(log_url=f"kafka://{kafka_bootstrap}", data_dir=tmp_path / "data")
    with Stack(cfg, StackOptions(workers=0, api=False, callbacks=False)) as stack:
        for job_id, value in ((f"tp-header-{stamp}", header), (f"tp-garbage-{stamp}", "00-garbage-01")):
            p = subprocess.run([sys.executable, "examples/upstream_producer.py", "--bootstrap", kafka_bootstrap,
                                "--job-id", job_id, "--traceparent", value],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (stack.read_model.get_job(f"tp-garbage-{stamp}") is None
                                               or stack.read_model.get_job(f"tp-header-{stamp}") is None):
            time.sleep(0.1)
        assert stack.read_model.get_job(f"tp-header-{stamp}")["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert stack.read_model.get_job(f"tp-garbage-{stamp}")["trace_id"] == job_trace_id(f"tp-garbage-{stamp}")
