"""Pick a log backend from a URL."""

from __future__ import annotations

from pathlib import Path

from dagfold.exceptions import LogError
from dagfold.log.base import Log


def open_log(url: str, data_dir: Path) -> Log:
    """``embedded`` (default) or ``kafka://host:port[,host:port...]``."""
    if url in ("", "embedded") or url.startswith("embedded:"):
        from dagfold.log.embedded import EmbeddedLog

        return EmbeddedLog(data_dir / "log")
    if url.startswith("kafka://"):
        from dagfold.log.kafka import KafkaLog

        return KafkaLog(url.removeprefix("kafka://"))
    raise LogError(f"unknown log URL {url!r}: use 'embedded' or 'kafka://HOST:PORT'")
