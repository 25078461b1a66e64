#!/usr/bin/env python3
"""Submit a dagfold job from an upstream system with no dagfold code.

Needs only confluent-kafka, fastavro and the published schemas/ folder:

    python examples/upstream_producer.py --bootstrap 127.0.0.1:9092 [--schemas schemas] [--job-id ID]
        [--topic prod.dagfold.commands]   # a deployment with DAGFOLD_TOPIC_PREFIX=prod.dagfold
        [--traceparent 00-<trace id>-<span id>-01]   # the job's trace continues the producer's

It builds a ``dagfold.command.SubmitJob`` record, encodes it with Avro
single-object encoding (``C3 01`` + CRC-64-AVRO fingerprint of the schema +
Avro body) and produces it to the ``commands`` topic keyed by the job ID with
``partitioner=murmur2_random`` (the Java client's default, and dagfold's), so it
lands on the job's partition. (With librdkafka's own default, ``consistent_random``,
the record may land elsewhere; the scheduler then forwards it to the job's
partition, which costs one more write.) A W3C ``traceparent`` goes in a record
header of that name (the SubmitJob's own field, left empty here, would do as well).
It prints the job ID; follow the job with ``dagfold status ID``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import uuid
from pathlib import Path

import fastavro
from confluent_kafka import Producer
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form


def encode_single_object(schema_path: Path, record: dict) -> bytes:
    schema = load_schema(str(schema_path))
    fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))
    buf = io.BytesIO()
    buf.write(b"\xc3\x01" + fp)
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def build_submission(job_id: str) -> dict:
    def task(task_id: str, cmd: str, depends_on: list[str]) -> dict:
        return {"task_id": task_id, "handler": "shell", "args_json": json.dumps({"cmd": cmd}),
                "depends_on": depends_on, "queue": "default", "trigger_rule": "all_success",
                "retry": None, "timeouts": None, "resources": None}

    spec = {
        "job_id": job_id, "tenant": "default", "tier": "standard", "idempotency_key": None,
        "failure_policy": "skip_downstream", "retry": None, "timeouts": None,
        "labels": {"source": "upstream_producer"}, "callback_url": None,
        "tasks": [task("fetch", "echo fetched", []), task("report", "echo reported", ["fetch"])],
    }
    return {"spec": spec, "submitted_at_ms": int(time.time() * 1000), "source": "upstream-example"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default="127.0.0.1:9092")
    ap.add_argument("--schemas", type=Path, default=Path(__file__).resolve().parent.parent / "schemas")
    ap.add_argument("--topic", default="commands")
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--traceparent", default=None, help="W3C trace context, sent as the record's header")
    args = ap.parse_args()
    job_id = args.job_id or f"upstream-{uuid.uuid4()}"
    value = encode_single_object(args.schemas / "dagfold.command.SubmitJob.avsc", build_submission(job_id))
    producer = Producer({"bootstrap.servers": args.bootstrap, "enable.idempotence": True, "acks": "all",
                         "partitioner": "murmur2_random"})
    errors: list[str] = []
    headers = [("traceparent", args.traceparent.encode())] if args.traceparent else None
    producer.produce(args.topic, key=job_id.encode(), value=value, headers=headers,
                     on_delivery=lambda err, msg: errors.append(str(err)) if err else None)
    if producer.flush(30) != 0 or errors:
        print(f"delivery failed: {errors or 'timeout'}", file=sys.stderr)
        return 1
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
