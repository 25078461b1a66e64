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
