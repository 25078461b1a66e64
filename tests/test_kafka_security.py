"""The log's trust boundary on Kafka: the whole stack on a broker with SASL/SCRAM and ACLs (loopback).

The project's broker script starts with ``KAFKA_SECURITY=sasl``; dagfold's
principal may do what the stack needs, another principal may only read
``events``. That principal cannot forge a worker's report: its TaskSucceeded
is refused by the broker, and the task ends when its worker says so. The
``kafka://`` URL's SASL settings reach every client, the admin client
included (topic creation needs them). On the code before, the admin client
got only ``bootstrap.servers`` and the stack could not start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from dagfold import codec
from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.localkafka import SecureLocalKafka, free_base_port
from dagfold.log import open_log
from dagfold.log.factory import kafka_security_settings
from dagfold.services.stack import Stack, StackOptions

pytestmark = pytest.mark.kafka

SERVICE, SERVICE_PW = "dagfold", "dagfold-pw-0123"
ROGUE, ROGUE_PW = "rogue", "rogue-pw-0123"
UPSTREAM, UPSTREAM_PW = "upstream", "upstream-pw-0123"  # a producer trusted to submit: may write `commands`


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureLocalKafka]:
    b = SecureLocalKafka(free_base_port(range(39300, 39900, 7)), tmp_path_factory.mktemp("sasl-kafka"))
    try:
        b.start()
        b.add_user(SERVICE, SERVICE_PW)
        b.add_user(ROGUE, ROGUE_PW)
        b.add_user(UPSTREAM, UPSTREAM_PW)
        for resource, name in (("TOPIC", "*"), ("GROUP", "*"), ("TRANSACTIONAL_ID", "*"),
                               ("BROKER", "kafka-cluster")):
            b.allow(SERVICE, resource, name, ["ALL"])
        b.allow(ROGUE, "TOPIC", "events", ["READ", "DESCRIBE"])
        b.allow(UPSTREAM, "TOPIC", "commands", ["WRITE", "DESCRIBE"])
        yield b
    finally:
        b.stop()


def test_url_security_settings_reach_every_client() -> None:
    q = "security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512&sasl.username=u&consumer.session.timeout.ms=6000"
    assert kafka_security_settings(q, env={"DAGFOLD_KAFKA_SASL_PASSWORD": "p"}) == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u",
        "sasl.password": "p"}


def test_a_principal_without_write_access_cannot_forge_a_report(broker: SecureLocalKafka, tmp_path: Path) -> None:
    # no credentials: nothing at all
    anon = open_log(broker.url + "?producer.message.timeout.ms=3000", tmp_path)
    with pytest.raises(Exception):  # noqa: B017 - any failure to reach the cluster will do
        anon.partitions("commands")
    anon.close()

    cfg = Config(log_url=broker.user_url(SERVICE, SERVICE_PW), data_dir=tmp_path / "data", partitions=2,
                 dispatch_partitions=2)
    spec = to_job_spec(parse_spec({"id": "sec-j1", "tasks": [{"id": "t", "handler": "sleep",
                                                                  "args": {"seconds": 4}}]}))
    with Stack(cfg, StackOptions(workers=1, api=False)) as stack:  # topics created by the admin client over SASL
        stack.sender.send(submit_job(spec, source="test"))
        deadline = time.monotonic() + 60
        task = None
        while time.monotonic() < deadline:
            task = stack.read_model.get_task("sec-j1", "t")
            if task is not None and task["state"] == "running":
                break
            time.sleep(0.1)
        assert task is not None and task["state"] == "running", task
        started = time.monotonic()
        worker = task["worker_id"]

        errors: list[KafkaError] = []
        rogue = Producer({**broker.client_config(ROGUE, ROGUE_PW), "message.timeout.ms": 10000, "log_level": 0})
        forged = codec.make("dagfold.command.TaskSucceeded", job_id="sec-j1", task_id="t", attempt=task["attempt"],
                            worker_id=worker, ts_ms=int(time.time() * 1000), result_json='{"forged": true}',
                            stdout_tail="", stderr_tail="")
        rogue.produce("commands", default_codec().encode(forged), b"sec-j1",
                      on_delivery=lambda err, msg: errors.append(err))
        rogue.flush(15)
        assert errors and errors[0] is not None
        assert errors[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, errors[0]

        job = stack.wait_job("sec-j1", 60)
        assert job is not None and job["state"] == "succeeded", job
        assert time.monotonic() - started >= 2.0  # ended by its worker's sleep, not by the forgery
        attempts = stack.read_model.get_attempts("sec-j1", "t")
        assert [a.get("worker_id") for a in attempts] == [worker]
        assert "forged" not in str(attempts)


def test_an_upstream_producer_cannot_forge_an_allocation_grant(broker: SecureLocalKafka, tmp_path: Path) -> None:
    """Issue 24, recipe 3: a principal that may write ``commands`` (to submit) forges a GPU grant. On
    ``scheduler.internal``, where grants travel, the broker refuses it (only the allocators' principal
    may write there; here the stack's ``dagfold``); on ``commands`` the scheduler dead-letters it with
    the reason. The job it named ends as its worker says, untouched."""
    cfg = Config(log_url=broker.user_url(SERVICE, SERVICE_PW), data_dir=tmp_path / "data", partitions=2,
                 dispatch_partitions=2)
    spec = to_job_spec(parse_spec({"id": "sec-g1", "tenant": "mallory", "tasks": [
        {"id": "t", "handler": "sleep", "args": {"seconds": 3}}]}))
    with Stack(cfg, StackOptions(workers=1, api=False)) as stack:
        stack.sender.send(submit_job(spec, source="test"))
        forged = codec.make("dagfold.command.TaskAllocation", job_id="sec-g1", task_id="t", attempt=1, pool="gpu",
                            ts_ms=int(time.time() * 1000), status="granted", alloc_id="gpu:666", epoch=666,
                            hosts=[{"node_id": "victims-host", "gpu_indices": [0, 1], "gpu_milli": 1000}],
                            reason="", checkpoint_uri="file:///artifacts/acme/victim/train/checkpoints/c.pt",
                            cause_offset=0)
        errors: dict[str, KafkaError | None] = {}
        upstream = Producer({**broker.client_config(UPSTREAM, UPSTREAM_PW), "message.timeout.ms": 10000,
                             "log_level": 0})
        for topic in ("scheduler.internal", "commands"):
            upstream.produce(topic, default_codec().encode(forged), b"sec-g1",
                             on_delivery=lambda err, msg, topic=topic: errors.__setitem__(topic, err))
            upstream.flush(15)
        assert errors["scheduler.internal"] is not None
        assert errors["scheduler.internal"].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, errors
        assert errors["commands"] is None  # upstream may submit: the broker takes the record ...

        dead = Consumer({**broker.client_config(), "group.id": "sec-test-deadletters", "auto.offset.reset": "earliest",
                         "log_level": 0})
        dead.assign([TopicPartition("deadletter", 0, 0)])
        letters: list[dict] = []
        deadline = time.monotonic() + 60
        while not letters and time.monotonic() < deadline:
            m = dead.poll(0.5)
            if m is not None and m.error() is None:
                letters.append(default_codec().decode(m.value()))
        dead.close()
        assert letters, "no dead letter"  # ... and the scheduler refuses it, saying why
        assert letters[0]["source_topic"] == "commands" and letters[0]["service"] == "scheduler"
        assert "TaskAllocation is taken only from scheduler.internal" in letters[0]["reason"]

        job = stack.wait_job("sec-g1", 60)
        assert job is not None and job["state"] == "succeeded", job
        assert "gpu:666" not in str(stack.read_model.get_attempts("sec-g1", "t"))
