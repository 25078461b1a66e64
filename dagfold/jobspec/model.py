"""The user-facing job spec (YAML or JSON) and its translation to the Avro ``JobSpec``.

This is the shape people write (the CLI's files, the API's bodies, the SDK's builder);
``to_job_spec`` turns it into the record that travels on the commands topic. Shape and
types are checked here (pydantic, with the field path in the message); graph rules
(cycles, unknown dependencies, limits) are checked by ``validation.validate_job_spec``,
which the scheduler also runs for records produced directly by upstream systems.
``to_job_spec(spec, limits)`` runs both, so every entry point refuses what the
scheduler would, with the scheduler's words.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dagfold import rules
from dagfold.config import Limits
from dagfold.exceptions import DagfoldError
from dagfold.jobspec.triggers import TriggerRule
from dagfold.jobspec.validation import MAX_ATTEMPTS, MAX_SECONDS, FailurePolicy, Rejection, validate_job_spec
from dagfold.parsing import ParseError, load_yaml

_IDEMPOTENCY_NS = uuid.UUID("6f1b4d3e-2f7e-4f7c-9d0a-5b1d8e0c9a11")


class SpecError(DagfoldError):
    """The spec is malformed; the message names the field."""


class SpecRejected(SpecError):
    """A well-formed spec that the scheduler's rules refuse (graph, limits): ``rejection`` says why."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"job rejected ({rejection.code}): {rejection.reason}")
        self.rejection = rejection


def _id(kind: str) -> Any:
    """The constraints of the rule ``kind`` of the identifier table (``dagfold.rules``), for a str field."""
    rule = rules.RULES[kind]
    return Field(min_length=1, max_length=rule.max_len, pattern=rule.pattern)


JobId = Annotated[str, _id("job_id")]
TaskId = Annotated[str, _id("task_id")]
TenantName = Annotated[str, _id("tenant")]
TierName = Annotated[str, _id("tier")]
QueueName = Annotated[str, _id("queue")]
HandlerName = Annotated[str, _id("handler")]
GpuType = Annotated[str, _id("gpu_type")]
IdempotencyKey = Annotated[str, _id("idempotency_key")]
JobName = Annotated[str, _id("job_name")]
LabelKey = Annotated[str, _id("label_key")]
LabelValue = Annotated[str, Field(max_length=rules.MAX_LABEL_VALUE_LEN, pattern=r"^[^\x00-\x1f\x7f-\x9f]*$")]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=rules.MAX_LABELS)]
Url = Annotated[str, Field(min_length=1, max_length=rules.MAX_URL_LEN, pattern=r"^https?://[^\x00-\x20\x7f-\x9f]+$")]


class _Model(BaseModel):
    # strict: a boolean is not a number (max_attempts: true), a string is not a number; floats must be finite
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RetryPolicyIn(_Model):
    max_attempts: int = Field(1, ge=1, le=MAX_ATTEMPTS)
    initial_interval_s: float = Field(1.0, ge=0, le=MAX_SECONDS)
    backoff_coefficient: float = Field(2.0, ge=1.0)
    max_interval_s: float = Field(60.0, ge=0, le=MAX_SECONDS)
    jitter: bool = True
    non_retryable_exit_codes: list[Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]] = Field([], max_length=256)
    non_retryable_errors: list[Annotated[str, Field(max_length=256)]] = Field([], max_length=256)


class TimeoutsIn(_Model):
    schedule_to_start_s: float | None = Field(None, gt=0, le=MAX_SECONDS)
    start_to_close_s: float | None = Field(None, gt=0, le=MAX_SECONDS)
    heartbeat_s: float | None = Field(None, gt=0, le=MAX_SECONDS)


class ResourcesIn(_Model):
    gpus: int = Field(0, ge=0, le=64)
    gpu_type: GpuType | list[GpuType] = Field([], max_length=16)
    hosts: int = Field(1, ge=1, le=1024)
    gpu_milli: int = Field(1000, ge=1, le=1000)
    max_runtime_s: float | None = Field(None, gt=0, le=MAX_SECONDS)
    checkpoint: bool = False


