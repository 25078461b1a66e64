"""Key encoding shared by the read models, and the cursor of paginated listings.

Every read model owns a key space: a short prefix, then ``\\x00``-separated
parts. String parts are escaped so they never contain ``\\x00``, which keeps
each prefix unambiguous (a job ID that is a prefix of another one never
matches its listing). Numbers that must sort are fixed-width: times as 16
decimal digits, attempts and partitions as big-endian integers.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dagfold.projections.exceptions import InvalidCursor

Record = dict[str, Any]

SEP = b"\x00"
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
MAX_LIMIT = 1000


def part(s: str) -> bytes:
    """A string key part, escaped so it never contains the separator."""
    b = s.encode()
    if b"\x00" in b or b"\x01" in b:
        b = b.replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01")
    return b


def unpart(b: bytes) -> str:
    if b"\x01" in b:
        b = b.replace(b"\x01\x01", b"\x00").replace(b"\x01\x02", b"\x01")
    return b.decode()


def job_key(job_id: str) -> bytes:
    """A job's summary (the jobs read model; the operator model reads it too)."""
    return b"j" + SEP + part(job_id)


def tasks_prefix(job_id: str) -> bytes:
    return b"t" + SEP + part(job_id) + SEP


def task_key(job_id: str, task_id: str) -> bytes:
    return tasks_prefix(job_id) + part(task_id)


def ms(t: int) -> bytes:
    """A time in ms as a sortable key part (negative times clamp to 0)."""
    return b"%016d" % max(int(t), 0)


def key(space: bytes, *parts: bytes) -> bytes:
    """``space \\0 p1 \\0 p2 ...`` (parts already encoded)."""
    return SEP.join((space, *parts))


def split(k: bytes) -> list[bytes]:
    return k.split(SEP)


@dataclass(frozen=True)
class Page:
    """One page of a listing; ``next_cursor`` is None on the last page."""

    items: list[Record] = field(default_factory=list)
    next_cursor: str | None = None


def encode_cursor(k: bytes) -> str:
    return base64.urlsafe_b64encode(k).decode().rstrip("=")


def decode_cursor(cursor: str, prefix: bytes) -> bytes:
    try:
        k = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    except (binascii.Error, ValueError):
        raise InvalidCursor("cursor is not valid") from None
    if not k.startswith(prefix):
        raise InvalidCursor("cursor belongs to another listing")
    return k


def clamp_limit(limit: int) -> int:
    return max(1, min(int(limit), MAX_LIMIT))


def paginate(rows: Iterator[tuple[bytes, Record | None]], limit: int) -> Page:
    """The first ``limit`` items (None rows are filtered out); the cursor only if more follow."""
    items: list[Record] = []
    last = b""
    for k, item in rows:
        if item is None:
            continue
        if len(items) == limit:
            return Page(items, encode_cursor(last))
        items.append(item)
        last = k
    return Page(items, None)


def public(rec: Record) -> Record:
    """A record without its private bookkeeping fields (names starting with ``_``)."""
    return {k: v for k, v in rec.items() if not k.startswith("_")}
