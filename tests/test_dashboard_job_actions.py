"""A job page's buttons in headless Chromium, from the dashboard's one table of job actions (``JOB_ACTIONS`` in
static/app.js): Pause while running, Resume while paused, Cancel (after a confirm) while open, Redrive once
cancelled; a paused job's badge wears the generic on-hold look (``.badge.holding``, no CSS rule of its own).

Uses the browser and page fixtures of test_dashboard_browser (Debian's Chromium, `make browser`).
"""

from __future__ import annotations

import uuid
from typing import Any

import tests.test_dashboard_browser as base
from tests.cli_support import UpProcess

# the stack is the session's `dagfold up` (tests/conftest.py): this test submits its own job and acts on it
browser = base.browser
page = base.page
stack = base.stack


def _buttons(page: Any) -> list[str]:
    return page.eval_on_selector_all("#job-head button", "bs => bs.map((b) => b.id)")  # type: ignore[no-any-return]


def test_pause_resume_cancel_and_redrive_from_the_job_page(stack: UpProcess, page: Any) -> None:
    job = f"buttons-{uuid.uuid4().hex[:8]}"
    stack.submit({"id": job, "tasks": [{"id": "slow", "handler": "sleep", "args": {"seconds": 60}},
                                       {"id": "after", "handler": "noop", "depends_on": ["slow"]}]})
    page.goto(f"{stack.url}/ui/#/jobs/{job}")
    page.wait_for_selector("#job-state .badge.running")
    assert _buttons(page) == ["btn-pause", "btn-cancel"]
    assert page.get_attribute("#btn-pause", "title") == "nothing new is dispatched; running tasks finish"

    page.click("#btn-pause")
    page.wait_for_selector("#job-state .badge.paused.holding", timeout=10_000)
    page.wait_for_selector("#btn-resume")
    assert _buttons(page) == ["btn-resume", "btn-cancel"]
    assert stack.job(job)["state"] == "paused"  # type: ignore[index]

    page.click("#btn-resume")
    page.wait_for_selector("#job-state .badge.running", timeout=10_000)
    assert page.locator("#job-state .badge.holding").count() == 0

    page.once("dialog", lambda d: d.accept())
    page.wait_for_selector("#btn-cancel").click()
    stack.wait(job)
    page.wait_for_selector("#job-state .badge.cancelled", timeout=10_000)
    page.wait_for_selector("#btn-redrive")
    assert _buttons(page) == ["btn-redrive"]
