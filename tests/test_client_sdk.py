"""dagfold.client, the SDK for upstream Python teams (issue 15, 5): the typed builder, and
submit / status / wait / idempotency keys over REST (embedded stack) and straight to Kafka."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dagfold.client import ClientError, Job, JobNotFound, KafkaClient, RestClient, Retry
from dagfold.config import Config
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.worker.handlers import HandlerRegistry
from tests.cli_support import ROOT, free_port


def chain(job: Job, n: int, handler: str = "noop") -> Job:
    prev = None
    for i in range(n):
        prev = job.task(f"t{i}", handler, after=[prev] if prev else [])
    return job


def test_the_builder_makes_the_apis_spec_and_fixes_the_job_id() -> None:
    job = Job(tenant="acme", idempotency_key="k-1", retry=Retry(max_attempts=2))
    a = job.task("a", "shell", args={"cmd": "echo a"})
    job.task("b", after=[a, "a"])
    rec = job.to_record()
    assert rec["job_id"] == job.id == Job(tenant="acme", idempotency_key="k-1").id  # derived from the key
    assert [t["depends_on"] for t in rec["tasks"]] == [[], ["a", "a"]]
    assert rec["retry"]["max_attempts"] == 2 and rec["tasks"][0]["args_json"] == '{"cmd":"echo a"}'
    assert Job().id != Job().id  # no key: a fresh ID, fixed for this builder
    bad = Job()
    bad.task("", "noop")
    with pytest.raises(ClientError, match="invalid_spec: .*tasks.0.id"):
        RestClient("http://127.0.0.1:1", retries=0).submit(bad)


def test_rest_submit_wait_status_and_idempotency_on_a_running_stack(tmp_path: Path) -> None:
    port = free_port()
    cfg = Config(data_dir=tmp_path / "data", partitions=2, dispatch_partitions=2, api_port=port)
    opts = StackOptions(workers=1, callbacks=False, registry=HandlerRegistry.with_builtins(shell=True))  # the example
    with Stack(cfg, opts), RestClient(f"http://127.0.0.1:{port}") as client:  # script runs shell tasks
        job = chain(Job(idempotency_key="nightly-1"), 3)
        first = client.submit(job)
        assert first.job_id == job.id and first.created is True
        done = client.wait(job.id, timeout_s=60, poll_s=0.05)
        assert done.state == "succeeded" and done.counts["succeeded"] == 3 and done.done
        again = client.submit(chain(Job(idempotency_key="nightly-1"), 3))  # a retry: same key, same spec
        assert again.job_id == job.id and again.created is False
        with pytest.raises(ClientError) as err:
            client.submit(chain(Job(idempotency_key="nightly-1"), 4))  # same key, another spec
        assert err.value.status == 409 and err.value.code == "idempotency_conflict"
        assert client.status(job.id).state == "succeeded"
        with pytest.raises(JobNotFound):
            client.status("no-such-job")
        cyc = Job()
        cyc.task("x", after=["y"])
        cyc.task("y", after=["x"])
        with pytest.raises(ClientError) as err:
            client.submit(cyc)
        assert err.value.status == 422 and "x" in err.value.reason
        # acting on a job: a failed task marked succeeded lets its downstream run; then a redrive of the
        # succeeded job and a retry of its succeeded task are refused with the API's codes
        broken = Job()
        broken.task("b", after=[broken.task("a", "shell", args={"cmd": "exit 3"})])
        client.submit(broken)
        assert client.wait(broken.id, timeout_s=60, poll_s=0.05).state == "failed"
        client.mark_task_succeeded(broken.id, "a", reason="done by hand")
        # the action is a command: the read model shows the job failed until the scheduler's next commit
        # (up to its commit interval, docs/semantics.md) re-opens it, so wait for that before waiting for the end
        deadline = time.monotonic() + 60
        while client.status(broken.id).state == "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        healed = client.wait(broken.id, timeout_s=60, poll_s=0.05)
        assert healed.state == "succeeded" and healed.counts["succeeded"] == 2, healed
        with pytest.raises(ClientError) as err:
            client.redrive(broken.id)
        assert (err.value.status, err.value.code) == (409, "not_redrivable")
        with pytest.raises(ClientError) as err:
            client.retry_task(broken.id, "a")
        assert err.value.status == 409
        with pytest.raises(JobNotFound):
            client.retry_task("no-such-job", "a")
        # the example script, over REST
        p = subprocess.run([sys.executable, "examples/client_sdk.py", "--api", f"http://127.0.0.1:{port}",
                            "--timeout", "60"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and p.stdout.split()[1] == "succeeded", p.stdout + p.stderr


@pytest.mark.kafka
def test_kafka_submit_wait_status_and_idempotency(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = f"kafka://{kafka_bootstrap}?prefix=sdk-{tmp_path.name[-10:]}"
    cfg = Config.from_env(log_url=url, data_dir=tmp_path / "data", partitions=2, dispatch_partitions=2)
    with Stack(cfg, StackOptions(workers=1, api=False, callbacks=False)), KafkaClient(url) as client:
        job = chain(Job(idempotency_key="direct-1"), 2)
        sub = client.submit(job)
        assert sub.job_id == job.id and sub.created is None
        assert client.wait(job.id, timeout_s=120).state == "succeeded"
        client.submit(chain(Job(idempotency_key="direct-1"), 2))  # the same job again: deduplicated
        st = client.status(job.id)
        assert st.state == "succeeded" and st.job_id == job.id
        with pytest.raises(JobNotFound):
            client.status("never-submitted")
        bad = Job()
        bad.task("a", after=["missing"])
        with pytest.raises(ClientError, match="missing"):
            client.submit(bad)
        with pytest.raises(ClientError, match="kafka:// URL"):
            KafkaClient("embedded")
