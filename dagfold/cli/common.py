"""What every ``dagfold`` command shares: the Typer app, consoles, options, errors, the
service loop, and the HTTP client helpers of the client commands.

The CLI is the top layer: it imports services and projections, and nothing imports it.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dagfold import clock
from dagfold.config import Config
from dagfold.rules import path_segment


class _App(typer.Typer):
    """The Typer app, and the last net under every command: an HTTP failure anywhere (a stream cut mid-way,
    a malformed --api URL) is one line on stderr and exit 1, never a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
            err.print(Text.assemble(("error:", "red"), f" the API request failed: {exc}"))
            raise SystemExit(1) from None


class _Console(Console):
    """A rich console whose size is the terminal's, or COLUMNS / LINES, as they are at each print.

    rich reads COLUMNS and LINES at each print only if they were unset when the console was made; set then, it
    keeps that size for good. The CLI's consoles are made when dagfold.cli is imported, so a process that runs
    several commands (a program embedding the CLI, the tests' CliRunner, whose env= is set per invocation) kept
    the environment's size at import: under pytest-xdist, 80 columns whatever the invocation asked, because
    pytest imports readline in the controller, GNU readline sets COLUMNS=80 and LINES=24 in the C environment of
    a process without a terminal, and every worker inherits them. A `dagfold` process reads the same environment
    either way."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if kwargs.get("width") is None and kwargs.get("height") is None:
            self._width = self._height = None  # rich's own "not fixed": size is read at each print


app = _App(add_completion=False, no_args_is_help=True,
           help="dagfold: an event-sourced scheduler for DAG and GPU jobs.")
# soft_wrap: lines are never broken at the console width. Piped to a file or a script, rich
# assumes 80 columns and split "submitted <long file name>: <job id>" across two lines.
# markup=False: what the consoles print is data (tenant names, reasons, task IDs) and is never read as rich
# markup (a tenant named "[/bold]" crashed every table); styling goes through Text/style= or markup=True.
out = _Console(soft_wrap=True, markup=False)
err = _Console(stderr=True, soft_wrap=True, markup=False)

LogOpt = Annotated[str | None, typer.Option("--log", help="log backend: embedded or kafka://HOST:PORT "
                                             "(default: embedded; env DAGFOLD_LOG)", show_default=False)]
DataOpt = Annotated[Path | None, typer.Option("--data", help="data folder (state, projections, embedded log)")]
ApiOpt = Annotated[str, typer.Option("--api", envvar="DAGFOLD_API", help="API base URL")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
VerboseOpt = Annotated[bool, typer.Option("-v", "--verbose", help="log at INFO; on an error, the traceback")]
DEFAULT_API = "http://127.0.0.1:8080"

# the help panels of ``dagfold --help`` (each command's: ``dagfold.cli.ux.PANELS``, or its own registration's)
RUN_LOCALLY = "Run locally"
CLIENT = "Client (talks to a running API)"
OPERATE = "Operate"
KAFKA = "Kafka deployment (one process each)"
GPU = "GPU"
EXIT = {"succeeded": 0, "succeeded_partial": 0, "failed": 1, "cancelled": 1, "rejected": 2}


def fail(msg: str, code: int = 2) -> typer.Exit:
    err.print(Text.assemble(("error:", "red"), " ", msg))
    return typer.Exit(code)


seg = path_segment  # every ID the CLI puts into a URL path goes through it


def _logging(verbose: bool) -> None:
    """Process logs at INFO with -v (else WARNING), as text or JSON lines (DAGFOLD_LOG_FORMAT, --log-format)."""
    from dagfold.logs import configure
    from dagfold.settings import SettingsError, load_settings

    try:
        fmt = load_settings().log_format
    except SettingsError as exc:
        raise fail(str(exc)) from None
    configure(logging.INFO if verbose else logging.WARNING, fmt)


def _config(log: str | None, data: Path | None, port: int | None = None) -> Config:
    """The process's config: these flags (None: not given) > DAGFOLD_* > settings file > defaults."""
    from dagfold.settings import SettingsError

    try:
        return Config.from_env(log_url=log, data_dir=data, api_port=port)
    except SettingsError as exc:
        raise fail(str(exc)) from None


def serve_metrics(port: int | None, addr: str) -> None:
    """Serve Prometheus /metrics on ``addr:port`` when a port is given; exit 1 if it cannot."""
    if port is None:
        return
    from dagfold import metrics

    try:
        metrics.serve(port, addr)
    except OSError as exc:
        raise fail(f"cannot serve metrics on {addr}:{port}: {exc}", 1) from None