class TaskSpecIn(_Model):
    id: TaskId
    handler: HandlerName = "noop"
    args: dict[str, Any] = {}
    depends_on: list[TaskId] = []
    queue: QueueName = "default"
    trigger_rule: TriggerRule = "all_success"
    retry: RetryPolicyIn | None = None
    timeouts: TimeoutsIn | None = None
    resources: ResourcesIn | None = None


class JobSpecIn(_Model):
    id: JobId | None = None
    name: JobName | None = None  # a human name, shown next to the ID
    tenant: TenantName = "default"
    tier: TierName = "standard"
    idempotency_key: IdempotencyKey | None = None
    failure_policy: FailurePolicy = "skip_downstream"
    retry: RetryPolicyIn | None = None
    timeouts: TimeoutsIn | None = None
    labels: Labels = {}
    callback_url: Url | None = None
    tasks: list[TaskSpecIn] = Field(min_length=1)


def job_id_for(tenant: str, idempotency_key: str | None) -> str:
    """A new job ID: derived from (tenant, key) when a key is given, so retries map to one job."""
    if idempotency_key:
        return str(uuid.uuid5(_IDEMPOTENCY_NS, f"{tenant}\x00{idempotency_key}"))
    return str(uuid.uuid4())


def _resources(r: ResourcesIn | None) -> dict[str, Any] | None:
    if r is None:
        return None
    d = r.model_dump()
    d["gpu_type"] = [d["gpu_type"]] if isinstance(d["gpu_type"], str) else list(d["gpu_type"])
    return d


def _args_json(t: TaskSpecIn) -> str:
    try:  # allow_nan=False: a YAML .nan in args is not JSON; the depth of args was bounded at parsing
        return json.dumps(t.args, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise SpecError(f"task {t.id!r}: args cannot be written as JSON: {exc}") from None


def _task(t: TaskSpecIn) -> dict[str, Any]:
    return {
        "task_id": t.id,
        "handler": t.handler,
        "args_json": _args_json(t),
        "depends_on": list(t.depends_on),
        "queue": t.queue,
        "trigger_rule": t.trigger_rule,
        "retry": t.retry.model_dump() if t.retry else None,
        "timeouts": t.timeouts.model_dump() if t.timeouts else None,
        "resources": _resources(t.resources),
    }


def to_job_spec(spec: JobSpecIn, limits: Limits | None = None) -> dict[str, Any]:
    """The Avro ``dagfold.common.JobSpec`` dict for a parsed spec (job ID assigned if absent).

    With ``limits``, the record is also checked by the scheduler's own rules (``validate_job_spec``):
    ``SpecRejected`` carries the code and reason the scheduler's JobRejected would.
    """
    record = _record(spec)
    if limits is not None:
        rejection = validate_job_spec(record, limits)
        if rejection is not None:
            raise SpecRejected(rejection)
    return record


def _record(spec: JobSpecIn) -> dict[str, Any]:
    return {
        "job_id": spec.id or job_id_for(spec.tenant, spec.idempotency_key),
        "tenant": spec.tenant,
        "tier": spec.tier,
        "idempotency_key": spec.idempotency_key,
        "failure_policy": spec.failure_policy,
        "retry": spec.retry.model_dump() if spec.retry else None,
        "timeouts": spec.timeouts.model_dump() if spec.timeouts else None,
        "labels": dict(spec.labels),
        "callback_url": spec.callback_url,
        "tasks": [_task(t) for t in spec.tasks],
        "name": spec.name,
    }


def parse_spec(data: Any) -> JobSpecIn:
    """Check a decoded YAML/JSON document; raise SpecError naming the first bad fields."""
    if not isinstance(data, dict):
        raise SpecError("job spec must be a mapping with a 'tasks' list")
    try:
        return JobSpecIn.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err["loc"])
            parts.append(f"{loc}: {err['msg']}")
        raise SpecError("invalid job spec: " + "; ".join(parts)) from None


def load_spec_text(text: str | bytes, max_bytes: int | None = None) -> JobSpecIn:
    """Parse a YAML or JSON document (JSON is YAML) into a checked spec, within the bounds of
    ``dagfold.parsing`` (no anchors or aliases, depth 64, size; ``max_bytes`` defaults to its YAML limit)."""
    try:
        data = load_yaml(text, what="job spec", **({} if max_bytes is None else {"max_bytes": max_bytes}))
    except ParseError as exc:
        raise SpecError(str(exc)) from None
    return parse_spec(data)
