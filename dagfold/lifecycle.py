"""The job and task lifecycle that every layer agrees on: the states, what each event does to them, and
the operator's rules. The folds decide and apply by it, the read models and the API report it, the
callback notifier and the SDK follow it, the CLI waits for it, the chaos checks hold the log to it.
One definition, here.

States are ``StrEnum`` members: each *is* its string (equal, same hash, same msgpack and JSON), so stored
records and answers are byte for byte what bare strings gave.

``LIFECYCLE`` maps every event type of ``schemas/`` (``dagfold.event.*``) to its ``Transition``: the state
the event leaves its task(s) and its job in, and the task states it may follow. tests/test_lifecycle_table.py
checks that every event schema is in it and in both folds' applier tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class TaskState(StrEnum):
    """A task's state (design brief §4)."""

    PENDING = "pending"  # waiting on its upstream tasks
    RUNNABLE = "runnable"  # in a dispatch queue (or waiting for GPUs)
    RUNNING = "running"  # leased to one worker (or started on its allocation)
    RETRYING = "retrying"  # an attempt ended; the retry policy's backoff runs
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # its trigger rule said so, on its upstream outcomes
    CANCELLED = "cancelled"


class JobState(StrEnum):
    """A job's state: running while any task can still run, then how it ended; ``rejected`` at admission."""

    RUNNING = "running"
    PAUSED = "paused"  # an operator paused it: its tasks that could run are held (TaskHeld), running ones finish
    SUCCEEDED = "succeeded"
    SUCCEEDED_PARTIAL = "succeeded_partial"  # allow_partial: some tasks did not succeed
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # refused at submission (the read model's; the scheduler keeps nothing of it)


TASK_STATES: tuple[TaskState, ...] = tuple(TaskState)
"""Every task state, in the order the read models list them."""

JOB_STATES: tuple[JobState, ...] = tuple(JobState)
"""Every job state, in the order the read models list them."""

TASK_TERMINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.SKIPPED, TaskState.CANCELLED})
"""A task in one of these states runs no more (until its job is redriven)."""

TASK_OPEN = frozenset(TaskState) - TASK_TERMINAL
"""A task in one of these states can still run."""

REOPENABLE = frozenset({TaskState.FAILED, TaskState.SKIPPED, TaskState.CANCELLED})
"""Tasks that ended without succeeding: what a redrive, an operator's retry or mark succeeded re-opens."""

JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.SUCCEEDED_PARTIAL, JobState.FAILED, JobState.CANCELLED})
"""An accepted job in one of these states has nothing left to run."""

JOB_FINAL = JOB_TERMINAL | {JobState.REJECTED}
"""What the read model can report as over: a terminal job, or a submission rejected at admission."""

JOB_OPEN = frozenset(JobState) - JOB_FINAL
"""An accepted job not over yet: its tasks' reports count, their outcomes propagate, it ends when none can run."""

REDRIVABLE = frozenset({JobState.FAILED, JobState.SUCCEEDED_PARTIAL, JobState.CANCELLED})
"""Jobs a RedriveJob reopens: their failed, skipped and cancelled tasks run again."""


# -- what each event does ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Transition:
    """What an event does to the lifecycle.

    ``task``: the state it leaves its task in (None: unchanged). Its task is the one it names (``task_id``);
    for JobAccepted every task of the job; for JobRedriven and TaskReopened each task it lists
    (``task_ids``) that is in ``from_task`` (the others are left as they are).
    ``job``: the state it leaves its job in (None: unchanged).
    ``from_task``: the task states the event may follow (None: any, or it has no task); the scheduler emits
    nothing else, and the chaos checks flag any other step as an illegal transition. The folds apply what
    the scheduler decided: they guard only against changing a terminal task.
    """

    task: TaskState | None = None
    job: JobState | None = None
    from_task: frozenset[TaskState] | None = None


@dataclass(frozen=True, slots=True)
class ByFlag:
    """A transition chosen by a boolean field of the event (``default`` when a record lacks the field)."""

    field: str
    default: bool
    if_true: Transition
    if_false: Transition


UNCHANGED = Transition()
"""Recorded for the audit (or for other read models): no job or task state changes."""

_T = TaskState
_RUNNING_ATTEMPT = frozenset({_T.RUNNABLE, _T.RUNNING})  # an attempt that holds (or waits for) its resources

