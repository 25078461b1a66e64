"""Pick a log backend from a URL."""

from __future__ import annotations

from pathlib import Path

from dagfold.exceptions import LogError
from dagfold.log.base import Log


def open_log(url: str, data_dir: Path, read_only: bool = False) -> Log:
    """``embedded`` (default) or ``kafka://host:port[,host:port...]``.

    ``read_only`` matters for the embedded log only: audits read a snapshot of a
    log that a running stack holds open.
    """
    if url in ("", "embedded") or url.startswith("embedded:"):
        from dagfold.log.embedded import EmbeddedLog

        return EmbeddedLog(data_dir / "log", read_only=read_only)
    if url.startswith("kafka://"):
        from dagfold.log.kafka import KafkaLog

        return KafkaLog(url.removeprefix("kafka://"))
    raise LogError(f"unknown log URL {url!r}: use 'embedded' or 'kafka://HOST:PORT'")
