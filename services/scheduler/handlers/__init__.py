"""The scheduler's command handlers, one per command type, by family; ``HANDLERS`` is their index.

| family | module | commands |
|---|---|---|
| a job's life | ``jobs`` | SubmitJob, CancelJob, RedriveJob, PauseJob, ResumeJob |
| an operator's decision on a task | ``actions`` | RetryTask, MarkTaskSucceeded |
| a worker's report on its attempt | ``reports`` | TaskStarted, TaskHeartbeat, TaskSucceeded, TaskFailed, TaskReleased |
| a due timer | ``timers`` | TimerFired |
| the allocator's word on a GPU attempt | ``gpu`` | TaskAllocation |
| a tenant's settings | ``tenants`` | SetTenantEntitlements |

A handler decides in a ``context.Ctx``; what follows a task's outcome is in ``outcomes``, and every task
let run goes through ``runnable.make_runnable``.
"""

from __future__ import annotations

from collections.abc import Callable

from dagfold.codec import Record
from dagfold.services.scheduler.context import Ctx
from dagfold.services.scheduler.handlers import actions, gpu, jobs, reports, tenants, timers

Handler = Callable[[Ctx, Record], None]

HANDLERS: dict[str, Handler] = {
    "dagfold.command.SubmitJob": jobs.submit_job,
    "dagfold.command.CancelJob": jobs.cancel_job,
    "dagfold.command.RedriveJob": jobs.redrive_job,
    "dagfold.command.PauseJob": jobs.pause_job,
    "dagfold.command.ResumeJob": jobs.resume_job,
    "dagfold.command.RetryTask": actions.retry_task,
    "dagfold.command.MarkTaskSucceeded": actions.mark_task_succeeded,
    "dagfold.command.TaskStarted": reports.task_started,
    "dagfold.command.TaskHeartbeat": reports.task_heartbeat,
    "dagfold.command.TaskSucceeded": reports.task_succeeded,
    "dagfold.command.TaskFailed": reports.task_failed,
    "dagfold.command.TaskReleased": reports.task_released,
    "dagfold.command.TimerFired": timers.timer_fired,
    "dagfold.command.TaskAllocation": gpu.task_allocation,
    "dagfold.command.SetTenantEntitlements": tenants.set_tenant_entitlements,
}
"""Every scheduler command type and its handler."""
