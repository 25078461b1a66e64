"""Pick a log backend from a URL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from dagfold.exceptions import LogError
from dagfold.log.base import DEFAULT_PARTITIONER, PARTITIONERS, Log
from dagfold.log.namespace import namespaced

SECURITY_PREFIXES = ("security.protocol", "sasl.", "ssl.")
"""URL settings for every client of the log (producers, consumers and the admin client): SASL and TLS."""
PASSWORD_ENV = "DAGFOLD_KAFKA_SASL_PASSWORD"


def _is_security(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in SECURITY_PREFIXES)


def kafka_security_settings(query: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The SASL/TLS settings of a ``kafka://`` URL, for every client including the admin client.

    ``security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512&sasl.username=dagfold&ssl.ca.location=ca.pem``
    (librdkafka names). Without ``sasl.password`` in the URL, a ``sasl.username`` takes its password from
    ``DAGFOLD_KAFKA_SASL_PASSWORD``: a URL is visible to every local user in the process list, an
    environment is not (and task processes never inherit it).
    """
    env = dict(os.environ) if env is None else env
    out = {k: v for k, v in parse_qsl(query, keep_blank_values=True) if _is_security(k)}
    if "sasl.username" in out and "sasl.password" not in out and env.get(PASSWORD_ENV):
        out["sasl.password"] = env[PASSWORD_ENV]
    return out


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
        if _is_security(key):
            continue  # every client's: kafka_security_settings
        if key.startswith("consumer."):
            consumer[key.removeprefix("consumer.")] = value
        elif key.startswith("producer."):
            producer[key.removeprefix("producer.")] = value
        else:
            raise LogError(f"unknown Kafka URL setting {key!r}: use prefix=, partitioner=, "
                           "consumer.<librdkafka key>, producer.<librdkafka key>, security.protocol, sasl.* or ssl.*")
    return consumer, producer


# Settings of a log URL that belong to dagfold itself, for either backend.
_DAGFOLD_SETTINGS = ("prefix", "partitioner")


def split_url(url: str) -> tuple[str, str, dict[str, str]]:
    """``(backend URL without query, backend query, dagfold settings)`` of a log URL.

    ``kafka://h:9092?prefix=prod.dagfold&partitioner=consistent_random&consumer.x=1`` gives
    ``("kafka://h:9092", "consumer.x=1", {"prefix": "prod.dagfold", "partitioner": "consistent_random"})``.
    """
    base, _, query = url.partition("?")
    ours: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise LogError(f"bad log URL settings {query!r}: {exc}") from None
    for key, value in pairs:
        if key in _DAGFOLD_SETTINGS:
            ours[key] = value
        else:
            rest.append((key, value))
    return base, urlencode(rest), ours


def url_prefix(url: str) -> str:
    """The topic prefix a log URL names (``?prefix=``), or ``""``."""
    return split_url(url)[2].get("prefix", "")


def open_log(url: str, data_dir: Path, read_only: bool = False, prefix: str = "") -> Log:
    """``embedded`` (default) or ``kafka://host:port[,host:port...][?setting=value&...]``.

    ``read_only`` matters for the embedded log only: audits read a snapshot of a
    log that a running stack holds open. A Kafka URL may carry client settings
    (see ``kafka_client_settings``), e.g. shorter session timeouts so that a dead
    process's partitions move sooner. Either URL may carry ``prefix=`` (the topic
    namespace, see ``dagfold.log.namespace``; ``prefix`` here is
    ``DAGFOLD_TOPIC_PREFIX``, and the two must agree when both are set) and
    ``partitioner=`` (``murmur2_random``, the default, or ``consistent_random`` for
    deployments whose data was written with CRC-32).
    """
    base, query, ours = split_url(url)
    url_pfx = ours.get("prefix", "")
    if url_pfx and prefix and url_pfx != prefix:
        raise LogError(f"topic prefix {url_pfx!r} in the log URL and {prefix!r} (DAGFOLD_TOPIC_PREFIX) differ")
    partitioner = ours.get("partitioner")
    if partitioner is not None and partitioner not in PARTITIONERS:
        raise LogError(f"unknown partitioner {partitioner!r}: use one of {sorted(PARTITIONERS)}")
    lg: Log
    if base in ("", "embedded") or base.startswith("embedded:"):
        from dagfold.log.embedded import EmbeddedLog

        lg = EmbeddedLog(data_dir / "log", read_only=read_only, partitioner=partitioner)
    elif base.startswith("kafka://"):
        from dagfold.log.kafka import KafkaLog

        try:
            consumer, producer = kafka_client_settings(query)
            security = kafka_security_settings(query)
        except ValueError as exc:
            raise LogError(f"bad Kafka URL settings: {exc}") from None  # the query may hold a password
        lg = KafkaLog(base.removeprefix("kafka://"), consumer_config=consumer, producer_config=producer,
                      partitioner=partitioner or DEFAULT_PARTITIONER, client_config=security)
    else:
        raise LogError(f"unknown log URL {url!r}: use 'embedded' or 'kafka://HOST:PORT'")
    return namespaced(lg, url_pfx or prefix)
