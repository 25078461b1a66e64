"""The Kafka transactional producer's error handling, against a scripted client (no broker).

librdkafka leaves an abort that failed (e.g. timed out flushing while a broker was
down) in progress until ``abort_transaction`` is called again; every
``begin_transaction`` meanwhile fails with _CONFLICT. A chaos run caught a scheduler
looping on that for minutes while it held its partitions.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from dagfold.exceptions import CommitUnknownError, LogError, TransactionAbortedError
from dagfold.log import kafka as kafka_mod
from dagfold.log.kafka import KafkaTransactionalProducer


class ScriptedProducer:
    """Just enough of confluent_kafka.Producer: the first abort times out, as with a broker down."""

    def __init__(self) -> None:
        self.aborts_to_fail = 1
        self.abort_in_progress = False
        self.calls: list[str] = []

    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")
        if self.abort_in_progress:
            raise KafkaException(KafkaError(KafkaError._CONFLICT, "Conflicting abort_transaction API call is "
                                            "already in progress", retriable=True))

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("produce")

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "commit timed out", txn_requires_abort=True))

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")
        self.abort_in_progress = True
        if self.aborts_to_fail:
            self.aborts_to_fail -= 1
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to flush all outstanding messages",
                                            retriable=True))
        self.abort_in_progress = False


class OnePartition:
    def _resolve_partition(self, topic: str, key: bytes, partition: int | None) -> int:
        return 0


def test_a_failed_abort_is_completed_before_the_next_transaction_begins() -> None:
    client = ScriptedProducer()
    p = KafkaTransactionalProducer(OnePartition(), client)  # type: ignore[arg-type]
    p.begin()
    p.send("events", b"k", b"v")
    with pytest.raises(LogError, match="aborted"):
        p.commit({})  # the commit fails, and so does the abort after it
    assert client.abort_in_progress

    p.begin()  # completes the pending abort, then begins
    assert not client.abort_in_progress
    assert client.calls == ["init", "begin", "produce", "commit", "abort", "abort", "begin"]


class CommitFaults(ScriptedProducer):
    """commit_transaction: ``mode`` "timeout" keeps timing out (retriable, outcome unknown);
    "no-reports" commits but never serves the records' delivery reports."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        if self.mode == "timeout":
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True))

    def poll(self, timeout: float) -> int:
        return 0


def test_a_commit_that_keeps_timing_out_reports_an_unknown_outcome() -> None:
    client = CommitFaults("timeout")
    p = KafkaTransactionalProducer(OnePartition(), client)  # type: ignore[arg-type]
    p.begin()
    p.send("events", b"k", b"v")
    with pytest.raises(CommitUnknownError) as info:
        p.commit({})
    assert info.value.committed is None
    assert "abort" not in client.calls  # an abort would be a guess: the broker may have committed it


def test_a_commit_without_delivery_reports_says_it_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_mod, "_TIMEOUT_S", 0.05)
    client = CommitFaults("no-reports")
    p = KafkaTransactionalProducer(OnePartition(), client)  # type: ignore[arg-type]
    p.begin()
    p.send("events", b"k", b"v")
    with pytest.raises(CommitUnknownError, match="committed but 1 delivery report") as info:
        p.commit({})
    assert info.value.committed is True


def test_an_abortable_commit_error_says_nothing_committed() -> None:
    client = ScriptedProducer()
    client.aborts_to_fail = 0
    p = KafkaTransactionalProducer(OnePartition(), client)  # type: ignore[arg-type]
    p.begin()
    with pytest.raises(TransactionAbortedError):
        p.commit({})


class BrokerRestartDuringCommit(ScriptedProducer):
    """commit_transaction meets a broker that went away: the coordinator is unreachable for
    ``failures`` calls (retriable), then answers again."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        if self.failures:
            self.failures -= 1
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker: disconnected", retriable=True))

    def poll(self, timeout: float) -> int:
        return 0


def test_a_broker_restart_during_commit_is_retried_through() -> None:
    client = BrokerRestartDuringCommit(failures=2)
    p = KafkaTransactionalProducer(OnePartition(), client)  # type: ignore[arg-type]
    p.begin()
    assert p.commit({}) == {}
    assert client.calls.count("commit") == 3


def test_a_broker_down_past_the_retries_of_a_commit_is_an_unknown_outcome() -> None:
    """Not "aborted": the broker may have written the commit before it went down."""
    client = BrokerRestartDuringCommit(failures=10)
    p = KafkaTransactionalProducer(OnePartition(), client)  # type: ignore[arg-type]
    p.begin()
    with pytest.raises(CommitUnknownError):
        p.commit({})
    assert "abort" not in client.calls


def test_a_transaction_begun_during_the_last_ones_markers_is_retried_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """CONCURRENT_TRANSACTIONS (the previous commit's markers still being written) is retried after
    retry.backoff.ms: librdkafka's default 100 ms held a tenth of a chain's hops ~100 ms (chain-1k on Kafka
    26 -> about 80 tasks/s with 10 ms; docs/benchmarks.md). The transactional producers get 10 ms, the
    idempotent ones keep the default, and a URL's producer.retry.backoff.ms still wins."""
    confs: list[dict[str, Any]] = []

    class Capture:
        def __init__(self, conf: dict[str, Any]) -> None:
            confs.append(conf)

        def init_transactions(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(kafka_mod, "_CkProducer", Capture)
    kafka_mod.KafkaLog("127.0.0.1:1").transactional_producer("dagfold-scheduler-0")
    kafka_mod.KafkaLog("127.0.0.1:1").producer("worker")
    kafka_mod.KafkaLog("127.0.0.1:1", producer_config={"retry.backoff.ms": 50}).transactional_producer("x")
    assert confs[0]["retry.backoff.ms"] == kafka_mod.TXN_RETRY_BACKOFF_MS == 10
    assert "retry.backoff.ms" not in confs[1]
    assert confs[2]["retry.backoff.ms"] == 50
