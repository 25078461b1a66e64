#!/usr/bin/env python3
"""Submit a job with dagfold's Python SDK and wait for it (docs/client.md).

    python examples/client_sdk.py --api http://127.0.0.1:8080 [--api-key KEY]
    python examples/client_sdk.py --kafka kafka://127.0.0.1:9092[?prefix=prod.dagfold]

Builds a three-task job (extract, then transform and report in parallel), submits it with an
idempotency key (run it twice on one day: the second run finds the first job), waits, and
prints the job ID and its final state. Exit status 0 when the job succeeded.
"""

from __future__ import annotations

import argparse
import datetime
import sys

from dagfold.client import Client, Job, KafkaClient, RestClient, Retry, Timeouts


def build(day: str) -> Job:
    job = Job(tenant="default", idempotency_key=f"example-report-{day}", labels={"source": "client_sdk"},
              retry=Retry(max_attempts=3, initial_interval_s=0.5), timeouts=Timeouts(start_to_close_s=60))
    extract = job.task("extract", "shell", args={"cmd": f"echo extracting {day}"})
    job.task("transform", "shell", args={"cmd": "echo transforming"}, after=[extract])
    job.task("report", "noop", after=[extract])
    return job


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--api", help="REST API base URL")
    where.add_argument("--kafka", help="kafka:// log URL: submit straight to the commands topic")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--day", default=datetime.date.today().isoformat())
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    client: Client = RestClient(args.api, args.api_key) if args.api else KafkaClient(args.kafka)
    try:
        job = build(args.day)
        sub = client.submit(job)
        status = client.wait(sub.job_id, timeout_s=args.timeout)
    finally:
        client.close()
    print(sub.job_id, status.state)
    return 0 if status.state == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
