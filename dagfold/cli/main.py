"""The ``dagfold`` command line.

Stack commands (``up``, ``run``, ``worker``) start components in this process;
client commands (``submit``, ``jobs``, ``status``, ``watch``, ``tasks``,
``attempts``, ``history``, ``cancel``, ``redrive``) and operator commands
(``stuck``, ``queues``, ``tenants``, ``cluster``, ``failures``) talk to a
running API over HTTP. Every client command takes ``--api``, ``--api-key``
(``DAGFOLD_API_KEY``) and ``--json``. Exit codes: 0 success, 1 job failed/cancelled or a request failed,
2 rejected or bad input.
"""

from __future__ import annotations

import enum
import json
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from dagfold.cli.common import (
    ALLOW_ROOT_HELP,
    CLIENT,
    DEFAULT_API,
    EXIT,
    TASK_ENV_HELP,
    ApiOpt,
    DataOpt,
    JsonOpt,
    KeyOpt,
    LogOpt,
    VerboseOpt,
    _ago,
    _config,
    _dur,
    _get_all,
    _headers,
    _logging,
    _print_json,
    _request,
    _table,
    _time_arg,
    _ts,
    _when,
    app,
    err,
    fail,
    out,
    resolve_job,
    run_until_stopped,
    seg,
    serve_metrics,
    task_runtime,
)
from dagfold.clock import now_ms
from dagfold.lifecycle import JobState, TaskState
from dagfold.projections.jobs import APPLIERS as _JOB_APPLIERS

if TYPE_CHECKING:
    from dagfold.jobspec import JobSpecIn

JobArg = Annotated[str, typer.Argument(help="job ID, a unique prefix of it, or the job's name", show_default=False)]


def _load_spec(file: Path) -> JobSpecIn:
    from dagfold.jobspec import SpecError, load_spec_text

    try:
        return load_spec_text(file.read_text())
    except OSError as exc:
        raise fail(f"cannot read {file}: {exc}") from None
    except SpecError as exc:
        raise fail(str(exc)) from None


def _wfcommons_doc(path: Path, time_scale: float) -> dict[str, Any]:
    from dagfold.wfcommons import WorkflowError, workflow_spec

    if not 0 <= time_scale <= 1000:
        raise fail("--time-scale must be in [0, 1000]")
    try:
        return workflow_spec(path, time_scale)
    except WorkflowError as exc:
        raise fail(str(exc)) from None


def _to_job_spec(spec: JobSpecIn | dict[str, Any]) -> dict[str, Any]:
    """The checked record of a parsed spec (or of a document, parsed here once), refused as the scheduler
    would refuse it."""
    from dagfold.config import Limits
    from dagfold.jobspec import JobSpecIn, SpecError, parse_spec, to_job_spec

    try:
        return to_job_spec(spec if isinstance(spec, JobSpecIn) else parse_spec(spec), Limits())
    except SpecError as exc:  # SpecRejected: "job rejected (code): reason"
        raise fail(str(exc)) from None


STDERR_TAIL_LINES = 15
MAX_FAILURES_SHOWN = 20


