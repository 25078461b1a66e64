"""The task panel's "Retry task" and "Mark succeeded" buttons in headless Chromium (issue 17 part 8): each asks
to confirm (with a reason), sends the command, and the panel, the graph and the history follow the scheduler's
decision; a refusal (409) shows its reason in the panel.

Uses the browser and page fixtures of test_dashboard_browser (Debian's Chromium, `make browser`).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import tests.test_dashboard_browser as base
from tests.cli_support import UpProcess
from tests.test_dashboard_browser import shot

# the stack is the session's `dagfold up` (tests/conftest.py): these tests submit their own jobs and act on them
browser = base.browser
page = base.page
stack = base.stack


def _failing_job(stack: UpProcess, marker: Path) -> str:
    job = f"panel-{uuid.uuid4().hex[:8]}"
    stack.submit({"id": job, "tasks": [
        {"id": "prepare", "handler": "noop"},
        {"id": "load", "handler": "shell", "depends_on": ["prepare"],
         "args": {"cmd": f"test -e {marker} || {{ echo 'input missing' >&2; exit 3; }}"}},
        {"id": "report", "handler": "noop", "depends_on": ["load"]}]})
    assert stack.wait(job)["state"] == "failed"
    return job


def _open_task(page: Any, stack: UpProcess, job: str, task: str, state: str) -> None:
    page.goto(f"{stack.url}/ui/#/jobs/{job}")
    page.wait_for_function(f"window.__dagfold.graph !== null && window.__dagfold.stateOf('{task}') === '{state}'")
    pos = page.evaluate(f"window.__dagfold.nodeScreenPos('{task}')")
    page.mouse.click(pos["x"], pos["y"])
    page.wait_for_selector(f"#task-title:text-is('{task}')")


def test_retry_and_mark_succeeded_from_the_task_panel(stack: UpProcess, page: Any, tmp_path: Path) -> None:
    marker = tmp_path / "input-restored"
    job = _failing_job(stack, marker)

    # a task skipped because its upstream failed: the confirm step, then the API's refusal in the panel
    _open_task(page, stack, job, "report", "skipped")
    page.click("#btn-task-retry")
    page.wait_for_selector("#task-confirm")
    page.click("#task-confirm-no")  # back: nothing sent
    assert page.locator("#task-confirm").count() == 0
    page.click("#btn-task-retry")
    page.click("#task-confirm-yes")
    page.wait_for_selector("#task-action-error")
    assert "retry the failed upstream task" in page.locator("#task-action-error").inner_text()

    # retry the failed task: it runs again (the input is there now), its skipped downstream too
    marker.touch()
    _open_task(page, stack, job, "load", "failed")
    page.click("#btn-task-retry")
    page.fill("#task-action-reason", "input restored")
    shot(page, "task-retry-confirm.png")
    page.click("#task-confirm-yes")
    page.wait_for_function("window.__dagfold.stateOf('report') === 'succeeded'", timeout=30_000)
    page.wait_for_selector("#job-state .badge.succeeded", timeout=10_000)
    page.wait_for_selector("#task-retried-by", timeout=10_000)  # the panel followed the task
    assert page.locator("#task-actions").count() == 0  # a succeeded job offers no task action
    history = page.locator("#history").inner_text()
    assert "TaskReopened" in history and "retry by anonymous" in history and "input restored" in history

    # mark a failed task succeeded: the panel says it was marked, not run; its downstream runs
    other = _failing_job(stack, tmp_path / "never-there")
    _open_task(page, stack, other, "load", "failed")
    page.click("#btn-task-mark")
    page.fill("#task-action-reason", "loaded by hand")
    page.click("#task-confirm-yes")
    page.wait_for_selector("#task-marked", timeout=20_000)
    assert "anonymous: loaded by hand" in page.locator("#task-marked-by").inner_text()
    page.wait_for_function("window.__dagfold.stateOf('report') === 'succeeded'", timeout=30_000)
    page.wait_for_selector("#job-state .badge.succeeded", timeout=10_000)
    assert "marked succeeded by anonymous, not run" in page.locator("#history").inner_text()
    # the graph badges the marked task (live, from the event), and again when the page is loaded afresh
    page.wait_for_function("window.__dagfold.isMarkedRun('load') === true", timeout=10_000)
    assert page.evaluate("window.__dagfold.isMarkedRun('report')") is False  # it ran
    _open_task(page, stack, other, "load", "succeeded")
    page.wait_for_function("window.__dagfold.isMarkedRun('load') === true", timeout=10_000)
    shot(page, "task-marked.png")
