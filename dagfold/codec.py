"""Avro codec for every record on every topic.

Encoding is Avro *single-object encoding*: ``C3 01`` + the 8-byte little-endian
CRC-64-AVRO fingerprint of the writer schema's parsing canonical form + the
Avro binary body. The fingerprint makes each record self-describing, so any
consumer holding the ``schemas/`` folder can decode a record, or reject it with
a precise reason, without a registry. Upstream systems can produce records with
nothing but fastavro and the ``.avsc`` files.

Schema version rule: a schema may only evolve compatibly (add fields with
defaults, never rename or remove, never change a type). The previous version's
file is kept under ``schemas/history/`` so readers still know its fingerprint;
consumers are upgraded before producers.

Records in Python are plain dicts; the codec adds the key ``"type"`` holding
the schema's full name (e.g. ``dagfold.event.TaskSucceeded``) on decode, and
reads it on encode. Dicts keep the fold fast and need no mirror classes.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form
from fastavro.validation import validate

from dagfold.exceptions import CodecError

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
Record = dict[str, Any]

# schemas/ at the project's root; an installed wheel carries it as dagfold/schemas (pyproject's package-dir)
SCHEMA_DIR = next((d for d in (Path(__file__).resolve().parent / "schemas",
                               Path(__file__).resolve().parent.parent / "schemas") if d.is_dir()),
                  Path(__file__).resolve().parent.parent / "schemas")


@dataclass(frozen=True)
class RecordSchema:
    """One writer schema known to the codec."""

    name: str
    parsed: Any
    fingerprint: bytes
    field_names: tuple[str, ...]


def schema_fingerprint(parsed: Any) -> bytes:
    """CRC-64-AVRO fingerprint (8 bytes, little-endian) of a parsed schema, per the Avro spec."""
    canonical = to_parsing_canonical_form(parsed)
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


class Codec:
    """Encodes and decodes dagfold records by schema name and fingerprint."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR) -> None:
        self._by_name: dict[str, RecordSchema] = {}
        self._by_fp: dict[bytes, RecordSchema] = {}
        files = sorted(schema_dir.glob("*.avsc")) + sorted(schema_dir.glob("history/*/*.avsc"))
        if not files:
            raise CodecError(f"no Avro schemas found in {schema_dir}")
        for path in files:
            named: dict[str, Any] = {}
            parsed: dict[str, Any] = load_schema(str(path), named_schemas=named)  # type: ignore[assignment]
            name = parsed["name"]
            rs = RecordSchema(name, parsed, schema_fingerprint(parsed),
                              tuple(f["name"] for f in parsed["fields"]))
            self._by_fp[rs.fingerprint] = rs
            if path.parent == schema_dir:  # current version wins for encoding
                self._by_name[name] = rs

    def names(self) -> list[str]:
        """Full names of all current schemas."""
        return sorted(self._by_name)

    def schema(self, name: str) -> RecordSchema:
        try:
            return self._by_name[name]
        except KeyError:
            raise CodecError(f"unknown record type {name!r}") from None

    def encode(self, record: Mapping[str, Any], *, validate_record: bool = False) -> bytes:
        """Encode a dict whose ``"type"`` names its schema.

        ``validate_record`` checks the record against the schema first and
        names the offending field; writers of untrusted input use it.
        """
        name = record.get("type")
        if not isinstance(name, str):
            raise CodecError("record has no 'type' naming its schema")
        rs = self.schema(name)
        if validate_record:
            self._validate(rs, record)
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(rs.fingerprint)
        try:
            fastavro.schemaless_writer(buf, rs.parsed, record)
        except (TypeError, ValueError, KeyError, AttributeError, struct.error) as exc:
            raise CodecError(f"cannot encode {name}: {exc}") from exc
        return buf.getvalue()

    @staticmethod
    def _validate(rs: RecordSchema, record: Mapping[str, Any]) -> None:
        try:
            validate(record, rs.parsed, raise_errors=True)
        except Exception as exc:  # fastavro raises ValidationError with field paths
            raise CodecError(f"invalid {rs.name}: {exc}") from exc

    def decode(self, data: bytes | None) -> Record:
        """Decode one record, or raise CodecError saying exactly why not.

        The body must be exactly one record of the fingerprint's schema: a body that decodes with bytes
        left over (a SubmitJob framed with CancelJob's fingerprint reads as a CancelJob of its first
        field) is refused, so the processors dead-letter it instead of folding the wrong type.
        """
        if data is None:
            raise CodecError("record has no value (tombstone)")
        if data[:1] == b"\x00" and len(data) >= 5:  # what Confluent's AvroSerializer (and Connect) write
            schema_id = int.from_bytes(data[1:5], "big")
            raise CodecError(f"Confluent Schema Registry framing (magic 0, schema ID {schema_id}) is not read: "
                             "produce Avro single-object encoding (bad magic bytes; docs/architecture.md)")
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise CodecError("not an Avro single-object encoded record (bad magic bytes)")
        fp = bytes(data[2:HEADER_LEN])
        writer = self._by_fp.get(fp)
        if writer is None:
            raise CodecError(f"unknown schema fingerprint {fp.hex()}")
        reader = self._by_name.get(writer.name, writer)
        body = io.BytesIO(data[HEADER_LEN:])
        try:
            rec = fastavro.schemaless_reader(body, writer.parsed, reader.parsed if reader is not writer else None)
        except Exception as exc:  # truncated or corrupt body
            raise CodecError(f"corrupt {writer.name} body: {exc}") from exc
        if not isinstance(rec, dict):
            raise CodecError(f"{writer.name} did not decode to a record")
        left = len(data) - HEADER_LEN - body.tell()
        if left:  # Avro's reader stops where the schema ends: bytes left over mean another schema wrote them
            raise CodecError(f"{writer.name} body has {left} bytes after the record: not written with this "
                             "schema (framed with another schema's fingerprint?)")
        rec["type"] = writer.name
        return rec


@cache
def default_codec() -> Codec:
    """The process-wide codec over the repository's ``schemas/`` folder."""
    return Codec()


def make(name: str, **fields: Any) -> Record:
    """Build a record dict of the given schema, filling defaults for missing fields.

    One place to construct records keeps every producer consistent with the schema.
    """
    rs = default_codec().schema(name)
    rec: Record = {"type": name}
    for f in rs.parsed["fields"]:
        fname = f["name"]
        if fname in fields:
            rec[fname] = fields.pop(fname)
        elif "default" in f:
            d = f["default"]
            rec[fname] = list(d) if isinstance(d, list) else dict(d) if isinstance(d, dict) else d
        else:
            raise CodecError(f"{name}: missing required field {fname!r}")
    if fields:
        raise CodecError(f"{name}: unknown fields {sorted(fields)}")
    return rec