def failure_details(tasks: list[dict[str, Any]],
                    attempts_of: Callable[[str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each failed task's last attempt: reason, exit code, worker and output tails (the first
    ``MAX_FAILURES_SHOWN``), so that a failure explains itself without another command."""
    found: list[dict[str, Any]] = []
    for t in tasks:
        if t["state"] != "failed":
            continue
        attempts_list = attempts_of(t["task_id"])
        last = attempts_list[-1] if attempts_list else {}
        found.append({"task_id": t["task_id"], "attempt": last.get("attempt", t.get("attempt")),
                      "reason": last.get("reason") or t.get("reason"),
                      "exit_code": last.get("exit_code", t.get("exit_code")),
                      "error_type": last.get("error_type", t.get("error_type")),
                      "worker_id": last.get("worker_id", t.get("worker_id")),
                      "stderr_tail": last.get("stderr_tail") or "", "stdout_tail": last.get("stdout_tail") or ""})
        if len(found) >= MAX_FAILURES_SHOWN:
            break
    return found


def _print_failure(f: dict[str, Any]) -> None:
    reason = f.get("reason") or "failed"
    if f.get("exit_code") is not None and f"exit code {f['exit_code']}" not in reason:
        reason += f" (exit code {f['exit_code']})"
    where = f" on {f['worker_id']}" if f.get("worker_id") else ""
    out.print(Text.assemble(("✗ ", "red"), (str(f["task_id"]), "bold red"),
                            f" failed, attempt {f.get('attempt')}{where}: {reason}"))
    for stream in ("stderr", "stdout"):
        tail = (f.get(f"{stream}_tail") or "").rstrip("\n")
        if not tail:
            continue
        lines = tail.splitlines()[-STDERR_TAIL_LINES:]
        out.print(f"  {stream} (last {len(lines)} lines):", style="dim")
        for line in lines:
            out.print(Text("  │ " + line), highlight=False)
        break  # stderr when there is some, else stdout


def print_summary(job: dict[str, Any], tasks: list[dict[str, Any]], as_json: bool,
                  failures: list[dict[str, Any]] | None = None) -> None:
    if as_json:
        out.print_json(json.dumps({"job": job, "tasks": tasks, "failures": failures or []}, default=str))
        return
    name = f" ({job['name']})" if job.get("name") else ""
    t = Table(title=f"job {job['job_id']}{name}: {job['state']}")
    for col in ("task", "state", "attempt", "reason"):
        t.add_column(col, overflow="fold")
    shown = tasks if len(tasks) <= 40 else [x for x in tasks if x["state"] != "succeeded"][:40]
    for x in shown:
        t.add_row(x["task_id"], x["state"], str(x.get("attempt", "")), (x.get("reason") or "")[:80])
    if shown:
        out.print(t)
    else:
        out.print(f"job {job['job_id']}{name}: {job['state']}")
    for f in failures or []:
        _print_failure(f)
    counts = ", ".join(f"{k}={v}" for k, v in (job.get("counts") or {}).items() if v)
    dur = job.get("duration_ms")
    out.print(f"tasks: {job.get('total_tasks', len(tasks))} ({counts})"
              + (f"; duration {dur / 1000:.2f}s" if dur is not None else ""))
    if job.get("reason"):
        out.print(f"reason: {job['reason']}")


HANDLERS_HELP = ("handlers the workers run, comma-separated (e.g. noop,sleep,shell); default: noop, sleep and "
                 "handlers registered in Python. 'shell' runs commands from job specs: only where listed here")
HANDLER_MODULE_HELP = "import this module first; it registers custom handlers (services.worker.register_handler)"
TASK_USER_HELP = "run task processes as this user (the worker must run as root)"
TASK_DIR_HELP = "folder for the per-attempt work folders of task processes (default: the system temp folder)"


@app.command()
def up(log: LogOpt = None, data: DataOpt = None,
       workers: int = typer.Option(2, "--workers", min=0, help="worker threads per queue"),
       port: int | None = typer.Option(None, "--port", min=1, max=65535, show_default=False,
                                       help="API and dashboard port (default: 8080; env DAGFOLD_PORT)"),
       queue: list[str] = typer.Option(["default"], "--queue", help="queues to run workers for; repeatable"),
       examples: bool = typer.Option(False, "--examples", help="submit the examples at start"),
       with_scheduler: bool = typer.Option(True, "--scheduler/--no-scheduler",
                                           help="run a scheduler instance in this process"),
       instance: str = typer.Option("0", "--instance", help="scheduler instance id (unique per process)"),
       with_callbacks: bool = typer.Option(True, "--callbacks/--no-callbacks",
                                           help="run the job-end callback notifier (one per deployment)"),
       gpu_nodes: int = typer.Option(0, "--gpu-nodes", min=0,
                                     help="run the GPU pool's allocator and N simulated GPU hosts here"),
       gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, max=64, help="GPUs of each simulated host"),
       auth_file: Path | None = typer.Option(None, "--auth-file", envvar="DAGFOLD_AUTH_FILE",
                                             help="API keys per tenant (YAML/JSON); without it the API is open"),
       token: bool = typer.Option(False, "--token", help="require a local token on every API call (a machine "
                                  "other users share); the CLI finds it in ~/.dagfold/tokens, the dashboard "
                                  "link printed at start carries it"),
       handlers: str | None = typer.Option(None, "--handlers", envvar="DAGFOLD_HANDLERS", help=HANDLERS_HELP),
       handler_module: list[str] = typer.Option([], "--handler-module", help=HANDLER_MODULE_HELP),
       task_user: str | None = typer.Option(None, "--task-user", envvar="DAGFOLD_TASK_USER", help=TASK_USER_HELP),
       task_dir: Path | None = typer.Option(None, "--task-dir", envvar="DAGFOLD_TASK_DIR", help=TASK_DIR_HELP),
       task_env: list[str] = typer.Option([], "--task-env", help=TASK_ENV_HELP),
       allow_root_tasks: bool = typer.Option(False, "--allow-root-tasks", envvar="DAGFOLD_ALLOW_ROOT_TASKS",
                                             help=ALLOW_ROOT_HELP),
       verbose: VerboseOpt = False) -> None:
    """Run the whole local stack: scheduler, projector, workers and the API."""
    from dagfold.services.stack import Stack, StackOptions

    _logging(verbose)
    _use_auth_file(auth_file)
    registry, runtime = _task_capabilities(handlers, handler_module, task_user, task_dir, task_env,
                                           allow_root_tasks, gpu=gpu_nodes > 0)
    cfg = _config(log, data, port)
    local_token = _use_local_token(cfg.api_host, cfg.api_port) if token else None
    if not with_scheduler and cfg.log_url == "embedded":
        raise fail("--no-scheduler needs a shared log (kafka://...): the embedded log is one process's")
    stack = Stack(cfg, StackOptions(workers=workers, queues=tuple(queue), scheduler=with_scheduler,
                                    scheduler_instance=instance, callbacks=with_callbacks,
                                    gpu_nodes=gpu_nodes, gpus_per_node=gpus_per_node,
                                    registry=registry, runtime=runtime))
    try:
        stack.start()
    except Exception as exc:
        from dagfold.cli.ux import explain

        stack.stop()
        raise fail(_disk_full_line(exc, cfg.data_dir) or f"cannot start: {explain(exc)}", 1) from None
    out.print(f"dagfold up: log={cfg.log_url} data={cfg.data_dir} API http://{cfg.api_host}:{cfg.api_port}")
    if local_token is not None:
        out.print(f"local token required; dashboard: http://{cfg.api_host}:{cfg.api_port}/ui/?token={local_token}")
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
    if local_token is not None:
        from dagfold.localtoken import remove_token

        remove_token(cfg.api_host, cfg.api_port, local_token)
    if stack.failed:
        raise fail(_disk_full_line(stack.errors[0], cfg.data_dir) or f"a component failed: {stack.errors[0]!r}", 1)


def _use_local_token(host: str, port: int) -> str:
    """The local token (DAGFOLD_API_TOKEN, else a new one), stored for this user's CLI and handed to the API."""
    import os

    from dagfold.localtoken import new_token, write_token

    value = os.environ.get("DAGFOLD_API_TOKEN") or new_token()
    try:
        path = write_token(host, port, value)
    except OSError as exc:
        raise fail(f"cannot store the local token: {exc}", 1) from None
    os.environ["DAGFOLD_API_TOKEN"] = value
    out.print(f"local token in {path} (this user only)")
    return value


def _disk_full_line(exc: BaseException, data: Path) -> str | None:
    """The one line for a full disk (RocksDB's own message names a file deep in the data folder)."""
    from dagfold.exceptions import disk_full

    return f"no space left on device under {data}: free some space and start again" if disk_full(exc) else None


def _task_capabilities(handlers: str | None, modules: list[str], task_user: str | None, task_dir: Path | None,
                       task_env: list[str], allow_root: bool = False, *, gpu: bool = False) -> tuple[Any, Any]:
    """The handler registry and task runtime the flags ask for (a bad flag is a one-line error).

    Task processes (``shell``, or GPU jobs with ``gpu``) that would run as root without a task user
    are refused unless ``allow_root`` (status 2, like every bad flag).
    """
    import importlib

    from dagfold.services.worker.capabilities import parse_handler_list
    from dagfold.services.worker.handlers import default_registry

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise fail(f"cannot import handler module {module!r}: {exc!r}") from None
    registry = default_registry()
    if handlers:
        try:
            registry = registry.select(parse_handler_list(handlers))
        except ValueError as exc:
            raise fail(f"--handlers: {exc}") from None
    runtime = task_runtime(task_user, task_dir, task_env, allow_root, runs_processes="shell" in registry or gpu)
    return registry, runtime


def _use_auth_file(auth_file: Path | None) -> None:
    """Check the auth file now (a bad one must stop start-up) and hand it to the API through the environment."""
    import os

    from dagfold.services.api.auth import AuthConfig, AuthConfigError

    if auth_file is None:
        return
    try:
        conf = AuthConfig.from_env(auth_file)
    except AuthConfigError as exc:
        raise fail(str(exc)) from None
    os.environ["DAGFOLD_AUTH_FILE"] = str(auth_file.resolve())
    out.print(f"API keys: {len(conf.principals)} from {auth_file}; every /v1 request needs one")


def submit_examples(stack: Any) -> None:
    from dagfold.commands import submit_job
    from dagfold.jobspec import SpecError, load_spec_text, parse_spec, to_job_spec
    from dagfold.wfcommons import workflow_spec

    root = Path(__file__).resolve().parents[2]  # the repository: dagfold/cli/main.py
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


def _all_tasks(read_model: Any, job_id: str) -> list[dict[str, Any]]:
    """Every task of the job, page by page (a page is at most 1,000)."""
    tasks: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = read_model.get_tasks(job_id, limit=1000, cursor=cursor)
        tasks += page.items
        cursor = page.next_cursor
        if cursor is None:
            return tasks


def _run_namespace(cfg: Any) -> Any:
    """The config of a one-shot run on Kafka: its own topic namespace, ``[<prefix>.]dagfold-run-<id>``.

    The run's scheduler, projector, workers and callback notifier then read only the run's own
    records (no earlier run's events to restore or project, no group shared with a deployment or
    with an earlier run's members), and the namespace's topics and groups are deleted at its end.
    To run a job on a deployment's topics, `dagfold submit` it to that deployment's API.
    """
    import dataclasses
    import uuid
    from urllib.parse import urlencode

    from dagfold.log.factory import split_url

    base, query, ours = split_url(cfg.log_url)
    outer = ours.get("prefix") or cfg.topic_prefix
    prefix = f"{outer}.dagfold-run-{uuid.uuid4().hex[:12]}" if outer else f"dagfold-run-{uuid.uuid4().hex[:12]}"
    settings = "&".join(x for x in (urlencode({**ours, "prefix": prefix}), query) if x)
    return dataclasses.replace(cfg, log_url=f"{base}?{settings}", topic_prefix=prefix)


def _run_stack(spec: dict[str, Any], log: str | None, data: Path | None, workers: int, timeout: float,
               as_json: bool, keep: bool = False, registry: Any = None) -> int:
    from dagfold.cli.follow import JobView, follow, local_events
    from dagfold.commands import submit_job
    from dagfold.services.stack import Stack, StackOptions

    tmp = None
    if data is None:
        tmp = Path(tempfile.mkdtemp(prefix="dagfold-run-"))
        data = tmp
    cfg = _config(log, data)
    on_kafka = cfg.log_url.startswith("kafka://")
    if on_kafka:
        cfg = _run_namespace(cfg)
    queues = tuple(sorted({t["queue"] for t in spec["tasks"]}))
    opts = StackOptions(workers=workers, queues=queues, api=False, delete_namespace_at_stop=on_kafka and not keep)
    if registry is not None:
        opts = replace(opts, registry=registry)
    stack = Stack(cfg, opts)
    job_id = spec["job_id"]
    code = 1
    try:
        stack.start()
        stack.sender.send(submit_job(spec, source="cli"))
        first = {"job_id": job_id, "name": spec.get("name"), "state": "submitted", "total_tasks": len(spec["tasks"]),
                 "finished_tasks": 0, "counts": {}}
        job = follow(local_events(stack.read_model, job_id, lambda: not stack.failed, timeout),
                     JobView(first, err, enabled=not as_json))
        if stack.failed:
            raise fail(f"a component failed: {stack.errors[0]!r}", 1)
        if job is None or job["state"] not in EXIT:
            raise fail(f"job {job_id} did not finish within {timeout}s", 1)
        tasks = _all_tasks(stack.read_model, job_id)
        failures = failure_details(tasks, lambda task: stack.read_model.get_attempts(job_id, task))
        print_summary(job, tasks, as_json, failures)
        code = EXIT[job["state"]]
        return code
    finally:
        stack.stop()
        if on_kafka and keep:
            err.print(f"topics kept under the prefix {cfg.topic_prefix} (`dagfold up --log "
                      f"{cfg.log_url} --data {data}` serves them)", markup=False, highlight=False)
        if tmp is not None:
            if keep:
                err.print(f"data kept in {tmp} (its state, projections and log; "
                          f"`dagfold up --data {tmp}` serves it)", markup=False, highlight=False)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                if code != 0 and not as_json:
                    err.print("the temporary data folder is deleted; `run --keep` keeps it", style="dim")


@app.command()
def run(file: Annotated[Path | None, typer.Argument(help="job spec (YAML or JSON)")] = None,
        wfcommons: Path | None = typer.Option(None, "--wfcommons", help="a WfCommons workflow JSON(.gz)"),
        time_scale: float = typer.Option(0.0, "--time-scale", help="sleep runtimeInSeconds x this (0: noop)"),
        log: LogOpt = None, data: DataOpt = None,
        workers: int = typer.Option(2, "--workers", min=1, help="worker threads per queue"),
        timeout: float = typer.Option(3600, "--timeout", min=0, help="give up after this many seconds"),
        as_json: JsonOpt = False,
        keep: bool = typer.Option(False, "--keep", help="keep the temporary data folder and print its path"),
        handlers: str | None = typer.Option(
            None, "--handlers", envvar="DAGFOLD_HANDLERS",
            help="handlers the workers run, comma-separated; default: noop, sleep, shell and handlers registered "
            "in Python (your own file, in a private stack without an API)"),
        verbose: VerboseOpt = False) -> None:
    """Run one job to its end in a temporary stack; exit 0 succeeded, 1 failed/cancelled, 2 rejected."""
    from dagfold.services.worker.handlers import default_registry

    _logging(verbose)
    # the invoker's own job file, in a private stack without an API: no tenant's command runs here
    registry, _ = _task_capabilities(handlers or ",".join([*default_registry().names(), "shell"]), [], None,
                                     None, [], allow_root=True)
    if (file is None) == (wfcommons is None):
        raise fail("give a job spec FILE or --wfcommons PATH")
    if wfcommons is not None:
        spec = _to_job_spec(_wfcommons_doc(wfcommons, time_scale))
    else:
        assert file is not None
        spec = _to_job_spec(_load_spec(file))
    raise typer.Exit(_run_stack(spec, log, data, workers, timeout, as_json, keep, registry))


@app.command()
def worker(queue: str = typer.Option("default", "--queue", help="the queue whose tasks this process runs"),
           log: LogOpt = None, data: DataOpt = None,
           concurrency: int = typer.Option(1, "--concurrency", min=1, help="tasks run at once (worker threads)"),
           handlers: str | None = typer.Option(None, "--handlers", envvar="DAGFOLD_HANDLERS", help=HANDLERS_HELP),
           handler_module: list[str] = typer.Option([], "--handler-module", help=HANDLER_MODULE_HELP),
           task_user: str | None = typer.Option(None, "--task-user", envvar="DAGFOLD_TASK_USER",
                                                help=TASK_USER_HELP),
           task_dir: Path | None = typer.Option(None, "--task-dir", envvar="DAGFOLD_TASK_DIR", help=TASK_DIR_HELP),
           task_env: list[str] = typer.Option([], "--task-env", help=TASK_ENV_HELP),
           allow_root_tasks: bool = typer.Option(False, "--allow-root-tasks", envvar="DAGFOLD_ALLOW_ROOT_TASKS",
                                                 help=ALLOW_ROOT_HELP),
           metrics_port: int | None = typer.Option(None, "--metrics-port", envvar="DAGFOLD_METRICS_PORT",
                                                   help="serve Prometheus /metrics on this port"),
           metrics_addr: str = typer.Option("127.0.0.1", "--metrics-addr", help="address for --metrics-port"),
           verbose: VerboseOpt = False) -> None:
    """Run workers for one queue in this process (use with --log kafka://...)."""
    import socket

    from dagfold.log import open_log
    from dagfold.services.worker.worker import Worker

    _logging(verbose)
    registry, runtime = _task_capabilities(handlers, handler_module, task_user, task_dir, task_env,
                                           allow_root_tasks)
    serve_metrics(metrics_port, metrics_addr)
    cfg = _config(log, data)
    lg = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    import os

    host = f"{socket.gethostname()}-{os.getpid()}"  # a new process is a new worker: its leases are its own
    threads = []
    workers = []
    for i in range(concurrency):
        w = Worker(lg, queue, f"{host}-{queue}-{i}", registry, config=cfg, runtime=runtime)
        workers.append(w)
        threads.append(w.start_thread(stop))
    try:
        while not stop.is_set() and any(t.is_alive() for t in threads):
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop.set()
    asked_to_stop = stop.is_set()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    for w in workers:
        w.close()
    lg.close()
    if not asked_to_stop:  # every worker thread died on its own: a supervisor must see a failure
        raise fail("every worker thread stopped (see the errors above)", 1)


@app.command()
def callbacks(log: LogOpt = None, data: DataOpt = None,
              metrics_port: int | None = typer.Option(None, "--metrics-port", envvar="DAGFOLD_METRICS_PORT",
                                                      help="serve Prometheus /metrics on this port"),
              metrics_addr: str = typer.Option("127.0.0.1", "--metrics-addr", help="address for --metrics-port"),
              verbose: VerboseOpt = False) -> None:
    """Run the job-end callback notifier (use with --log kafka://...; one per deployment, its ledger in --data).

    Settings: DAGFOLD_CALLBACK_SECRET (HMAC key; else one generated into --data), DAGFOLD_CALLBACK_TIMEOUT_S,
    _MAX_ATTEMPTS, _BASE_BACKOFF_S, _MAX_BACKOFF_S, _CONCURRENCY, _TENANT_CONCURRENCY, _ALLOW (docs/security.md).
    """
    from dagfold.log import open_log
    from dagfold.services.callbacks import CallbackNotifier
    from dagfold.services.callbacks.egress import log_ports

    _logging(verbose)
    serve_metrics(metrics_port, metrics_addr)
    cfg = _config(log, data)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    lg = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
    try:
        own = {*log_ports(cfg.log_url), *([metrics_port] if metrics_port else [])}
        notifier = CallbackNotifier(lg, cfg.data_dir, own_ports=own)
    except Exception as exc:  # a bad setting, or the ledger is in use by another process
        lg.close()
        raise fail(f"cannot start the callback notifier: {exc}", 1) from None
    run_until_stopped(notifier.run, notifier.close, lg.close)


# -- client commands ---------------------------------------------------------------
# They talk to a running API. --api-key (or DAGFOLD_API_KEY) is sent as a bearer
# token when the API has keys configured; every command takes --json.

def _follow_api(api: str, api_key: str | None, job: dict[str, Any], timeout: float, as_json: bool,
                json_lines: bool = False) -> dict[str, Any]:
    """Follow a job through the API's event stream with the live view (``watch``, ``submit --wait``)."""
    from dagfold.cli.follow import JobView, follow, sse_events

    job_id = job["job_id"]

    def print_line(event: tuple[str, dict[str, Any]]) -> None:
        print(json.dumps({"event": event[0], "data": event[1]}), flush=True)

    events = sse_events(api, job_id, _headers(api_key, api), timeout,
                        lambda: _request("GET", api, f"/v1/jobs/{seg(job_id)}", api_key))
    return follow(events, JobView(job, err, enabled=not as_json), print_line if json_lines else None)


def _job_failures(api: str, api_key: str | None, job_id: str, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:

    def attempts_of(task_id: str) -> list[dict[str, Any]]:
        path = f"/v1/jobs/{seg(job_id)}/tasks/{seg(task_id)}/attempts"
        return list(_request("GET", api, path, api_key)["attempts"])

    return failure_details(tasks, attempts_of)


@app.command()
def submit(file: Annotated[Path | None, typer.Argument(help="job spec (YAML or JSON)")] = None,
           wfcommons: Path | None = typer.Option(None, "--wfcommons", help="a WfCommons workflow JSON(.gz), any "
                                                 "schema 1.0-1.6"),
           time_scale: float = typer.Option(0.0, "--time-scale", help="with --wfcommons: sleep runtime x this "
                                            "(0: noop)"),
           wait: bool = typer.Option(False, "--wait", "--watch",
                                     help="follow the job to its end: live progress, then the summary "
                                          "with each failed task's reason and stderr"),
           api: ApiOpt = DEFAULT_API,
           api_key: KeyOpt = None, as_json: JsonOpt = False,
           timeout: float = typer.Option(3600, "--timeout", min=0, help="with --wait: give up after this many "
                                         "seconds")) -> None:
    """Submit a job spec (or a WfCommons workflow); with --wait, follow it to its end (exit code as for `run`).

    A repeated submission of the same spec (same job ID or idempotency key) returns the existing job.
    """
    if (file is None) == (wfcommons is None):
        raise fail("give a job spec FILE or --wfcommons PATH")
    if wfcommons is not None:
        body = json.dumps(_wfcommons_doc(wfcommons, time_scale)).encode()
        ctype = "application/json"
    else:
        assert file is not None
        try:
            body = file.read_bytes()
        except OSError as exc:
            raise fail(f"cannot read {file}: {exc}") from None
        ctype = "application/json" if file.suffix == ".json" else "application/yaml"
    res = _request("POST", api, "/v1/jobs", api_key, content=body, headers={"content-type": ctype})
    job_id = res["job_id"]
    if not wait:
        _print_json(res) if as_json else out.print(job_id)
        return
    if not as_json:
        err.print(f"submitted {file or wfcommons}: {job_id}", markup=False, highlight=False)
    first = {"job_id": job_id, "name": res.get("name"), "state": res.get("state", "submitted"),
             "total_tasks": res.get("total_tasks") or 0, "finished_tasks": 0, "counts": {}}
    job = _follow_api(api, api_key, first, timeout, as_json)
    if job["state"] not in EXIT:
        raise fail(f"job {job_id} did not finish within {timeout}s", 1)
    tasks = _get_all(api, f"/v1/jobs/{seg(job_id)}/tasks", "tasks", api_key)
    print_summary(job, tasks, as_json, _job_failures(api, api_key, job_id, tasks))
    raise typer.Exit(EXIT[job["state"]])


@app.command()
def status(job_id: JobArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
    """Show a job's state and counts."""
    job = resolve_job(api, api_key, job_id)
    if as_json:
        _print_json(job)
        return
    if job.get("name"):
        out.print(f"name: {job['name']}", markup=False, highlight=False)
    out.print(f"{job['job_id']}: {job['state']}  progress {job.get('progress', 0):.1f}%  "
              f"(tenant {job['tenant']}, {job['total_tasks']} tasks, retries {job.get('retries', 0)})")
    out.print(", ".join(f"{k}={v}" for k, v in (job.get("counts") or {}).items() if v))
    if job.get("marked_tasks"):
        out.print(f"marked succeeded by an operator, not run: {job['marked_tasks']} task(s) "
                  f"(`dagfold tasks {job['job_id']}` names them)")
    if job.get("reason"):
        out.print(f"reason: {job['reason']}")


class JobSort(enum.StrEnum):
    created = "created"
    duration = "duration"
    state = "state"
    tasks = "tasks"
    name = "name"
    tenant = "tenant"


_SORT_KEYS: dict[JobSort, Callable[[dict[str, Any]], Any]] = {
    JobSort.created: lambda j: j["created_ms"],
    JobSort.duration: lambda j: j.get("duration_ms") or 0,
    JobSort.state: lambda j: j["state"],
    JobSort.tasks: lambda j: j["total_tasks"],
    JobSort.name: lambda j: j.get("name") or "",
    JobSort.tenant: lambda j: j["tenant"],
}


def _id_table(*cols: str, ids: tuple[str, ...] = ("job",)) -> Table:
    """A table whose ID columns are never cut: an ID keeps its full width while the others fold."""
    t = _table(*cols)
    for c in t.columns:
        c.overflow = "fold"
        if c.header in ids:
            c.min_width = 36  # a UUID job ID on one line
    return t


@app.command()
def jobs(api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
         state: JobState | None = typer.Option(None, "--state", help="only jobs in this state"),
         tenant: str | None = typer.Option(None, "--tenant", help="only this tenant's jobs"),
         name: str | None = typer.Option(None, "--name", help="only jobs whose name contains this (any case)"),
         since: str | None = typer.Option(None, "--since", help="created at or after: an age (30s, 15m, 1h, 2d), "
                                          "ISO 8601 or epoch ms"),
         before: str | None = typer.Option(None, "--before", help="created before: an age, ISO 8601 or epoch ms"),
         sort: JobSort = typer.Option(JobSort.created, "--sort", help="order of the rows"),
         reverse: bool = typer.Option(False, "--reverse", help="reverse the order (created: oldest first)"),
         limit: int = typer.Option(50, "--limit", min=1, max=1000, help="at most this many jobs")) -> None:
    """List jobs, newest first, with filters; full IDs at any width.

    Example: dagfold jobs --state failed --since 1h --name nightly
    """
    params: dict[str, Any] = {"limit": limit}
    for k, v in (("state", state.value if state else None), ("tenant", tenant), ("name", name),
                 ("created_after", _time_arg(since, "--since")), ("created_before", _time_arg(before, "--before"))):
        if v:
            params[k] = v
    page = _request("GET", api, "/v1/jobs", api_key, params=params)
    rows = sorted(page["jobs"], key=_SORT_KEYS[sort], reverse=(sort in (JobSort.created, JobSort.duration)) != reverse)
    if as_json:
        _print_json({**page, "jobs": rows})
        return
    now = now_ms()
    if out.width >= 110:
        t = _id_table("job", "name", "tenant", "state", "progress", "tasks", "created", "duration", "reason")
        for j in rows:
            t.add_row(j["job_id"], j.get("name") or "", j["tenant"], j["state"], f"{j.get('progress', 0):.0f}%",
                      str(j["total_tasks"]), _ago(j["created_ms"], now), _dur(j.get("duration_ms")),
                      (j.get("reason") or "")[:60])
    else:  # narrow: name and reason under the ID, the fewest columns, no rules; the ID stays whole
        t = _id_table("job", "state", "tasks", "created")
        t.box = box.SIMPLE_HEAD
        t.pad_edge = False
        for j in rows:
            ident = Text(j["job_id"])
            if j.get("name"):
                ident.append("\n" + j["name"], style="bold")
            if j.get("reason"):
                ident.append("\n" + j["reason"][:120], style="dim")
            t.add_row(ident, j["state"], f"{j.get('finished_tasks', 0)}/{j['total_tasks']}",
                      _ago(j["created_ms"], now))
    out.print(t, soft_wrap=False)  # a table fits the width (soft wrap would let it run past)
    if page.get("next_cursor"):
        out.print("more jobs: raise --limit (up to 1000) or filter with --since/--before", style="dim")


@app.command()
def watch(job_id: JobArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
          timeout: float = typer.Option(0, "--timeout", help="give up after this many seconds (0: never)")) -> None:
    """Follow a job live (server-sent events): a progress bar and each failure as it happens.

    Exits when the job ends, with the exit code of `run` (0 succeeded, 1 failed/cancelled, 2 rejected).
    With --json, prints each event as one JSON line instead.
    """
    job = resolve_job(api, api_key, job_id)
    job_id = job["job_id"]
    job = _follow_api(api, api_key, job, timeout, as_json, json_lines=as_json)
    if job["state"] not in EXIT:
        raise fail(f"job {job_id} still {job['state']} after {timeout}s", 1)
    if not as_json:
        out.print(f"{job_id}: {job['state']}" + (f" — {job['reason']}" if job.get("reason") else ""))
    raise typer.Exit(EXIT[job["state"]])


@app.command()
def tasks(job_id: JobArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
          state: TaskState | None = typer.Option(None, "--state", help="only tasks in this state")) -> None:
    """List a job's tasks."""
    job_id = resolve_job(api, api_key, job_id)["job_id"]
    items = _get_all(api, f"/v1/jobs/{seg(job_id)}/tasks", "tasks", api_key, {"state": state.value} if state else None)
    if as_json:
        _print_json(items)
        return
    t = _id_table("task", "state", "attempt", "worker", "reason")
    for x in items:
        state = x["state"] + (" (marked)" if x["state"] == "succeeded" and x.get("marked_by") is not None else "")
        reason = x.get("reason") or ""
        if state.endswith("(marked)"):  # an operator's word, not a run: say whose
            reason = f"marked succeeded by {x['marked_by'] or 'an operator'}" + (
                f": {x['marked_reason']}" if x.get("marked_reason") else "")
        t.add_row(x["task_id"], state, str(x.get("attempt", "")), x.get("worker_id") or "", reason[:80])
    out.print(t)


@app.command()
def attempts(job_id: JobArg, task_id: Annotated[str, typer.Argument(help="task ID")],
             api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None,
             as_json: JsonOpt = False) -> None:
    """Show every attempt of a task: worker, times, outcome, reason, exit code and output tails."""
    job_id = resolve_job(api, api_key, job_id)["job_id"]
    items = _request("GET", api, f"/v1/jobs/{seg(job_id)}/tasks/{seg(task_id)}/attempts", api_key)["attempts"]
    if as_json:
        _print_json(items)
        return
    t = _id_table("#", "worker", "outcome", "started", "duration", "reason")
    for a in items:
        reason = a.get("reason") or ""
        if a.get("exit_code") is not None and "exit code" not in reason:
            reason += f" (exit code {a['exit_code']})"
        t.add_row(str(a["attempt"]), a.get("worker_id") or "", a["outcome"], _ts(a.get("started_ms")),
                  _dur(a.get("duration_ms")), reason[:100])
    out.print(t)
    last = items[-1] if items else None
    if last and last.get("stderr_tail"):
        out.print(f"stderr of attempt {last['attempt']}:", style="dim")
        out.print(last["stderr_tail"].rstrip(), markup=False, highlight=False)


@app.command()
def stuck(api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
          grace: float = typer.Option(5.0, "--grace", help="ignore deadlines passed less than this many seconds"),
          queued_longer_than: float | None = typer.Option(
              None, "--queued-longer-than", help="also list runnable tasks waiting longer than this (seconds)"),
          limit: int = typer.Option(100, "--limit", min=1, max=1000, help="at most this many tasks")) -> None:
    """List stuck tasks: past their lease, start-to-close, schedule-to-start or backoff deadline."""
    params: dict[str, Any] = {"grace_s": grace, "limit": limit}
    if queued_longer_than is not None:
        params["queued_longer_than_s"] = queued_longer_than
    res = _request("GET", api, "/v1/stuck", api_key, params=params)
    if as_json:
        _print_json(res)
        return
    if not res["tasks"]:
        out.print("nothing stuck")
        return
    t = _id_table("job", "task", "kind", "overdue", "state", "attempt", "worker", "queue")
    for x in res["tasks"]:
        t.add_row(x["job_id"], x["task_id"], x["kind"], _dur(x["overdue_s"] * 1000), x["state"], str(x["attempt"]),
                  x.get("worker_id") or "", x["queue"])
    out.print(t)


@app.command()
def queues(api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
    """Show dispatch queues: runnable (the depth), running and retrying tasks, oldest wait."""
    res = _request("GET", api, "/v1/queues", api_key)
    if as_json:
        _print_json(res)
        return
    t = _id_table("queue", "runnable", "running", "retrying", "oldest wait")
    for q in res["queues"]:
        age = q.get("oldest_runnable_age_s")
        t.add_row(q["queue"], str(q["runnable"]), str(q["running"]), str(q["retrying"]),
                  "" if age is None else _dur(age * 1000))
    out.print(t if res["queues"] else "no open tasks in any queue")


@app.command()
def tenants(api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
    """Show tenants: open jobs, running tasks, their share, GPUs (when the allocator runs), failures."""
    res = _request("GET", api, "/v1/tenants", api_key)
    if as_json:
        _print_json(res)
        return
    cols = ["tenant", "open jobs", "running", "share"] + (["gpus", "gpu share", "weight"] if res["cluster"] else [])
    t = _id_table(*cols, "retries", "failures")
    for x in res["tenants"]:
        row = [x["tenant"], str(x["open_jobs"]), str(x["running_tasks"]), f"{x['share']['running_tasks']:.1%}"]
        if res["cluster"]:
            row += [str(x["gpus"]), f"{x['share']['gpus'] or 0:.1%}", str(x["share"]["weight"] or "")]
        t.add_row(*row, str(x["retries"]), str(x["failures"]))
    out.print(t if res["tenants"] else "no tenants yet")


@app.command()
def cluster(api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
            nodes: bool = typer.Option(False, "--nodes", help="also list the nodes")) -> None:
    """Show GPU cluster occupancy (empty until the GPU allocator reports nodes)."""
    res = _request("GET", api, "/v1/cluster", api_key)
    node_list = _get_all(api, "/v1/cluster/nodes", "nodes", api_key) if nodes and res["available"] else []
    if as_json:
        _print_json({**res, "nodes": node_list} if nodes else res)
        return
    if not res["available"]:
        out.print("no GPU cluster data yet: the GPU allocator has not reported any node")
        return
    tot = res["totals"]
    out.print(f"GPUs: {tot['allocated']} of {tot['healthy_gpus']} healthy allocated ({tot['allocation_ratio']:.1%}), "
              f"{tot['free']} free, {tot['gpus'] - tot['healthy_gpus']} unhealthy; {tot['nodes']} nodes")
    t = _id_table("pool", "nodes", "gpus", "allocated", "unhealthy nodes")
    for p in res["pools"]:
        t.add_row(p["pool"], str(p["nodes"]), str(p["gpus"]), str(p["allocated"]), str(p["unhealthy_nodes"]))
    out.print(t)
    t = _id_table("tenant", "gpus", "share", "weight")
    for x in res["tenants"]:
        t.add_row(x["tenant"], str(x["gpus"]), "" if x.get("share") is None else f"{x['share']:.1%}",
                  str(x.get("weight") or ""))
    out.print(t)
    if node_list:
        t = _id_table("node", "pool", "type", "health", "gpus", "allocated", "tenants")
        for n in node_list:
            t.add_row(n["node_id"], n.get("pool") or "", n.get("gpu_type") or "", n["health"], str(n["gpus"]),
                      str(n["allocated"]), ", ".join(f"{k}:{v}" for k, v in (n.get("tenants") or {}).items()))
        out.print(t)


@app.command()
def failures(api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
             limit: int = typer.Option(20, "--limit", min=1, max=1000, help="at most this many recent failed "
                                       "attempts")) -> None:
    """Show failure reasons by class and the most recent failed attempts."""
    res = _request("GET", api, "/v1/failures", api_key, params={"limit": limit})
    if as_json:
        _print_json(res)
        return
    t = _id_table("reason", "count", "final", "last task", "example")
    for r in res["reasons"]:
        t.add_row(r["class"], str(r["count"]), str(r["final"]), f"{r['last_job_id']} {r['last_task_id']}",
                  r["sample_reason"][:60])
    out.print(t if res["reasons"] else "no failures")


# -- what a client asks of one job or task: POST /v1/jobs/JOB[/tasks/TASK]/ACTION --------------------------
TaskArg = Annotated[str, typer.Argument(help="task ID within the job", show_default=False)]
ReasonOpt = Annotated[str, typer.Option("--reason", help="why, for the job's history (at most 2,000 "
                                                                  "characters)")]


@dataclass(frozen=True, slots=True)
class JobAction:
    """A client command that asks the API one thing of a job (or of one of its tasks): ``name`` is the command
    and the last segment of its route; ``why`` says whether it takes ``--reason`` (sent as the body's
    ``reason``; without it the request has no body); ``task`` whether it names a task."""

    name: str
    help: str
    example: str
    why: bool = False
    task: bool = False


JOB_ACTIONS: tuple[JobAction, ...] = (
    JobAction("cancel", "Cancel a job.", "dagfold cancel long-running"),
    JobAction("pause", "Pause a running job: nothing new is dispatched, running tasks finish (`dagfold resume` "
              "runs it again).", "dagfold pause nightly-etl --reason 'warehouse maintenance'", why=True),
    JobAction("resume", "Resume a paused job: what became runnable while it was paused is dispatched.",
              "dagfold resume nightly-etl", why=True),
    JobAction("redrive", "Re-run a failed (or partial, or cancelled) job from its failed, skipped and cancelled "
              "tasks.", "dagfold redrive failing-demo"),
    JobAction("retry", "Run a failed (or skipped, cancelled) task again with a fresh retry budget; the tasks it "
              "skipped downstream run again too, and the job runs again (a failed job included).",
              "dagfold retry failing-demo bad --reason 'input fixed'", why=True, task=True),
    JobAction("mark-succeeded", "Record a failed, skipped or cancelled task as succeeded without running it (the "
              "history says who marked it); its downstream tasks then run.",
              "dagfold mark-succeeded failing-demo bad --reason 'loaded by hand'", why=True, task=True),
)
"""Every such command, in the order of ``dagfold --help``; each is registered from its row (help panel:
the client's; its example follows its help)."""


def _ask(action: JobAction, job_ref: str, task_id: str | None, reason: str | None, api: str, api_key: str | None,
         as_json: bool) -> None:
    job_id = resolve_job(api, api_key, job_ref)["job_id"]
    path = f"/v1/jobs/{seg(job_id)}" + (f"/tasks/{seg(task_id)}" if task_id is not None else "") + f"/{action.name}"
    res = _request("POST", api, path, api_key, **({"json": {"reason": reason}} if reason is not None else {}))
    if as_json:
        _print_json(res)
    elif task_id is None:
        out.print(f"{action.name} requested for {job_id}")
    else:
        out.print(f"{action.name.replace('-', ' ')} requested for {job_id} {task_id} "
                  f"(follow with `dagfold watch {job_id}`)")


def _register(action: JobAction) -> None:
    """``action`` as a command: JOB [TASK] [--reason], and the client's --api, --api-key, --json."""

    def on_job(job_id: JobArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
        _ask(action, job_id, None, None, api, api_key, as_json)

    def on_job_why(job_id: JobArg, reason: ReasonOpt = "", api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None,
                   as_json: JsonOpt = False) -> None:
        _ask(action, job_id, None, reason, api, api_key, as_json)

    def on_task(job_id: JobArg, task_id: TaskArg, reason: ReasonOpt = "", api: ApiOpt = DEFAULT_API,
                api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
        _ask(action, job_id, task_id, reason, api, api_key, as_json)

    command = on_task if action.task else on_job_why if action.why else on_job
    app.command(action.name, help=f"{action.help}\n\nExample: {action.example}", rich_help_panel=CLIENT)(command)


for _action in JOB_ACTIONS:
    _register(_action)


# --type choices: every event type of a job history (the jobs read model folds each of them)
EventType = enum.Enum("EventType", {k.rsplit(".", 1)[-1]: k.rsplit(".", 1)[-1]  # type: ignore[misc]
                                     for k in _JOB_APPLIERS}, type=str)


@app.command()
def history(job_id: JobArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
            types: list[EventType] = typer.Option([], "--type", help="only events of this type; repeatable"),
            task: str | None = typer.Option(None, "--task", help="only events of this task")) -> None:
    """Show a job's history: every event with its time (absolute and relative), task, attempt and detail.

    Example: dagfold history JOB --type TaskFailed --type TaskRetryScheduled
    """
    job_id = resolve_job(api, api_key, job_id)["job_id"]
    items = _get_all(api, f"/v1/jobs/{seg(job_id)}/history", "events", api_key)
    wanted = {t.value for t in types}
    items = [x for x in items if (not wanted or x["type"] in wanted) and (task is None or x.get("task_id") == task)]
    if as_json:
        _print_json(items)
        return
    now = now_ms()
    t = _id_table("time", "event", "task", "attempt", "detail")
    for x in items:
        t.add_row(_when(x["ts_ms"], now), x["type"].rsplit(".", 1)[-1], x.get("task_id") or "",
                  str(x.get("attempt") or ""), x.get("detail") or "")
    out.print(t)


# The other command groups register on the same app when this module is imported.
from dagfold.cli import admin as _admin  # noqa: E402,F401  (scheduler, replay, audit)
from dagfold.cli import gpu as _gpu  # noqa: E402,F401  (allocator, agent)
from dagfold.cli.sim import sim_app  # noqa: E402  (the allocator core in virtual time)

app.add_typer(sim_app, name="sim", help="Simulate the GPU allocator in virtual time (fgd, openb, day).")
from dagfold.cli.deadletters import dl_app  # noqa: E402  (list, show, resubmit dead letters)

app.add_typer(dl_app, name="deadletters")
from dagfold.cli.ux import finish, main  # noqa: E402  (global options, config, panels, examples, errors)

finish(app)
__all__ = ["app", "main"]
