"""The ``dagfold`` command line.

Stack commands (``up``, ``run``, ``worker``) start components in this process;
client commands (``submit``, ``status``, ``tasks``, ``cancel``, ``history``)
talk to a running API over HTTP. Every client command takes ``--api`` and
``--json``. Exit codes: 0 success, 1 job failed/cancelled or a request failed,
2 rejected or bad input.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from dagfold.config import Config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="dagfold: an event-sourced scheduler for DAG and GPU jobs.")
out = Console()
err = Console(stderr=True)

LogOpt = Annotated[str, typer.Option("--log", help="embedded (default) or kafka://HOST:PORT")]
DataOpt = Annotated[Path | None, typer.Option("--data", help="data folder (state, projections, embedded log)")]
ApiOpt = Annotated[str, typer.Option("--api", envvar="DAGFOLD_API", help="API base URL")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
DEFAULT_API = "http://127.0.0.1:8080"
EXIT = {"succeeded": 0, "succeeded_partial": 0, "failed": 1, "cancelled": 1, "rejected": 2}


def fail(msg: str, code: int = 2) -> typer.Exit:
    err.print(f"[red]error:[/red] {msg}")
    return typer.Exit(code)


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _config(log: str, data: Path | None, port: int | None = None) -> Config:
    return Config.from_env(log_url=log, data_dir=data, api_port=port)


def _load_spec_doc(file: Path) -> dict[str, Any]:
    from services.scheduler.spec import SpecError, load_spec_text

    try:
        return load_spec_text(file.read_text()).model_dump(exclude_none=True)
    except OSError as exc:
        raise fail(f"cannot read {file}: {exc}") from None
    except SpecError as exc:
        raise fail(str(exc)) from None


def _to_job_spec(doc: dict[str, Any]) -> dict[str, Any]:
    from dagfold.config import Limits
    from services.scheduler.spec import SpecError, parse_spec, to_job_spec
    from services.scheduler.validation import validate_job_spec

    try:
        spec = to_job_spec(parse_spec(doc))
    except SpecError as exc:
        raise fail(str(exc)) from None
    rej = validate_job_spec(spec, Limits())
    if rej is not None:
        raise fail(f"job rejected ({rej.code}): {rej.reason}")
    return spec


def print_summary(job: dict[str, Any], tasks: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps({"job": job, "tasks": tasks}, default=str))
        return
    t = Table(title=f"job {job['job_id']}: {job['state']}")
    for col in ("task", "state", "attempt", "reason"):
        t.add_column(col)
    shown = tasks if len(tasks) <= 40 else [x for x in tasks if x["state"] != "succeeded"][:40]
    for x in shown:
        t.add_row(x["task_id"], x["state"], str(x.get("attempt", "")), (x.get("reason") or "")[:80])
    if shown:
        out.print(t)
    else:
        out.print(f"job {job['job_id']}: {job['state']}")
    counts = ", ".join(f"{k}={v}" for k, v in (job.get("counts") or {}).items() if v)
    dur = job.get("duration_ms")
    out.print(f"tasks: {job.get('total_tasks', len(tasks))} ({counts})"
              + (f"; duration {dur / 1000:.2f}s" if dur is not None else ""))
    if job.get("reason"):
        out.print(f"reason: {job['reason']}")


@app.command()
def up(log: LogOpt = "embedded", data: DataOpt = None, workers: int = typer.Option(2, "--workers"),
       port: int = typer.Option(8080, "--port"), queue: list[str] = typer.Option(["default"], "--queue"),
       examples: bool = typer.Option(False, "--examples", help="submit the examples at start"),
       with_scheduler: bool = typer.Option(True, "--scheduler/--no-scheduler",
                                           help="run a scheduler instance in this process"),
       instance: str = typer.Option("0", "--instance", help="scheduler instance id (unique per process)"),
       verbose: bool = typer.Option(False, "-v")) -> None:
    """Run the whole local stack: scheduler, projector, workers and the API."""
    from services.stack import Stack, StackOptions

    _logging(verbose)
    cfg = _config(log, data, port)
    if not with_scheduler and cfg.log_url == "embedded":
        raise fail("--no-scheduler needs a shared log (kafka://...): the embedded log is one process's")
    stack = Stack(cfg, StackOptions(workers=workers, queues=tuple(queue), scheduler=with_scheduler,
                                    scheduler_instance=instance))
    try:
        stack.start()
    except Exception as exc:
        raise fail(f"cannot start: {exc}", 1) from None
    out.print(f"dagfold up: log={cfg.log_url} data={cfg.data_dir} API http://{cfg.api_host}:{cfg.api_port}")
    if examples:
        submit_examples(stack)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        while not stopping.is_set() and not stack.failed:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    stack.stop()
    if stack.failed:
        raise fail(f"a component failed: {stack.errors[0]!r}", 1)


def submit_examples(stack: Any) -> None:
    from dagfold.commands import submit_job
    from dagfold.wfcommons import workflow_spec
    from services.scheduler.spec import SpecError, load_spec_text, parse_spec, to_job_spec

    root = Path(__file__).resolve().parent.parent
    docs: list[tuple[str, dict[str, Any]]] = []
    for f in sorted((root / "examples").glob("*.yaml")):
        try:
            docs.append((f.name, to_job_spec(load_spec_text(f.read_text()))))
        except SpecError as exc:
            err.print(f"skipping {f.name}: {exc}")
    montage = root.parent / "shared/data/wfcommons/montage-chameleon-2mass-01d-001.json.gz"
    if montage.exists():
        docs.append((montage.name, to_job_spec(parse_spec(workflow_spec(montage, time_scale=0.01)))))
    for name, spec in docs:
        stack.sender.send(submit_job(spec, source="examples"))
        out.print(f"submitted {name}: {spec['job_id']}")


def _run_stack(spec: dict[str, Any], log: str, data: Path | None, workers: int, timeout: float,
               as_json: bool) -> int:
    from dagfold.commands import submit_job
    from services.stack import Stack, StackOptions

    tmp = None
    if data is None:
        tmp = Path(tempfile.mkdtemp(prefix="dagfold-run-"))
        data = tmp
    cfg = _config(log, data)
    queues = tuple(sorted({t["queue"] for t in spec["tasks"]}))
    stack = Stack(cfg, StackOptions(workers=workers, queues=queues, api=False))
    try:
        stack.start()
        stack.sender.send(submit_job(spec, source="cli"))
        job = stack.wait_job(spec["job_id"], timeout)
        if stack.failed:
            raise fail(f"a component failed: {stack.errors[0]!r}", 1)
        if job is None or job["state"] not in EXIT:
            raise fail(f"job {spec['job_id']} did not finish within {timeout}s", 1)
        tasks = stack.read_model.get_tasks(spec["job_id"], limit=1000).items
        print_summary(job, tasks, as_json)
        return EXIT[job["state"]]
    finally:
        stack.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@app.command()
def run(file: Annotated[Path | None, typer.Argument(help="job spec (YAML or JSON)")] = None,
        wfcommons: Path | None = typer.Option(None, "--wfcommons", help="a WfCommons workflow JSON(.gz)"),
        time_scale: float = typer.Option(0.0, "--time-scale", help="sleep runtimeInSeconds x this (0: noop)"),
        log: LogOpt = "embedded", data: DataOpt = None, workers: int = typer.Option(2, "--workers"),
        timeout: float = typer.Option(3600, "--timeout"), as_json: JsonOpt = False,
        verbose: bool = typer.Option(False, "-v")) -> None:
    """Run one job to its end in a temporary stack; exit 0 succeeded, 1 failed/cancelled, 2 rejected."""
    _logging(verbose)
    if (file is None) == (wfcommons is None):
        raise fail("give a job spec FILE or --wfcommons PATH")
    if wfcommons is not None:
        from dagfold.wfcommons import WorkflowError, workflow_spec

        try:
            doc = workflow_spec(wfcommons, time_scale)
        except WorkflowError as exc:
            raise fail(str(exc)) from None
    else:
        assert file is not None
        doc = _load_spec_doc(file)
    spec = _to_job_spec(doc)
    raise typer.Exit(_run_stack(spec, log, data, workers, timeout, as_json))


@app.command()
def worker(queue: str = typer.Option("default", "--queue"), log: LogOpt = "embedded",
           data: DataOpt = None, concurrency: int = typer.Option(1, "--concurrency"),
           verbose: bool = typer.Option(False, "-v")) -> None:
    """Run workers for one queue in this process (use with --log kafka://...)."""
    import socket

    from dagfold.log import open_log
    from services.worker.handlers import default_registry
    from services.worker.worker import Worker

    _logging(verbose)
    cfg = _config(log, data)
    lg = open_log(cfg.log_url, cfg.data_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    host = f"{socket.gethostname()}-{int(time.time() * 1000) % 100000}"
    threads = []
    workers = []
    for i in range(concurrency):
        w = Worker(lg, queue, f"{host}-{queue}-{i}", default_registry(), config=cfg)
        workers.append(w)
        threads.append(w.start_thread(stop))
    try:
        while not stop.is_set() and any(t.is_alive() for t in threads):
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop.set()
    for t in threads:
        t.join(timeout=10)
    for w in workers:
        w.close()
    lg.close()


# -- client commands ---------------------------------------------------------------

def _request(method: str, api: str, path: str, **kw: Any) -> Any:
    try:
        r = httpx.request(method, api.rstrip("/") + path, timeout=30, **kw)
    except httpx.HTTPError as exc:
        raise fail(f"cannot reach the API at {api}: {exc}", 1) from None
    if r.status_code >= 400:
        try:
            e = r.json()["error"]
            msg = f"{e['code']}: {e['reason']}"
        except Exception:
            msg = r.text[:500]
        raise fail(f"HTTP {r.status_code}: {msg}", 2 if r.status_code in (400, 413, 422) else 1)
    return r.json()


def _get_all(api: str, path: str, key: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 1000}
        if cursor:
            params["cursor"] = cursor
        page = _request("GET", api, path, params=params)
        items.extend(page[key])
        cursor = page.get("next_cursor")
        if not cursor:
            return items


@app.command()
def submit(file: Path, wait: bool = typer.Option(False, "--wait"), api: ApiOpt = DEFAULT_API,
           as_json: JsonOpt = False, timeout: float = typer.Option(3600, "--timeout")) -> None:
    """Submit a job spec; with --wait, follow it to its end (exit code as for `run`)."""
    try:
        body = file.read_bytes()
    except OSError as exc:
        raise fail(f"cannot read {file}: {exc}") from None
    ctype = "application/json" if file.suffix == ".json" else "application/yaml"
    res = _request("POST", api, "/v1/jobs", content=body, headers={"content-type": ctype})
    job_id = res["job_id"]
    if not wait:
        out.print_json(json.dumps(res)) if as_json else out.print(job_id)
        return
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        try:
            job = _request("GET", api, f"/v1/jobs/{job_id}")
        except typer.Exit:
            job = None
        if job and job["state"] in EXIT:
            break
        time.sleep(0.2)
    if not job or job["state"] not in EXIT:
        raise fail(f"job {job_id} did not finish within {timeout}s", 1)
    print_summary(job, _get_all(api, f"/v1/jobs/{job_id}/tasks", "tasks"), as_json)
    raise typer.Exit(EXIT[job["state"]])


@app.command()
def status(job_id: str, api: ApiOpt = DEFAULT_API, as_json: JsonOpt = False) -> None:
    """Show a job's state and counts."""
    job = _request("GET", api, f"/v1/jobs/{job_id}")
    if as_json:
        out.print_json(json.dumps(job))
        return
    out.print(f"{job['job_id']}: {job['state']}  progress {job.get('progress_pct', 0):.1f}%")
    out.print(", ".join(f"{k}={v}" for k, v in (job.get("counts") or {}).items() if v))
    if job.get("reason"):
        out.print(f"reason: {job['reason']}")


@app.command()
def tasks(job_id: str, api: ApiOpt = DEFAULT_API, as_json: JsonOpt = False) -> None:
    """List a job's tasks."""
    items = _get_all(api, f"/v1/jobs/{job_id}/tasks", "tasks")
    if as_json:
        out.print_json(json.dumps(items))
        return
    t = Table()
    for col in ("task", "state", "attempt", "worker", "reason"):
        t.add_column(col)
    for x in items:
        t.add_row(x["task_id"], x["state"], str(x.get("attempt", "")), x.get("worker_id") or "",
                  (x.get("reason") or "")[:80])
    out.print(t)


@app.command()
def cancel(job_id: str, api: ApiOpt = DEFAULT_API, as_json: JsonOpt = False) -> None:
    """Cancel a job."""
    res = _request("POST", api, f"/v1/jobs/{job_id}/cancel")
    out.print_json(json.dumps(res)) if as_json else out.print(f"cancel requested for {job_id}")


@app.command()
def redrive(job_id: str, api: ApiOpt = DEFAULT_API, as_json: JsonOpt = False) -> None:
    """Re-run a failed (or partial, or cancelled) job from its failed, skipped and cancelled tasks."""
    res = _request("POST", api, f"/v1/jobs/{job_id}/redrive")
    out.print_json(json.dumps(res)) if as_json else out.print(f"redrive requested for {job_id}")


@app.command()
def history(job_id: str, api: ApiOpt = DEFAULT_API, as_json: JsonOpt = False) -> None:
    """Show a job's history: every event with its time, attempt and reason."""
    items = _get_all(api, f"/v1/jobs/{job_id}/history", "events")
    if as_json:
        out.print_json(json.dumps(items))
        return
    t = Table()
    for col in ("time", "event", "task", "attempt", "detail"):
        t.add_column(col)
    for x in items:
        ts = time.strftime("%H:%M:%S", time.localtime(x["ts_ms"] / 1000)) + f".{x['ts_ms'] % 1000:03d}"
        t.add_row(ts, x["type"].rsplit(".", 1)[-1], x.get("task_id") or "", str(x.get("attempt") or ""),
                  (x.get("detail") or "")[:100])
    out.print(t)


def main() -> None:
    app()


from dagfold import cli_admin as _cli_admin  # noqa: E402,F401  (registers scheduler, replay, audit)
