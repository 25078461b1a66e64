"""Pick a log backend from a URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from dagfold.exceptions import LogError
from dagfold.log.base import Log


def kafka_client_settings(query: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Consumer and producer settings from a ``kafka://`` URL's query string.

    ``consumer.session.timeout.ms=6000&producer.transaction.timeout.ms=10000`` gives
    ``({"session.timeout.ms": "6000"}, {"transaction.timeout.ms": "10000"})``: librdkafka
    settings for every consumer and producer the log creates (values as strings, as
    librdkafka takes them). Any other key is an error, so a typo cannot go unnoticed.
    """
    consumer: dict[str, Any] = {}
    producer: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key.startswith("consumer."):
            consumer[key.removeprefix("consumer.")] = value
        elif key.startswith("producer."):
            producer[key.removeprefix("producer.")] = value
        else:
            raise LogError(f"unknown Kafka URL setting {key!r}: use consumer.<librdkafka key> or "
                           "producer.<librdkafka key>")
    return consumer, producer


def open_log(url: str, data_dir: Path, read_only: bool = False) -> Log:
    """``embedded`` (default) or ``kafka://host:port[,host:port...][?setting=value&...]``.

    ``read_only`` matters for the embedded log only: audits read a snapshot of a
    log that a running stack holds open. A Kafka URL may carry client settings
    (see ``kafka_client_settings``), e.g. shorter session timeouts so that a dead
    process's partitions move sooner.
    """
    if url in ("", "embedded") or url.startswith("embedded:"):
        from dagfold.log.embedded import EmbeddedLog

        return EmbeddedLog(data_dir / "log", read_only=read_only)
    if url.startswith("kafka://"):
        from dagfold.log.kafka import KafkaLog

        bootstrap, _, query = url.removeprefix("kafka://").partition("?")
        try:
            consumer, producer = kafka_client_settings(query)
        except ValueError as exc:
            raise LogError(f"bad Kafka URL settings {query!r}: {exc}") from None
        return KafkaLog(bootstrap, consumer_config=consumer, producer_config=producer)
    raise LogError(f"unknown log URL {url!r}: use 'embedded' or 'kafka://HOST:PORT'")
