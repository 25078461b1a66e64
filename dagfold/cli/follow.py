"""Following a job to its end: one code path for ``run``, ``submit --wait`` and ``watch``.

A *source* yields ``(kind, data)`` pairs in the shape of the API's server-sent events
(``job``: the summary, ``history``: one history entry, ``end``): ``sse_events`` reads them from
the API, ``local_events`` from the read model of a stack in this process (``run``).
``JobView`` shows them: on a terminal a live display (a bar, counts by state, the running
tasks, elapsed time, each failure as it happens); piped, plain lines (a line when the counts
change, at most every ``PLAIN_EVERY_S``, and one per failure). ``follow`` drives a source into
a view and returns the job's last summary.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from dagfold.cli.common import fail, seg
from dagfold.lifecycle import JOB_FINAL

Event = tuple[str, dict[str, Any]]
TERMINAL = JOB_FINAL
PLAIN_EVERY_S = 2.0
SHOWN_RUNNING = 6
STATE_ORDER = ("running", "runnable", "retrying", "pending", "succeeded", "failed", "skipped", "cancelled")


def counts_text(job: dict[str, Any]) -> str:
    counts = job.get("counts") or {}
    return " ".join(f"{k}={counts[k]}" for k in STATE_ORDER if counts.get(k))


class JobView:
    """The live display of one job (``enabled=False``: shows nothing)."""

    def __init__(self, job: dict[str, Any], console: Console, enabled: bool = True) -> None:
        self.job = job
        self.console = console
        self.enabled = enabled
        self.live_mode = enabled and console.is_terminal
        self.running: dict[str, int] = {}  # task -> attempt, from the history's task_state
        self.failures = 0
        self.started = time.monotonic()
        self._plain_at = 0.0
        self._plain_last = ""
        # the job's name and ID on a line of their own: at 80 columns a full ID left no room for the bar
        self.progress = Progress(TextColumn("{task.description:<10}", markup=False), BarColumn(bar_width=30),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        self.bar = self.progress.add_task(str(job.get("state", "")), total=job.get("total_tasks") or 1,
                                          completed=job.get("finished_tasks", 0))
        self.live: Live | None = None

    def _label(self) -> str:
        name = self.job.get("name")
        return f"{name} ({self.job['job_id']})" if name else str(self.job["job_id"])

    def _running_line(self) -> Text:
        if not self.running:
            return Text("")
        names = list(self.running)[:SHOWN_RUNNING]
        more = len(self.running) - len(names)
        return Text("running: " + ", ".join(names) + (f" (+{more} more)" if more > 0 else ""), style="dim",
                    overflow="ellipsis", no_wrap=True)

    def _display(self) -> Group:
        return Group(Text(self._label(), style="bold", overflow="fold"), self.progress,
                     Text(counts_text(self.job), overflow="fold"), self._running_line())

    def __enter__(self) -> JobView:
        if self.live_mode:
            self.live = Live(self._display(), console=self.console,
                             refresh_per_second=8, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self._refresh()
            self.live.__exit__(None, None, None)
            self.live = None
        elif self.enabled:
            self._plain(force=True)

    def _refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._display())

    def _plain(self, force: bool = False) -> None:
        line = (f"{self.job['state']} {self.job.get('finished_tasks', 0)}/{self.job.get('total_tasks', 0)} "
                f"{counts_text(self.job)}")
        now = time.monotonic()
        if line != self._plain_last and (force or now - self._plain_at >= PLAIN_EVERY_S):
            self._plain_at = now
            self._plain_last = line
            self.console.print(f"[{now - self.started:6.1f}s] {self._label()}: {line}", markup=False,
                               highlight=False)

    def on_job(self, job: dict[str, Any]) -> None:
        self.job = job
        if not self.enabled:
            return
        self.progress.update(self.bar, total=job.get("total_tasks") or 1, completed=job.get("finished_tasks", 0),
                             description=str(job["state"]))
        if self.live_mode:
            self._refresh()
        else:
            self._plain()

    def on_history(self, entry: dict[str, Any]) -> None:
        task, state = entry.get("task_id"), entry.get("task_state")
        if task:
            if state == "running":
                self.running[task] = int(entry.get("attempt") or 0)
            elif state is not None:
                self.running.pop(task, None)
        if not self.enabled:
            return
        if entry.get("type") == "TaskFailed":
            self.failures += 1
            line = Text.assemble(("✗ ", "red"), (f"{task}", "bold red"), f" attempt {entry.get('attempt')}: ",
                                 str(entry.get("detail") or ""))
            if self.live is not None:
                self.live.console.print(line)
            else:
                self.console.print(line, highlight=False)
        if self.live_mode:
            self._refresh()


def follow(events: Iterator[Event], view: JobView, on_event: Callable[[Event], None] | None = None) -> dict[str, Any]:
    """Feed ``events`` into ``view`` until the job ends or the source stops; the last summary."""
    with view:
        for kind, data in events:
            if on_event is not None:
                on_event((kind, data))
            if kind == "job":
                view.on_job(data)
            elif kind == "history":
                view.on_history(data)
            elif kind == "end":
                break
    return view.job


def local_events(read_model: Any, job_id: str, alive: Callable[[], bool], timeout_s: float,
                 poll_s: float = 0.1) -> Iterator[Event]:
    """The events of a job from a read model in this process (the same frames as the API's stream)."""
    deadline = time.monotonic() + timeout_s
    cursor: str | None = None
    last: tuple[Any, ...] | None = None
    while alive() and time.monotonic() < deadline:
        job = read_model.get_job(job_id)
        if job is None:
            time.sleep(poll_s)
            continue
        page = read_model.get_history(job_id, limit=500, cursor=cursor)
        for entry in page.items:
            cursor = read_model.history_cursor(job_id, entry["partition"], entry["offset"])
            yield "history", entry
        key = (job["state"], job["last_offset"], job["updated_ms"])
        if key != last:
            last = key
            yield "job", job
        if page.next_cursor:
            continue
        if job["state"] in TERMINAL:
            yield "end", {"job_id": job_id, "state": job["state"]}
            return
        time.sleep(poll_s)


# How long a job just submitted may be unknown to the API before it is an error.
NOT_YET_PROJECTED_S = 30.0


def sse_events(api: str, job_id: str, headers: dict[str, str], timeout_s: float,
               get_job: Callable[[], dict[str, Any]]) -> Iterator[Event]:
    """The events of a job from the API's server-sent events, reconnecting (and resuming after the last
    entry) when the connection drops; stops at the job's end or after ``timeout_s`` (0: never)."""
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    last_id: str | None = None
    url = f"{api.rstrip('/')}/v1/jobs/{seg(job_id)}/events"
    not_found_until = time.monotonic() + NOT_YET_PROJECTED_S
    while True:
        params: dict[str, str] = {}
        if deadline is not None:
            params["timeout_s"] = str(max(deadline - time.monotonic(), 0.1))
        if last_id:
            params["after"] = last_id
        try:
            with httpx.stream("GET", url, params=params, headers=headers, timeout=httpx.Timeout(30, read=60)) as r:
                if r.status_code == 404 and last_id is None:
                    # The job's summary may still answer: a submission that lost the race for its job ID
                    # to another tenant's job is rejected (job_id_taken) in this tenant's own view.
                    own = httpx.get(url.rsplit("/", 1)[0], headers=headers, timeout=30)
                    if own.status_code == 200 and own.json().get("state") in TERMINAL:
                        yield "job", own.json()
                        yield "end", {"job_id": job_id, "state": own.json()["state"]}
                        return
                if r.status_code == 404 and last_id is None and time.monotonic() < not_found_until:
                    # Just submitted: the API has accepted the command, but the projector has not
                    # folded its JobAccepted yet (on Kafka: after the scheduler's transaction).
                    time.sleep(0.25)
                    continue
                if r.status_code >= 400:
                    raise fail(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}", 1)
                event = None
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        last_id = line[4:]
                    elif line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: ") and event:
                        data = json.loads(line[6:])
                        yield event, data
                        if event == "end":
                            return
        except httpx.HTTPError:
            time.sleep(1.0)  # reconnect and resume after the last entry
        if deadline is not None and time.monotonic() >= deadline:
            return
        job = get_job()
        yield "job", job
        if job["state"] in TERMINAL:
            yield "end", {"job_id": job_id, "state": job["state"]}
            return
