"""Trigger rules: when a pending task runs, from its upstream tasks' outcomes (Airflow's semantics).

The fold keeps, per task, how many upstream tasks are still open (``rem``) and how many ended
succeeded (``ok``), failed (``bad``) or skipped or cancelled (``skip``); a rule reads only those
counts, so deciding costs O(1) whatever the graph. The API reads the same counts from the read model
to refuse a retry that would only skip the task again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

TriggerRule = Literal["all_success", "all_done", "one_success", "one_failed", "none_failed", "always"]
TRIGGER_RULES = frozenset(get_args(TriggerRule))


def evaluate_rule(t: Mapping[str, Any]) -> str:
    """'run', 'skip' or 'wait' for a pending task, from its upstream outcome counts (Airflow semantics)."""
    rule, rem, ok, bad, skip = t["rule"], t["rem"], t["ok"], t["bad"], t["skip"]
    if rule == "all_success":
        return "skip" if bad or skip else ("run" if rem == 0 else "wait")
    if rule == "all_done" or rule == "always":
        return "run" if rem == 0 else "wait"
    if rule == "one_success":
        return "run" if ok else ("skip" if rem == 0 else "wait")
    if rule == "one_failed":
        return "run" if bad else ("skip" if rem == 0 else "wait")
    if rule == "none_failed":
        return "skip" if bad else ("run" if rem == 0 else "wait")
    raise ValueError(f"unknown trigger rule {rule!r}")


def still_skipped(task_id: str, t: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why retrying the task would only skip it again (its trigger rule, on the upstream outcomes as they
    stand), as ``(code, reason)``; None if it can run. ``t`` needs rule, n_up, rem, ok, bad and skip: the
    fold's task record, or the API's counts from the read model."""
    if not t["n_up"] or t["rule"] == "always" or evaluate_rule(t) != "skip":
        return None
    return "still_skipped", (f"task {task_id!r} would be skipped again: trigger rule {t['rule']} is not met "
                             f"({t['bad']} upstream failed, {t['skip']} skipped or cancelled); retry the failed "
                             f"upstream task instead, or mark this one succeeded")
