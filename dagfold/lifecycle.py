"""Job and task states that every layer agrees on: the fold decides by them, the read model
and the API report them, the CLI waits for them. One definition, here.
"""

from __future__ import annotations

TASK_TERMINAL = frozenset({"succeeded", "failed", "skipped", "cancelled"})
"""A task in one of these states runs no more (until its job is redriven)."""

JOB_TERMINAL = frozenset({"succeeded", "succeeded_partial", "failed", "cancelled"})
"""An accepted job in one of these states has nothing left to run."""

JOB_FINAL = JOB_TERMINAL | {"rejected"}
"""What the read model can report as over: a terminal job, or a submission rejected at admission."""

REDRIVABLE = frozenset({"failed", "succeeded_partial", "cancelled"})
"""Jobs a RedriveJob reopens: their failed, skipped and cancelled tasks run again."""

TASK_ACTIONS = ("retry", "mark_succeeded")
"""An operator's decisions on one task (RetryTask, MarkTaskSucceeded); docs/semantics.md#retry-a-task."""

TASK_ACTION_JOB_STATES = frozenset({"running", "failed", "succeeded_partial"})
"""Jobs whose tasks an operator may retry or mark succeeded (a succeeded job has nothing to act on; a cancelled
one was stopped on purpose: redrive runs it again)."""

TASK_ACTION_TASK_STATES = frozenset({"failed", "skipped", "cancelled"})
"""Tasks an operator may retry or mark succeeded: those that ended without succeeding."""


def task_action_refusal(action: str, job_id: str, job_state: str | None, task_id: str,
                        task_state: str | None, attempt: int = 0) -> tuple[str, str] | None:
    """Why ``action`` on the task cannot be done, as ``(code, reason)``; None if it can.

    The one table of rules: the API answers 409 with it before sending the command, the scheduler
    emits TaskActionRejected with it when the command (from any producer) is folded.
    """
    verb = "retried" if action == "retry" else "marked succeeded"
    if job_state is None or job_state == "rejected":
        return "unknown_job", f"job {job_id!r} does not exist"
    if task_state is None:
        return "unknown_task", f"job {job_id!r} has no task {task_id!r}"
    if job_state not in TASK_ACTION_JOB_STATES:
        if job_state == "cancelled":
            return "job_cancelled", (f"job {job_id!r} was cancelled; its tasks cannot be {verb} "
                                     f"(`dagfold redrive {job_id}` runs its unfinished tasks again)")
        return "job_succeeded", f"job {job_id!r} already {job_state}; no task of it can be {verb}"
    if task_state in TASK_ACTION_TASK_STATES:
        return None
    if task_state == "succeeded":
        return "task_succeeded", f"task {task_id!r} already succeeded"
    doing = {"pending": "has not run yet (it waits for its upstream tasks)",
             "runnable": f"is queued to run (attempt {attempt})",
             "running": f"is running (attempt {attempt})",
             "retrying": f"is waiting to retry (attempt {attempt} failed; its retry policy runs it again)"}
    return "task_not_finished", (f"task {task_id!r} {doing.get(task_state, f'is {task_state}')}; only a failed, "
                                 f"skipped or cancelled task can be {verb}")
