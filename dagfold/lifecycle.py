"""The job and task lifecycle that every layer agrees on: the states, what each event does to them, and
the operator's rules. The folds decide and apply by it, the read models and the API report it, the
callback notifier and the SDK follow it, the CLI waits for it, the chaos checks hold the log to it.
One definition, here.

States are ``StrEnum`` members: each *is* its string (equal, same hash, same msgpack and JSON), so stored
records and answers are byte for byte what bare strings gave.

``LIFECYCLE`` maps every event type of ``schemas/`` (``dagfold.event.*``) to its ``Transition``: the state
the event leaves its task(s) and its job in, the task states it may follow, and how the jobs read model's
history tells it. An event the table describes alone (it only moves a job between open states, or it changes
no state) needs no applier of its own in either fold (``with_lifecycle_appliers``) nor in the chaos model.
tests/test_lifecycle_table.py checks that every event schema is in it and in both folds' applier tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar


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
    ``says``: the event's line in a job's history (``projections.jobs.history_entry``), a ``str.format``
    template over the event's fields, with ``{by}`` (" by <requested_by>", or nothing) and ``{because}``
    (": <reason>", or nothing); "" when the read model words it itself (a line that needs more than fields).
    """

    task: TaskState | None = None
    job: JobState | None = None
    from_task: frozenset[TaskState] | None = None
    says: str = ""


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
    "dagfold.event.JobRejected": Transition(job=JobState.REJECTED, says="{code}: {reason}"),
    "dagfold.event.SubmissionDeduplicated": Transition(
        says="repeated submission with idempotency key {idempotency_key!r}"),
    "dagfold.event.TenantEntitlementsSet": UNCHANGED,
    "dagfold.event.TaskDispatched": Transition(task=_T.RUNNABLE, from_task=frozenset({_T.PENDING, _T.RETRYING}),
                                               says="queue {queue}"),
    "dagfold.event.TaskRedispatched": Transition(from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.TaskRedispatchDeferred": Transition(from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.TaskAllocated": Transition(from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.TaskCheckpointing": Transition(says="{alloc_id} asked to checkpoint and stop: {reason}"),
    "dagfold.event.TaskRequeued": Transition(task=_T.RUNNABLE, from_task=_RUNNING_ATTEMPT),
    "dagfold.event.LeaseGranted": Transition(task=_T.RUNNING, from_task=frozenset({_T.RUNNABLE})),
    "dagfold.event.LeaseExtended": Transition(from_task=frozenset({_T.RUNNING})),
    "dagfold.event.LeaseRejected": Transition(says="worker {worker_id}: {reason}"),
    "dagfold.event.ReportIgnored": Transition(says="{report} from worker {worker_id}: {reason}"),
    "dagfold.event.TaskSucceeded": Transition(task=_T.SUCCEEDED, from_task=frozenset({_T.RUNNING}),
                                              says="worker {worker_id}"),
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
    "dagfold.event.JobPaused": Transition(job=JobState.PAUSED, says="paused{by}{because}"),
    "dagfold.event.JobResumed": Transition(job=JobState.RUNNING, says="resumed{by}{because}"),
    "dagfold.event.TaskHeld": Transition(from_task=frozenset({_T.PENDING, _T.RETRYING, _T.RUNNABLE}),
                                         says="could run, held: {reason} (runs when the job is resumed)"),
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

JOB_STATE_ONLY = frozenset(kind for kind, step in LIFECYCLE.items()
                           if all(t.task is None and t.from_task is None and t.job in JOB_OPEN for t in branches(step)))
"""The event types that only move an open job to another open state (JobPaused, JobResumed): every fold sets
the job's state from the table, the chaos model leaves the job's tasks as they are; none has code of its own."""

STATE_UNCHANGED = frozenset(kind for kind, step in LIFECYCLE.items()
                            if all(t.task is None and t.job is None for t in branches(step)))
"""The event types that change no job or task state (some follow given task states): a fold with nothing more
to keep of one records it only (its history), with no applier of its own."""

A = TypeVar("A")


def with_lifecycle_appliers(own: Mapping[str, A], set_job_state: A, record_only: A) -> dict[str, A]:
    """A fold's applier table, in the lifecycle's order: its ``own`` appliers, and for every other event the
    table describes alone the fold's generic one: ``set_job_state`` for ``JOB_STATE_ONLY``, ``record_only``
    for ``STATE_UNCHANGED``. An event that is neither and has no applier of its own is left out: the fold
    refuses it, and tests/test_lifecycle_table.py fails until it has one."""
    out: dict[str, A] = {}
    for kind in LIFECYCLE:
        if kind in own:
            out[kind] = own[kind]
        elif kind in JOB_STATE_ONLY:
            out[kind] = set_job_state
        elif kind in STATE_UNCHANGED:
            out[kind] = record_only
    out.update((kind, fn) for kind, fn in own.items() if kind not in out)  # no row in the table: the test says so
    return out


class _Told(dict[str, Any]):
    """An event's fields for a ``says`` template: a field the record lacks reads None (as ``Record.get``)."""

    def __missing__(self, key: str) -> Any:
        return None


def history_line(event: Mapping[str, Any]) -> str | None:
    """The event's history line from its ``says`` template; None when the table has none for it."""
    step = LIFECYCLE.get(event.get("type", ""))
    says = transition(event).says if step is not None else ""
    if not says:
        return None
    who, why = event.get("requested_by"), event.get("reason")
    return says.format_map(_Told(event, by=f" by {who}" if who else "", because=f": {why}" if why else ""))


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
