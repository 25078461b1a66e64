"""The job contract: the spec language every entry point speaks, in one place.

A job is written as YAML or JSON (the CLI, ``POST /v1/jobs``), as a GPU request (``POST /v1/gpu-jobs``),
or with the SDK's builder (``dagfold.client.Job``); each becomes one ``JobSpecIn`` (``model``: shape and
types, pydantic) and then one Avro ``dagfold.common.JobSpec`` record (``to_job_spec``), which
``validate_job_spec`` checks by the scheduler's rules (graph, limits, built-in handlers' arguments:
``args``). The scheduler's fold runs the same validation on every SubmitJob, whoever produced it, and
decides with the same trigger rules (``triggers``) and hash (``record.spec_hash``) as the API.

Plumbing: it imports no service, so the API, the SDK and the CLI use it without importing the scheduler.
"""

from dagfold.jobspec.args import check_builtin_args
from dagfold.jobspec.model import (
    GpuType,
    IdempotencyKey,
    JobId,
    JobSpecIn,
    QueueName,
    ResourcesIn,
    RetryPolicyIn,
    SpecError,
    SpecRejected,
    TaskSpecIn,
    TenantName,
    TimeoutsIn,
    job_id_for,
    load_spec_text,
    parse_spec,
    to_job_spec,
)
from dagfold.jobspec.record import is_gpu, spec_hash
from dagfold.jobspec.triggers import TRIGGER_RULES, TriggerRule, evaluate_rule, still_skipped
from dagfold.jobspec.validation import (
    FAILURE_POLICIES,
    MAX_ATTEMPTS,
    MAX_GPU_TYPES,
    MAX_SECONDS,
    FailurePolicy,
    Rejection,
    find_cycle,
    rejected_graph,
    validate_job_spec,
)

__all__ = [
    "FAILURE_POLICIES",
    "MAX_ATTEMPTS",
    "MAX_GPU_TYPES",
    "MAX_SECONDS",
    "TRIGGER_RULES",
    "FailurePolicy",
    "GpuType",
    "IdempotencyKey",
    "JobId",
    "JobSpecIn",
    "QueueName",
    "Rejection",
    "ResourcesIn",
    "RetryPolicyIn",
    "SpecError",
    "SpecRejected",
    "TaskSpecIn",
    "TenantName",
    "TimeoutsIn",
    "TriggerRule",
    "check_builtin_args",
    "evaluate_rule",
    "find_cycle",
    "is_gpu",
    "job_id_for",
    "load_spec_text",
    "parse_spec",
    "rejected_graph",
    "spec_hash",
    "still_skipped",
    "to_job_spec",
    "validate_job_spec",
]
