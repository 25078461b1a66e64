"""A real Java producer (kafka-clients + Avro's BinaryMessageEncoder, default partitioner) gets
jobs run on a dagfold stack on Kafka (issue 15, 2): examples/java, compiled here with javac."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dagfold import metrics
from dagfold.config import DEADLETTER, Config
from dagfold.log import TopicPartition, partition_for
from dagfold.services.stack import Stack, StackOptions
from tests.cli_support import ROOT

pytestmark = pytest.mark.kafka


def java_classpath() -> str:
    r = subprocess.run([str(ROOT / "examples/java/build.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_java_producer_with_default_settings_gets_jobs_run(kafka_bootstrap: str, tmp_path: Path) -> None:
    cp = java_classpath()
    url = f"kafka://{kafka_bootstrap}?prefix=java-{tmp_path.name[-12:]}"
    cfg = Config.from_env(log_url=url, data_dir=tmp_path / "data", partitions=8, dispatch_partitions=2)
    forwarded = metrics.COMMANDS_FORWARDED.labels("scheduler")
    before = forwarded._value.get()
    with Stack(cfg, StackOptions(workers=2, api=False, callbacks=False)) as stack:
        r = subprocess.run(["java", "-cp", cp, "io.dagfold.example.SubmitJobProducer",
                            "--bootstrap", kafka_bootstrap, "--topic", cfg.topics.commands,
                            "--schemas", str(ROOT / "schemas"), "--jobs", "6", "--tasks", "3"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        landed = dict(line.split() for line in r.stdout.split("\n") if line.strip())
        assert len(landed) == 6
        # the Java client's default partitioner and dagfold's agree on every job
        assert {j: int(p) for j, p in landed.items()} == {j: partition_for(j.encode(), 8) for j in landed}
        for job_id in landed:
            job = stack.wait_job(job_id, timeout_s=120)
            assert job is not None and job["state"] == "succeeded", job
            assert job["counts"]["succeeded"] == 3
        assert stack.log is not None
        assert stack.log.end_offsets([TopicPartition(DEADLETTER, 0)])[TopicPartition(DEADLETTER, 0)] == 0
    assert forwarded._value.get() == before  # none needed forwarding
