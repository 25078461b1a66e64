"""A typed builder for job specs: what upstream Python code writes instead of YAML.

The builder produces the same spec the API and the CLI take (``dagfold.jobspec.JobSpecIn``,
pydantic-checked, field paths in errors) and reuses its types for policies (``Retry``,
``Timeouts``, ``Resources``), so there is one definition of a spec, not a mirror of it.

The job ID is fixed when the builder is made: from ``id``, else derived from (tenant,
idempotency key) as the API does, else a fresh UUID. So a ``submit`` retried after a
timeout sends the same job again, and dagfold answers with the first one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dagfold.config import Limits
from dagfold.jobspec import (
    FailurePolicy,
    JobSpecIn,
    ResourcesIn,
    RetryPolicyIn,
    TimeoutsIn,
    TriggerRule,
    job_id_for,
    parse_spec,
    to_job_spec,
)

Retry = RetryPolicyIn
Timeouts = TimeoutsIn
Resources = ResourcesIn


@dataclass(frozen=True)
class Task:
    """One task of a job; ``Job.task`` makes them."""

    id: str
    handler: str = "noop"
    args: Mapping[str, Any] = field(default_factory=dict)
    depends_on: tuple[str, ...] = ()
    queue: str = "default"
    trigger_rule: TriggerRule = "all_success"
    retry: Retry | None = None
    timeouts: Timeouts | None = None
    resources: Resources | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "handler": self.handler, "args": dict(self.args),
                             "depends_on": list(self.depends_on), "queue": self.queue,
                             "trigger_rule": self.trigger_rule}
        for name in ("retry", "timeouts", "resources"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v.model_dump()
        return d


class Job:
    """A job spec under construction.

    >>> job = Job(tenant="acme", idempotency_key="etl-2026-12-01")
    >>> extract = job.task("extract", "shell", args={"cmd": "echo extract"})
    >>> job.task("load", "shell", args={"cmd": "echo load"}, after=[extract]).id
    'load'
    """

    def __init__(
        self,
        id: str | None = None,
        *,
        tenant: str = "default",
        tier: str = "standard",
        idempotency_key: str | None = None,
        failure_policy: FailurePolicy = "skip_downstream",
        retry: Retry | None = None,
        timeouts: Timeouts | None = None,
        labels: Mapping[str, str] | None = None,
        callback_url: str | None = None,
    ) -> None:
        self.id = id or job_id_for(tenant, idempotency_key)  # fixed now: retries resend the same job
        self.tenant = tenant
        self.tier = tier
        self.idempotency_key = idempotency_key
        self.failure_policy = failure_policy
        self.retry = retry
        self.timeouts = timeouts
        self.labels = dict(labels or {})
        self.callback_url = callback_url
        self.tasks: list[Task] = []

    def task(
        self,
        id: str,
        handler: str = "noop",
        *,
        args: Mapping[str, Any] | None = None,
        after: Iterable[Task | str] = (),
        queue: str = "default",
        trigger_rule: TriggerRule = "all_success",
        retry: Retry | None = None,
        timeouts: Timeouts | None = None,
        resources: Resources | None = None,
    ) -> Task:
        """Add a task that runs after the tasks in ``after`` (tasks or their IDs); returns it."""
        t = Task(id, handler, dict(args or {}), tuple(a.id if isinstance(a, Task) else a for a in after),
                 queue, trigger_rule, retry, timeouts, resources)
        self.tasks.append(t)
        return t

    def to_dict(self) -> dict[str, Any]:
        """The spec as the API's JSON body (and a YAML file) has it."""
        d: dict[str, Any] = {"id": self.id, "tenant": self.tenant, "tier": self.tier,
                             "failure_policy": self.failure_policy, "labels": dict(self.labels),
                             "tasks": [t.to_dict() for t in self.tasks]}
        if self.idempotency_key is not None:
            d["idempotency_key"] = self.idempotency_key
        if self.callback_url is not None:
            d["callback_url"] = self.callback_url
        for name in ("retry", "timeouts"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v.model_dump()
        return d

    def checked(self) -> JobSpecIn:
        """The spec checked for shape and types (SpecError names the field)."""
        return parse_spec(self.to_dict())

    def to_record(self, limits: Limits | None = None) -> dict[str, Any]:
        """The Avro ``dagfold.common.JobSpec`` that travels in a SubmitJob; with ``limits`` also checked by
        the scheduler's rules (``SpecRejected`` says what its JobRejected would)."""
        return to_job_spec(self.checked(), limits)
