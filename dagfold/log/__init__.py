"""Log backends behind one contract: Apache Kafka and an embedded durable log.

``open_log(url, data_dir)`` picks the backend from a URL: ``embedded`` (the
default; a RocksDB-backed log in ``data_dir/log``) or ``kafka://HOST:PORT[,HOST:PORT]``.
"""

from dagfold.log.base import (
    Ack,
    Consumer,
    Log,
    LogRecord,
    Producer,
    QueueConsumer,
    QueuedRecord,
    TopicPartition,
    TopicSpec,
    TransactionalProducer,
    partition_for,
)
from dagfold.log.factory import open_log

__all__ = [
    "Ack",
    "Consumer",
    "Log",
    "LogRecord",
    "Producer",
    "QueueConsumer",
    "QueuedRecord",
    "TopicPartition",
    "TopicSpec",
    "TransactionalProducer",
    "open_log",
    "partition_for",
]