LIFECYCLE: Mapping[str, Transition | ByFlag] = {
    "dagfold.event.JobAccepted": Transition(task=_T.PENDING, job=JobState.RUNNING),
    "dagfold.event.JobRejected": Transition(job=JobState.REJECTED),
    "dagfold.event.SubmissionDeduplicated": UNCHANGED,
    "dagfold.event.TenantEntitlementsSet": UNCHANGED,
    "dagfold.event.TaskDispatched": Transition(task=_T.RUNNABLE, from_task=frozenset({_T.PENDING, _T.RETRYING})),
    "dagfold.event.TaskRedispatched": Transition(from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.TaskRedispatchDeferred": Transition(from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.TaskAllocated": Transition(from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.TaskCheckpointing": UNCHANGED,
    "dagfold.event.TaskRequeued": Transition(task=_T.RUNNABLE, from_task=_RUNNING_ATTEMPT),
    "dagfold.event.LeaseGranted": Transition(task=_T.RUNNING, from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.LeaseExtended": Transition(from_task=frozenset({_T.RUNNING})),
    "dagfold.event.LeaseRejected": UNCHANGED,
    "dagfold.event.ReportIgnored": UNCHANGED,
    "dagfold.event.TaskSucceeded": Transition(task=_T.SUCCEEDED, from_task=frozenset({_T.RUNNING})),
    "dagfold.event.TaskFailed": ByFlag("final", True,  # a final failure, or an attempt the retry policy repeats
                                       Transition(task=_T.FAILED, from_task=_RUNNING_ATTEMPT),
                                       Transition(task=_T.RETRYING, from_task=_RUNNING_ATTEMPT)),
    "dagfold.event.LeaseReclaimed": Transition(task=_T.RETRYING, from_task=frozenset({_T.RUNNING})),
    "dagfold.event.TaskRetryScheduled": Transition(task=_T.RETRYING, from_task=frozenset({_T.RETRYING})),
    "dagfold.event.TaskSkipped": Transition(task=_T.SKIPPED, from_task=TASK_OPEN),
    "dagfold.event.TaskCancelled": Transition(task=_T.CANCELLED, from_task=TASK_OPEN),
    "dagfold.event.JobSucceeded": ByFlag("partial", False, Transition(job=JobState.SUCCEEDED_PARTIAL),
                                         Transition(job=JobState.SUCCEEDED)),
    "dagfold.event.JobFailed": Transition(job=JobState.FAILED),
    "dagfold.event.JobCancelled": Transition(job=JobState.CANCELLED),
    "dagfold.event.JobRedriven": Transition(task=_T.PENDING, job=JobState.RUNNING, from_task=REOPENABLE),
    "dagfold.event.TaskReopened": Transition(task=_T.PENDING, job=JobState.RUNNING, from_task=REOPENABLE),
    "dagfold.event.TaskMarkedSucceeded": Transition(task=_T.SUCCEEDED, from_task=frozenset({_T.PENDING})),
    "dagfold.event.TaskActionRejected": UNCHANGED,
    "dagfold.event.JobPaused": Transition(job=JobState.PAUSED),
    "dagfold.event.JobResumed": Transition(job=JobState.RUNNING),
    "dagfold.event.TaskHeld": Transition(from_task=frozenset({_T.PENDING, _T.RETRYING, _T.RUNNABLE})),
    # a finished job's retention ended: its records leave the state and the read models (no state is left)
    "dagfold.event.JobExpired": UNCHANGED,
}
"""Every event type and its ``Transition`` (a TaskMarkedSucceeded follows the TaskReopened that made its
task pending; a TaskRetryScheduled follows the non-final TaskFailed or LeaseReclaimed of its attempt)."""


def branches(step: Transition | ByFlag) -> tuple[Transition, ...]:
    """Every transition an entry of the table can take."""
    return (step.if_true, step.if_false) if isinstance(step, ByFlag) else (step,)


JOB_ENDING_EVENTS = frozenset(kind for kind, step in LIFECYCLE.items()
                              if any(t.job in JOB_TERMINAL for t in branches(step)))
"""The event types that end an accepted job (JobSucceeded, JobFailed, JobCancelled)."""


def transition(event: Mapping[str, Any]) -> Transition:
    """The transition of one event (a ``KeyError`` for a type the lifecycle does not know)."""
    step = LIFECYCLE[event["type"]]
    if isinstance(step, ByFlag):
        return step.if_true if event.get(step.field, step.default) else step.if_false
    return step


def task_state_after(event: Mapping[str, Any]) -> TaskState | None:
    """The state the event leaves its task in; None when it changes no task state."""
    return transition(event).task


def job_state_after(event: Mapping[str, Any]) -> JobState | None:
    """The state the event leaves its job in; None when it changes no job state."""
    return transition(event).job


# -- an operator's actions on one task -------------------------------------------------------------------
TASK_ACTIONS = ("retry", "mark_succeeded")
"""An operator's decisions on one task (RetryTask, MarkTaskSucceeded); docs/semantics.md#retry-a-task."""

TASK_ACTION_JOB_STATES = frozenset({JobState.RUNNING, JobState.FAILED, JobState.SUCCEEDED_PARTIAL})
"""Jobs whose tasks an operator may retry or mark succeeded (a succeeded job has nothing to act on; a cancelled
one was stopped on purpose: redrive runs it again)."""

TASK_ACTION_TASK_STATES = REOPENABLE
"""Tasks an operator may retry or mark succeeded: those that ended without succeeding."""


def task_action_refusal(action: str, job_id: str, job_state: str | None, task_id: str,
                        task_state: str | None, attempt: int = 0) -> tuple[str, str] | None:
    """Why ``action`` on the task cannot be done, as ``(code, reason)``; None if it can.

    The one table of rules: the API answers 409 with it before sending the command, the scheduler
    emits TaskActionRejected with it when the command (from any producer) is folded.
    """
    verb = "retried" if action == "retry" else "marked succeeded"
    if job_state is None or job_state == JobState.REJECTED:
        return "unknown_job", f"job {job_id!r} does not exist"
    if task_state is None:
        return "unknown_task", f"job {job_id!r} has no task {task_id!r}"
    if job_state not in TASK_ACTION_JOB_STATES:
        if job_state == JobState.PAUSED:
            return "job_paused", f"job {job_id!r} is paused; resume it first (`dagfold resume {job_id}`)"
        if job_state == JobState.CANCELLED:
            return "job_cancelled", (f"job {job_id!r} was cancelled; its tasks cannot be {verb} "
                                     f"(`dagfold redrive {job_id}` runs its unfinished tasks again)")
        return "job_succeeded", f"job {job_id!r} already {job_state}; no task of it can be {verb}"
    if task_state in TASK_ACTION_TASK_STATES:
        return None
    if task_state == TaskState.SUCCEEDED:
        return "task_succeeded", f"task {task_id!r} already succeeded"
    doing: dict[str, str] = {TaskState.PENDING: "has not run yet (it waits for its upstream tasks)",
             TaskState.RUNNABLE: f"is queued to run (attempt {attempt})",
             TaskState.RUNNING: f"is running (attempt {attempt})",
             TaskState.RETRYING: f"is waiting to retry (attempt {attempt} failed; its retry policy runs it again)"}
    return "task_not_finished", (f"task {task_id!r} {doing.get(task_state, f'is {task_state}')}; only a failed, "
                                 f"skipped or cancelled task can be {verb}")


# -- an operator's control of a whole job ----------------------------------------------------------------
HOLDING = frozenset({JobState.PAUSED})
"""Jobs whose tasks are held instead of dispatched when they could run (``runnable.make_runnable``)."""

JOB_CONTROL_FROM: Mapping[str, frozenset[JobState]] = {
    "pause": frozenset({JobState.RUNNING}),
    "resume": frozenset({JobState.PAUSED}),
}
"""The job states each of an operator's job controls (PauseJob, ResumeJob) acts on; docs/semantics.md#pause."""


def job_control_refusal(action: str, job_id: str, job_state: str | None) -> tuple[str, str] | None:
    """Why ``action`` ("pause" or "resume") cannot be done to the job, as ``(code, reason)``; None if it can.

    The one table of rules: the API answers 409 with it before sending the command; the scheduler folds a
    command it refuses as a no-op (the command stays in the log for the audit), as it does a late cancel.
    """
    if job_state is None or job_state == JobState.REJECTED:
        return "unknown_job", f"job {job_id!r} does not exist"
    if job_state in JOB_CONTROL_FROM[action]:
        return None
    if job_state in JOB_TERMINAL:
        return "job_finished", f"job {job_id!r} already {job_state}; it can no longer be {action}d"
    if action == "pause":
        return "job_paused", f"job {job_id!r} is paused already (`dagfold resume {job_id}` runs it again)"
    return "job_not_paused", f"job {job_id!r} is {job_state}, not paused"