def run_until_stopped(run: Callable[[threading.Event], None], *closing: Callable[[], None]) -> None:
    """Run a service loop until SIGTERM or Ctrl-C, then close what it holds (the log last)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        for close in closing:
            close()


KeyOpt = Annotated[str | None, typer.Option("--api-key", envvar="DAGFOLD_API_KEY",
                                            help="API key (Authorization: Bearer); needed when the API has keys")]


def _api_key(api_key: str | None, api: str | None = None) -> str | None:
    """The API key, else the local token ``dagfold up --token`` stored for ``api``."""
    if not api_key and api is not None:
        import os

        from dagfold.localtoken import read_token

        api_key = os.environ.get("DAGFOLD_API_TOKEN") or read_token(api)
    return api_key or None


def _headers(api_key: str | None, api: str | None = None) -> dict[str, str]:
    """The Authorization header (``_api_key``), for the event stream (``follow.py``)."""
    key = _api_key(api_key, api)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _call(method: str, api: str, path: str, api_key: str | None = None, **kw: Any) -> httpx.Response:
    """One request through the SDK's REST client (``dagfold.client.RestClient``: the CLI speaks to the API as
    upstream code does), without its retries: the answer whatever its status. An httpx error, or the
    client's ``unreachable`` with the transport error as its cause, is raised as httpx's."""
    from dagfold.client import ClientError, RestClient

    try:
        with RestClient(api, _api_key(api_key, api), timeout_s=30, retries=0) as client:
            return client.request(method, path, **kw)
    except ClientError as exc:
        if isinstance(exc.__cause__, httpx.HTTPError):
            raise exc.__cause__ from None
        raise


def _request(method: str, api: str, path: str, api_key: str | None = None, **kw: Any) -> Any:
    try:
        r = _call(method, api, path, api_key, **kw)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise fail(f"cannot reach the API at {api}: {exc}"
                   + ("; start one with `dagfold up`, or pass --api (DAGFOLD_API)"
                      if isinstance(exc, httpx.ConnectError) else ""), 1) from None
    if r.status_code >= 400:
        try:
            e = r.json()["error"]
            msg = f"{e['code']}: {e['reason']}"
        except Exception:
            msg = r.text[:500]
        if r.status_code == 429 and r.headers.get("retry-after"):
            msg += f" (retry after {r.headers['retry-after']} s)"
        raise fail(f"HTTP {r.status_code}: {msg}", 2 if r.status_code in (400, 413, 422) else 1)
    try:
        return r.json()
    except ValueError:
        raise fail(f"the API at {api} answered {r.status_code} with a body that is not JSON", 1) from None


def _get_all(api: str, path: str, key: str, api_key: str | None = None,
             params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        q: dict[str, Any] = {**(params or {}), "limit": 1000}
        if cursor:
            q["cursor"] = cursor
        page = _request("GET", api, path, api_key, params=q)
        items.extend(page[key])
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def _print_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


def _ts(ms: int | None) -> str:
    if ms is None:
        return ""
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def _dur(ms: int | float | None) -> str:
    if ms is None:
        return ""
    s = ms / 1000
    if s < 60:
        return f"{s:.2f}s" if s < 10 else f"{s:.1f}s"
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s < 3600 else f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _table(*cols: str) -> Table:
    t = Table()
    for c in cols:
        t.add_column(c, justify="right" if c in {"#", "runnable", "running", "retrying", "tasks", "count", "gpus",
                                                  "overdue", "open jobs", "allocated", "free", "share",
                                                  "progress", "duration", "attempt"} else "left")
    return t



def _ago(ms: int | None, now_ms: int | None = None) -> str:
    """How long ago, in words a person reads at a glance: ``12s ago``, ``3m ago``, ``2h ago``, ``4d ago``
    (``in 5s`` for a time still ahead)."""
    if ms is None:
        return ""
    delta = ((now_ms if now_ms is not None else clock.now_ms()) - ms) / 1000
    s = abs(delta)
    text = (f"{s:.0f}s" if s < 60 else f"{s // 60:.0f}m" if s < 3600 else f"{s // 3600:.0f}h" if s < 86400
            else f"{s // 86400:.0f}d")
    return f"{text} ago" if delta >= 0 else f"in {text}"


def _when(ms: int | None, now_ms: int | None = None) -> str:
    """A time absolute and relative: ``08:40:06.123 (3m ago)`` today, with the date on other days."""
    if ms is None:
        return ""
    now = now_ms if now_ms is not None else clock.now_ms()
    day = time.strftime("%Y-%m-%d", time.localtime(ms / 1000))
    today = time.strftime("%Y-%m-%d", time.localtime(now / 1000))
    hhmm = _ts(ms)
    return f"{hhmm if day == today else day + ' ' + hhmm} ({_ago(ms, now)})"


_UNITS_S = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _time_arg(value: str | None, option: str) -> str | None:
    """A time option as the API takes it: a relative age (``90s``, ``15m``, ``1h``, ``2d``, ``1w``: that long
    ago) becomes epoch ms; epoch ms and ISO 8601 pass through for the API to check."""
    import re

    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)\s*", value)
    if m:
        return str(int(clock.now_ms() - float(m.group(1)) * _UNITS_S[m.group(2)] * 1000))
    if value.strip().isdigit() or value.strip()[:4].isdigit():
        return value.strip()
    raise fail(f"{option} {value!r}: give an age (30s, 15m, 1h, 2d, 1w), an ISO 8601 time or epoch ms")


def resolve_job(api: str, api_key: str | None, ref: str) -> dict[str, Any]:
    """The job a user means by ``ref``: its full ID, a unique prefix of it (as git, docker and kubectl take),
    or its exact name when one job has it. Ambiguity is an error that lists the candidates."""

    if not ref:
        raise fail("give a job ID (or a unique prefix of it, or the job's name)")
    try:
        r: httpx.Response | None = _call("GET", api, f"/v1/jobs/{seg(ref)}", api_key)
    except httpx.HTTPError:
        r = None
    if r is not None and r.status_code == 200:
        return dict(r.json())
    if r is not None and r.status_code != 404:
        return dict(_request("GET", api, f"/v1/jobs/{seg(ref)}", api_key))  # its error, in one line
    by_id = _request("GET", api, "/v1/jobs", api_key, params={"id_prefix": ref, "limit": 10})["jobs"]
    if len(by_id) == 1:
        return dict(by_id[0])
    if not by_id:
        named = _request("GET", api, "/v1/jobs", api_key, params={"name": ref, "limit": 50})["jobs"]
        exact = [j for j in named if j.get("name") == ref]  # newest first
        if exact:
            if len(exact) > 1:  # names are not unique: the newest is the one just submitted
                err.print(f"{len(exact)}{'+' if len(named) == 50 else ''} jobs named {ref!r}: "
                          f"the newest, {exact[0]['job_id']}", style="dim", markup=False, highlight=False)
            return dict(exact[0])
    if not by_id:
        raise fail(f"no job {ref!r}: not an ID, an ID prefix or a job name (`dagfold jobs` lists them)", 1)
    listed = ", ".join(j["job_id"] + (f" ({j['name']})" if j.get("name") else "") for j in by_id[:5])
    raise fail(f"{ref!r} is ambiguous: {listed}{', ...' if len(by_id) > 5 else ''}; give more of the ID")


# The task processes' flags, shared by `dagfold worker`, `dagfold up` and `dagfold agent`
ALLOW_ROOT_HELP = ("run task processes (shell tasks, GPU jobs) as root when no --task-user is given; without it "
                   "such a start is refused, since root tasks read every secret of the host")
TASK_ENV_HELP = ("NAME (copied from this process) or NAME=VALUE: a variable task processes get; they get only "
                 "PATH, LANG, LC_ALL, TZ, these and their DAGFOLD_* variables. Repeatable")


def task_runtime(task_user: str | None, task_dir: Path | None, task_env: list[str], allow_root: bool, *,
                 runs_processes: bool) -> Any:
    """The ``TaskRuntime`` of the flags --task-user, --task-dir, --task-env, --allow-root-tasks (workers and
    agents alike; a bad flag is a one-line error)."""
    import os

    from dagfold.services.worker.handlers import PASS_ENV_DEFAULT, TaskRuntime

    pass_env, set_env = list(PASS_ENV_DEFAULT), {}
    for item in task_env:
        name, eq, value = item.partition("=")
        if not name.isidentifier():
            raise fail(f"--task-env {item!r}: give NAME or NAME=VALUE")
        if eq:
            set_env[name] = value
        elif name in os.environ:
            pass_env.append(name)
    runtime = TaskRuntime(pass_env=tuple(pass_env), set_env=set_env, user=task_user or None,
                          work_root=task_dir, allow_root=allow_root)
    try:
        runtime.check(runs_processes=runs_processes)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if runs_processes:  # tasks run commands: keep this process's environment out of their reach
        runtime.protect_process()
    return runtime
