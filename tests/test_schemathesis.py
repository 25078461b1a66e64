"""API fuzzing: schemathesis generates requests from the OpenAPI spec against the app in process.

Every operation gets a bounded number of examples (``DAGFOLD_FUZZ_EXAMPLES``, default 25); the check is
that nothing answers 5xx or crashes, whatever the input. The read model holds finished jobs (a stream of a
running job would never end) and allocator data, so the cluster and job routes see real records too.

The app is built at import (schemathesis parametrizes from its OpenAPI document at collection), in a
temporary folder removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from dagfold.services.api.admission import AdmissionConfig
from dagfold.services.api.guard import GuardConfig
from tests.api_support import T0, ApiHarness, accepted, ev

EXAMPLES = int(os.environ.get("DAGFOLD_FUZZ_EXAMPLES", "25"))


def _seeded_api(admission: AdmissionConfig | None = None) -> ApiHarness:
    tmp = Path(tempfile.mkdtemp(prefix="dagfold-fuzz-"))
    # schemathesis's in-process client sends Host: testserver; the guard accepts that one name besides loopback
    api = ApiHarness(tmp, guard=GuardConfig(allowed_hosts=frozenset({"testserver"})), admission=admission)

    def cleanup() -> None:
        api.close()
        shutil.rmtree(tmp, ignore_errors=True)

    atexit.register(cleanup)
    api.project(
        accepted("job-1", ["a", "b"], deps={"b": ["a"]}),
        ev("TaskDispatched", job_id="job-1", task_id="a", attempt=1, ts_ms=T0 + 1, queue="default"),
        ev("LeaseGranted", job_id="job-1", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 2,
           lease_deadline_ms=T0 + 30_000),
        ev("TaskFailed", job_id="job-1", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 3, reason="exit code 1",
           exit_code=1, final=True),
        ev("TaskSkipped", job_id="job-1", task_id="b", ts_ms=T0 + 3, reason="upstream a failed"),
        ev("JobFailed", job_id="job-1", ts_ms=T0 + 3, reason="a failed"),
        ev("JobRejected", job_id="job-2", ts_ms=T0 + 4, tenant="default", code="cycle", reason="a -> a"),
    )
    api.allocator({"type": "dagfold.allocator.NodeRegistered", "node_id": "h1", "gpus": 8, "health": "healthy"})
    return api


schema = schemathesis.openapi.from_asgi("/openapi.json", _seeded_api().app)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_never_fails_with_5xx(case: schemathesis.Case) -> None:
    if case.path in ("/v1/jobs/{job_id}/events", "/v1/gpu-jobs/{job_id}/events"):
        case.query = {**(case.query or {}), "timeout_s": 0.5}  # a stream of a live job is bounded here
    case.call_and_validate(checks=[not_a_server_error])


# -- stateful: follow the links of the OpenAPI document (submit -> read, history, cancel, redrive, ...) ------
STATEFUL_EXAMPLES = int(os.environ.get("DAGFOLD_FUZZ_STATEFUL_EXAMPLES", "10"))
EVENT_STREAMS = ("/v1/jobs/{job_id}/events", "/v1/gpu-jobs/{job_id}/events")


# Hypothesis replays a scenario and needs the same answers each time: nothing here depends on time (no rate
# limit) or on what an earlier scenario left behind (no scheduler accepts the submitted jobs, so a repeated
# submission is never a 200). The seeded jobs are still reached through the list's links: their reads,
# cancels and redrives answer from real records.
_stateful_schema = schemathesis.openapi.from_asgi(
    "/openapi.json", _seeded_api(AdmissionConfig(rate_per_s=1e9, burst=10**9, max_open_jobs=10**9)).app)


class ApiWorkflow(_stateful_schema.as_state_machine()):  # type: ignore[misc]
    """Scenarios of linked calls (submit -> read, tasks, history, cancel, redrive; list -> each job).
    Checked: never a 5xx."""

    def before_call(self, case: schemathesis.Case) -> None:
        if case.path in EVENT_STREAMS:
            case.query = {**(case.query or {}), "timeout_s": 0.5}

    def validate_response(self, response: Any, case: schemathesis.Case, additional_checks: Any = None,
                          **kwargs: Any) -> None:
        case.validate_response(response, checks=[not_a_server_error])


TestApiWorkflow = ApiWorkflow.TestCase
TestApiWorkflow.settings = settings(max_examples=STATEFUL_EXAMPLES, stateful_step_count=8, deadline=None,
                                    derandomize=True, database=None, suppress_health_check=list(HealthCheck))
