"""Reading the dead-letter topic: what was rejected, where from, by whom, why, and what it held.

Every service that cannot take a record (undecodable, misrouted, not its type)
writes a ``dagfold.deadletter.DeadLetter`` to ``deadletter``: the source
topic/partition/offset, the service, the reason, and the raw key and value.
This module reads them back for the API (``/v1/deadletters``), the CLI
(``dagfold deadletters``) and the dashboard.

Cost: a page reads at most ``limit`` records per dead-letter partition,
backwards from the end (or from a cursor), never the whole topic. ``since``
stops the paging at the first page older than it (dead letters are appended
in about time order; a record a few ms out of order at a page edge may be cut).

Records here are hostile by construction (that is why they were dead-lettered):
every string shown is bounded (``PREVIEW_CHARS``), the inner value is decoded
with the same codec as everywhere else or shown as a hex prefix, and nothing is
interpreted beyond that. Escaping for display is the caller's job (JSON in the
API, ``markup=False`` in the CLI, ``textContent``/``esc`` in the dashboard).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dagfold.codec import Record, default_codec
from dagfold.config import DEADLETTER
from dagfold.exceptions import CodecError, LogError
from dagfold.log import Log, LogRecord, TopicPartition
from dagfold.log.reader import read_to_end

PREVIEW_CHARS = 600
REASON_CHARS = 500
KEY_CHARS = 200
MAX_PAGE = 500
READ_IDLE_S = 5.0
_ID = re.compile(r"^(\d{1,4})-(\d{1,18})$")
_CURSOR = re.compile(r"^\d{1,4}:\d{1,18}(,\d{1,4}:\d{1,18}){0,63}$")


class DeadLetterError(ValueError):
    """A bad dead-letter ID or cursor."""


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter as shown: its own coordinates, the source's, the service, reason and a preview."""

    id: str  # "<deadletter partition>-<offset>"
    ts_ms: int
    source_topic: str
    source_partition: int
    source_offset: int
    service: str
    reason: str
    key: str | None
    record_type: str | None  # the inner record's schema name, when it decodes now
    job_id: str | None
    preview: str
    value_bytes: int
    decoded: Record | None  # the inner record, when it decodes (not shown; for resubmission)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "ts_ms": self.ts_ms, "source_topic": self.source_topic,
                "source_partition": self.source_partition, "source_offset": self.source_offset,
                "service": self.service, "reason": self.reason, "key": self.key, "record_type": self.record_type,
                "job_id": self.job_id, "preview": self.preview, "value_bytes": self.value_bytes}


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return _clip(v.hex(), 64)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def parse_id(dl_id: str) -> tuple[int, int]:
    m = _ID.match(dl_id)
    if m is None:
        raise DeadLetterError(f"bad dead-letter ID {dl_id[:40]!r}: expected PARTITION-OFFSET, e.g. 0-17")
    return int(m.group(1)), int(m.group(2))


def entry(rec: LogRecord) -> DeadLetter:
    """Decode one record of the dead-letter topic (itself possibly malformed) into what operators see."""
    codec = default_codec()
    dl_id = f"{rec.partition}-{rec.offset}"
    try:
        dl = codec.decode(rec.value)
        if dl["type"] != "dagfold.deadletter.DeadLetter":
            raise CodecError(f"a {dl['type']} on the dead-letter topic")
    except CodecError as exc:
        return DeadLetter(dl_id, rec.timestamp_ms, "?", -1, -1, "?", _clip(f"unreadable dead letter: {exc}",
                          REASON_CHARS), None, None, None, _clip((rec.value or b"")[:48].hex(), PREVIEW_CHARS),
                          len(rec.value or b""), None)
    value: bytes = dl.get("value") or b""
    key: bytes | None = dl.get("key")
    decoded: Record | None = None
    record_type = job_id = None
    try:
        decoded = codec.decode(value)
        record_type = str(decoded["type"])
        jid = decoded.get("job_id")
        if jid is None and isinstance(decoded.get("spec"), dict):
            jid = decoded["spec"].get("job_id")
        job_id = _clip(str(jid), KEY_CHARS) if jid is not None else None
        preview = _clip(json.dumps(_jsonable(decoded), default=str, ensure_ascii=True), PREVIEW_CHARS)
    except CodecError as exc:
        preview = _clip(f"undecodable ({exc}); first bytes: {value[:48].hex()}", PREVIEW_CHARS)
    return DeadLetter(
        id=dl_id, ts_ms=int(dl.get("ts_ms") or rec.timestamp_ms), source_topic=_clip(str(dl["source_topic"]), 200),
        source_partition=int(dl["partition"]), source_offset=int(dl["offset"]),
        service=_clip(str(dl["service"]), 100), reason=_clip(str(dl["reason"]), REASON_CHARS),
        key=None if key is None else _clip(key.decode("utf-8", errors="replace"), KEY_CHARS),
        record_type=record_type, job_id=job_id, preview=preview, value_bytes=len(value), decoded=decoded)


