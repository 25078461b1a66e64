"""Topic namespaces (prefixes), the partitioner every Kafka client agrees on, and the record
framings dagfold reads (issue 15, 1, 3 and 4)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from dagfold.commands import submit_job
from dagfold.config import COMMANDS, EVENTS, SCHEDULER_GROUP, Config
from dagfold.exceptions import LogError
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.log import TopicPartition, open_log
from dagfold.log.base import crc32_partition, murmur2, murmur2_partition, partition_for
from dagfold.log.embedded import EmbeddedLog
from dagfold.log.namespace import Namespace, NamespacedLog
from dagfold.services.stack import Stack, StackOptions

# org.apache.kafka.common.utils.UtilsTest#testMurmur2: the Java client's own vectors.
JAVA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def test_murmur2_matches_the_java_client() -> None:
    assert {k: murmur2(k) for k in JAVA_MURMUR2} == JAVA_MURMUR2


def test_the_partition_clears_the_sign_bit_as_java_to_positive_does() -> None:
    # a negative hash: toPositive (& 0x7fffffff) and abs() disagree, and Java uses toPositive
    h = murmur2(b"foobar")
    assert h < 0
    assert murmur2_partition(b"foobar", 7) == (h & 0x7FFFFFFF) % 7 != abs(h) % 7
    assert partition_for(b"foobar", 7) == murmur2_partition(b"foobar", 7)


def test_namespace_maps_topics_groups_and_transactional_ids() -> None:
    ns = Namespace("prod.dagfold")
    assert ns.topic(COMMANDS) == "prod.dagfold.commands"
    assert ns.logical("prod.dagfold.dispatch.gpu") == "dispatch.gpu"
    assert ns.group(SCHEDULER_GROUP) == "prod.dagfold.dagfold-scheduler"
    assert Namespace("").topic(EVENTS) == EVENTS
    for bad in ("a b", "x.", "ü", "a/b"):
        with pytest.raises(LogError, match="bad topic prefix"):
            Namespace(bad)


def test_config_topics_from_the_url_or_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert Config(log_url="kafka://h:9092?prefix=prod.dagfold").topics.commands == "prod.dagfold.commands"
    monkeypatch.setenv("DAGFOLD_TOPIC_PREFIX", "team-a")
    cfg = Config.from_env()
    assert cfg.topics.events == "team-a.events" and cfg.topics.dispatch("gpu") == "team-a.dispatch.gpu"
    assert Config().topics.commands == "commands"
    with pytest.raises(LogError, match="differ"):
        open_log("embedded?prefix=b", tmp_path, prefix="team-a")


def test_a_prefixed_log_writes_prefixed_topics_and_reads_back_logical_names(tmp_path: Path) -> None:
    lg = open_log("embedded?prefix=blue", tmp_path)
    assert isinstance(lg, NamespacedLog)
    lg.create_topics(Config(partitions=2).core_topics())
    inner = lg.inner
    assert isinstance(inner, EmbeddedLog)
    assert "blue.commands" in inner.topics() and "commands" not in inner.topics()
    p = lg.producer("t")
    p.send(COMMANDS, b"job", b"v")
    p.flush()
    c = lg.consumer("g")
    c.subscribe([COMMANDS])
    recs = c.poll(10, 2.0)
    assert [(r.topic, r.key) for r in recs] == [(COMMANDS, b"job")]
    c.commit({TopicPartition(COMMANDS, recs[0].partition): recs[0].offset + 1})
    assert inner.committed("blue.g", [TopicPartition("blue.commands", recs[0].partition)]) == {
        TopicPartition("blue.commands", recs[0].partition): 1}
    c.close()
    lg.close()


def test_the_embedded_log_keeps_the_partitioner_it_was_written_with(tmp_path: Path) -> None:
    new = EmbeddedLog(tmp_path / "new")
    assert new.partitioner == "murmur2_random"
    new.close()
    # a log written before the partitioner was recorded used CRC-32, and goes on with it
    old = EmbeddedLog(tmp_path / "old")
    old.create_topics(Config(partitions=3).core_topics())
    old._db.delete(b"mpartitioner")
    old.close()
    old = EmbeddedLog(tmp_path / "old")
    assert old.partitioner == "consistent_random"
    assert old.partition_for(b"job-1", 3) == crc32_partition(b"job-1", 3)
    old.close()
    with pytest.raises(LogError, match="partitions with consistent_random, not murmur2_random"):
        EmbeddedLog(tmp_path / "old", partitioner="murmur2_random")
    with pytest.raises(LogError, match="unknown partitioner"):
        open_log("embedded?partitioner=fnv", tmp_path)


@pytest.mark.kafka
def test_two_stacks_with_different_prefixes_share_one_broker(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Same job ID in both deployments: each runs its own job, with its own topics and groups."""
    run = uuid.uuid4().hex[:6]
    job_id = "shared-id"
    stacks = []
    for name, tasks in (("blue", 2), ("green", 3)):
        url = (f"kafka://{kafka_bootstrap}?prefix={name}-{run}"
               "&consumer.session.timeout.ms=6000&consumer.heartbeat.interval.ms=500")
        cfg = Config.from_env(log_url=url, data_dir=tmp_path / name, partitions=2, dispatch_partitions=2)
        stacks.append((Stack(cfg, StackOptions(workers=1, api=False, callbacks=False)).start(), tasks))
    try:
        for stack, tasks in stacks:
            text = f"id: {job_id}\ntasks:\n" + "".join(f"  - {{id: t{i}}}\n" for i in range(tasks))
            assert stack.sender is not None
            stack.sender.send(submit_job(to_job_spec(load_spec_text(text)), source="test"))
        for stack, tasks in stacks:
            job = stack.wait_job(job_id, timeout_s=120)
            assert job is not None and job["state"] == "succeeded", job
            assert job["counts"]["succeeded"] == tasks  # its own job, not the other deployment's
        from confluent_kafka.admin import AdminClient

        names = set(AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).topics)
        for color in ("blue", "green"):
            assert {f"{color}-{run}.commands", f"{color}-{run}.events", f"{color}-{run}.dispatch.default"} <= names
    finally:
        t0 = time.monotonic()
        for stack, _ in stacks:
            stack.stop()
        assert time.monotonic() - t0 < 60


def test_confluent_registry_framing_is_refused_with_a_reason_that_says_so() -> None:
    """No registry could be run here (docs/architecture.md, Schema Registry): a Confluent-framed
    record is dead-lettered with a reason that names the framing and the format to use."""
    from dagfold.codec import default_codec
    from dagfold.exceptions import CodecError

    with pytest.raises(CodecError, match=r"Confluent Schema Registry framing \(magic 0, schema ID 258\)"):
        default_codec().decode(b"\x00\x00\x00\x01\x02" + b"\x02ab")
