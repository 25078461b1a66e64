"""dagfold's Python SDK for upstream teams: build a job, submit it, follow it.

    from dagfold.client import Job, RestClient, Retry

    job = Job(tenant="acme", idempotency_key="nightly-2026-12-01", labels={"team": "etl"})
    extract = job.task("extract", "shell", args={"cmd": "echo extract"}, retry=Retry(max_attempts=3))
    job.task("load", "shell", args={"cmd": "echo load"}, after=[extract])
    with RestClient("http://127.0.0.1:8080", api_key="...") as client:
        client.submit(job)
        print(client.wait(job.id).state)

``KafkaClient("kafka://host:9092?prefix=prod.dagfold")`` submits straight to the commands
topic instead. docs/client.md has the whole guide; examples/client_sdk.py runs it.

Layering: like ``dagfold.cli``, this package is a top layer: it uses the job contract
(``dagfold.jobspec``) and the lifecycle (``dagfold.lifecycle``) and imports no service
(tests/test_layers.py); nothing in dagfold imports it.
"""

from dagfold.client.clients import (
    Client,
    ClientError,
    JobNotFound,
    JobStatus,
    KafkaClient,
    RestClient,
    Submission,
    WaitTimeout,
)
from dagfold.client.spec import Job, Resources, Retry, Task, Timeouts

__all__ = [
    "Client",
    "ClientError",
    "Job",
    "JobNotFound",
    "JobStatus",
    "KafkaClient",
    "Resources",
    "RestClient",
    "Retry",
    "Submission",
    "Task",
    "Timeouts",
    "WaitTimeout",
]