def _read(log: Log, tp: TopicPartition, start: int, stop: int) -> list[LogRecord]:
    out: list[LogRecord] = []
    for recs in read_to_end(log, tp, start, batch=min(MAX_PAGE, max(stop - start, 1)), max_idle_s=READ_IDLE_S):
        for r in recs:
            if r.offset >= stop:
                return out
            out.append(r)
    return out


def _partitions(log: Log) -> int:
    try:
        return log.partitions(DEADLETTER)
    except LogError:
        return 0  # no dead-letter topic yet: nothing was ever dead-lettered


def list_dead_letters(log: Log, limit: int = 100, cursor: str | None = None,
                      since_ms: int | None = None) -> tuple[list[DeadLetter], str | None]:
    """Dead letters newest first, at most ``limit``; the cursor for the next (older) page, or None."""
    limit = max(1, min(limit, MAX_PAGE))
    n = _partitions(log)
    if n == 0:
        return [], None
    tps = [TopicPartition(DEADLETTER, p) for p in range(n)]
    if cursor:
        if not _CURSOR.match(cursor):
            raise DeadLetterError("bad cursor: give the next_cursor of the previous page")
        before = {int(p): int(o) for p, o in (x.split(":") for x in cursor.split(","))}
    else:
        before = {tp.partition: o for tp, o in log.end_offsets(tps).items()}
    found: list[DeadLetter] = []
    starts: dict[int, int] = {}
    for tp in tps:
        stop = before.get(tp.partition, 0)
        if stop <= 0:
            continue
        start = max(stop - limit, 0)
        starts[tp.partition] = start
        found += [entry(r) for r in _read(log, tp, start, stop)]
    found.sort(key=lambda d: (d.ts_ms, d.id), reverse=True)
    page = found[:limit]
    if since_ms is not None:
        page = [d for d in page if d.ts_ms >= since_ms]
    older = since_ms is None or (bool(found) and min(d.ts_ms for d in found) >= since_ms)
    nexts = _next_positions(found, starts, limit)
    next_cursor = ",".join(f"{p}:{o}" for p, o in sorted(nexts.items())) if older and any(nexts.values()) else None
    return page, next_cursor


def _next_positions(found: Sequence[DeadLetter], starts: dict[int, int], limit: int) -> dict[int, int]:
    """Per partition, the offset the next page reads below: past the newest record read but not shown
    (several partitions' windows together held more than ``limit``), else the start of the window read."""
    unshown: dict[int, int] = {}
    for d in found[limit:]:
        p, o = parse_id(d.id)
        unshown[p] = max(unshown.get(p, -1), o)
    return {p: unshown[p] + 1 if p in unshown else start for p, start in starts.items()}


def get_dead_letter(log: Log, dl_id: str) -> DeadLetter | None:
    """One dead letter by ID, or None if the topic has no such record (any more)."""
    p, off = parse_id(dl_id)
    if p >= _partitions(log):
        return None
    recs = _read(log, TopicPartition(DEADLETTER, p), off, off + 1)
    return entry(recs[0]) if recs and recs[0].offset == off else None
