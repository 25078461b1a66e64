"""The CLI's shell: global options (``--version``, ``--config``, ``--log-format``), ``dagfold config``,
help panels and an example for every command, and ``main``: user errors as one line that says what
to do (``-v`` shows the traceback).

``finish(app)`` runs once every command is registered (dagfold.cli.main calls it last), so
commands added in any module get their panel and example here, in one table; a command registered with
its own panel and example (the job actions of ``dagfold.cli.main.JOB_ACTIONS``) keeps them.
"""

from __future__ import annotations

import errno
import inspect
import os
import shutil
import sys
import traceback
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any

import typer
from rich.text import Text
from typer.core import TyperOption

from dagfold.cli.common import CLIENT, GPU, KAFKA, OPERATE, RUN_LOCALLY, app, err, fail, out
from dagfold.exceptions import FencedError

PANELS: dict[str, str] = {
    "run": RUN_LOCALLY, "up": RUN_LOCALLY, "serve": RUN_LOCALLY, "config": RUN_LOCALLY,
    "submit": CLIENT, "jobs": CLIENT, "status": CLIENT, "watch": CLIENT, "tasks": CLIENT, "attempts": CLIENT,
    "history": CLIENT,
    "stuck": OPERATE, "queues": OPERATE, "tenants": OPERATE, "failures": OPERATE, "replay": OPERATE,
    "audit": OPERATE, "deadletters": OPERATE,
    "scheduler": KAFKA, "worker": KAFKA, "callbacks": KAFKA, "traces": KAFKA,
    "allocator": GPU, "agent": GPU, "cluster": GPU, "sim": GPU,
}

EXAMPLES: dict[str, str] = {
    "run": "dagfold run examples/failing.yaml --keep",
    "up": "dagfold up --data .dagfold --port 8080 --workers 4",
    "serve": "dagfold serve /tmp/replayed --port 8081",
    "config": "DAGFOLD_PORT=9090 dagfold config",
    "submit": "dagfold submit examples/diamond.yaml --wait",
    "jobs": "dagfold jobs --state failed --since 1h --sort duration",
    "status": "dagfold status 3f2a   (a unique ID prefix, or the job's name)",
    "watch": "dagfold watch long-running",
    "tasks": "dagfold tasks failing-demo --state failed",
    "attempts": "dagfold attempts failing-demo bad",
    "history": "dagfold history failing-demo --type TaskFailed",
    "stuck": "dagfold stuck --queued-longer-than 300",
    "queues": "dagfold queues --json",
    "tenants": "dagfold tenants",
    "failures": "dagfold failures --limit 50",
    "replay": "dagfold replay --data .dagfold --out /tmp/replayed --verify",
    "audit": "dagfold audit JOB --data .dagfold --format csv > job.csv",
    "deadletters": "dagfold deadletters --data .dagfold",
    "scheduler": "dagfold scheduler --log kafka://127.0.0.1:9092 --data /var/lib/dagfold/s0 --instance s0",
    "worker": "dagfold worker --log kafka://127.0.0.1:9092 --queue default --concurrency 4",
    "callbacks": "dagfold callbacks --log kafka://127.0.0.1:9092 --data /var/lib/dagfold/callbacks",
    "traces": "OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318 dagfold traces --log kafka://127.0.0.1:9092",
    "allocator": "dagfold allocator --log kafka://127.0.0.1:9092 --pool default",
    "agent": "dagfold agent --log kafka://127.0.0.1:9092 --pool default --node gpu-01 --simulate",
    "cluster": "dagfold cluster --nodes",
    "sim": "dagfold sim day --out /tmp/day.json",
}


class LogFormat(StrEnum):
    text = "text"
    json = "json"


def _version() -> str:
    try:
        return metadata.version("dagfold")
    except metadata.PackageNotFoundError:  # run from a checkout without installing
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def _show_version(value: bool) -> None:
    if value:
        out.print(f"dagfold {_version()}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                       help="print the version and exit"),
          config: Path | None = typer.Option(None, "--config", show_default=False,
                                             help="settings file (TOML; keys as in `dagfold config`) "
                                                  "(env DAGFOLD_CONFIG)"),
          log_format: LogFormat | None = typer.Option(None, "--log-format", show_default=False,
                                                      help="process logs as text or JSON lines (job, task, attempt, "
                                                           "partition, offset fields) (default: text; env "
                                                           "DAGFOLD_LOG_FORMAT)")) -> None:
    """dagfold: an event-sourced scheduler for DAG and GPU jobs.

    Settings come from flags, then DAGFOLD_* variables, then the --config file, then defaults
    (`dagfold config` lists them all). Exit codes: 0 success, 1 job failed/cancelled or a request
    failed, 2 rejected or bad input.
    """
    # Handed to every command through the environment they resolve settings from (flag > env).
    if config is not None:
        os.environ["DAGFOLD_CONFIG"] = str(config)
    if log_format is not None:
        os.environ["DAGFOLD_LOG_FORMAT"] = log_format.value


@app.command("config")
def config_cmd(as_json: bool = typer.Option(False, "--json", help="print JSON"),
               markdown: bool = typer.Option(False, "--markdown", help="print the docs' table (Markdown)")) -> None:
    """Show every setting: value, source (env, file, default), flag, environment variable, meaning."""
    from dagfold.settings import (
        SettingsError,
        load_settings,
        settings_file,
        settings_markdown,
        settings_rows,
        source_of,
    )

    if markdown:
        sys.stdout.write(settings_markdown())
        return
    try:
        settings = load_settings()
    except SettingsError as exc:
        raise fail(str(exc)) from None
    path = settings_file()
    rows: list[dict[str, Any]] = []
    for r in settings_rows():
        value = getattr(settings, r["setting"])
        secret = r["setting"] in ("api_key", "api_keys", "api_token", "callback_secret", "kafka_sasl_password") \
            and value
        rows.append({**r, "value": "***" if secret else ("" if value is None else str(value)),
                     "source": source_of(r["setting"], {}, path)})
    if as_json:
        out.print_json(data=rows)
        return
    sys.stdout.write(config_text(rows, path, shutil.get_terminal_size((80, 24)).columns))


GROUP_TITLES = {"core": "log and storage", "scheduler": "scheduler", "api": "API and dashboard",
                "client": "clients", "process": "every process", "callbacks": "job-end callbacks"}


def config_text(rows: list[dict[str, Any]], path: Any, columns: int = 80) -> str:
    """``dagfold config``: the settings grouped, one block each (variable, value, source, flag, then the
    meaning wrapped), readable at 80 columns; then tracing, from the OpenTelemetry ``OTEL_*`` variables."""
    import functools
    import textwrap

    from dagfold.tracing import settings_summary

    width = max(40, min(columns, 100))
    wrap = functools.partial(textwrap.wrap, width=width, break_on_hyphens=False, break_long_words=False)
    lines = ["dagfold settings (flag > environment > file > default)" + (f"; file {path}" if path else "")]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get("group") or "core", []).append(r)
    for group, members in groups.items():
        lines += ["", GROUP_TITLES.get(group, group)]
        for r in members:
            head = f"  {r['env']} = {r['value'] or '(unset)'}"
            where = f"[{r['source']}{', ' + r['flag'] if r['flag'] else ''}]"
            lines += ([f"{head}  {where}"] if len(head) + 2 + len(where) <= width else
                      wrap(head, subsequent_indent="      ") + ["      " + where])
            lines += wrap(r["meaning"], initial_indent="      ", subsequent_indent="      ")
    lines += ["", "tracing (OpenTelemetry: the OTEL_* variables of its specification)"]
    lines += [f"  {k} = {v}" for k, v in settings_summary().items()]
    return "\n".join(lines) + "\n"


def _flag_display_type(self: TyperOption, ctx: Any) -> str | None:
    # A plain flag takes no value: show no "<bool>" after it (typer shows the type of every option).
    if self.is_flag and not self.count:
        return None
    return _typer_display_type(self, ctx)


_typer_display_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]


def finish(root: typer.Typer) -> None:
    """Give every registered command its help panel and example (after all modules registered theirs)."""
    for info in root.registered_commands:
        callback = info.callback
        name = info.name or (callback.__name__.replace("_", "-") if callback else "")
        info.rich_help_panel = info.rich_help_panel or PANELS.get(name, OPERATE)
        text = info.help or (inspect.getdoc(callback) if callback else "") or ""
        if name in EXAMPLES and "Example" not in text:
            info.help = f"{text}\n\nExample: {EXAMPLES[name]}"
    for group in root.registered_groups:
        name = group.name or ""
        group.rich_help_panel = group.rich_help_panel or PANELS.get(name, OPERATE)
        if group.typer_instance is not None and name in EXAMPLES:
            ti = group.typer_instance.info
            base = group.help or ti.help or ""
            if "Example" not in str(base):
                group.help = f"{base}\n\nExample: {EXAMPLES[name]}"


# -- errors ------------------------------------------------------------------------------------------
def explain(exc: BaseException) -> str:
    """One line for an error a user can fix: what happened and what to do."""
    text = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    low = text.lower()
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE or "address already in use" in low:
        return (f"{text.rstrip('.')}: the port is in use (another `dagfold up`?); stop that process, or pass "
                "another --port (DAGFOLD_PORT)")
    from dagfold.exceptions import disk_full

    if disk_full(exc) or "no space left on device" in low:
        return f"disk full: {text.splitlines()[0] if text else exc!r}; free some space, or pass --data on another disk"
    if "lock" in low and ("is another dagfold using it" in low or "/lock" in low):
        folder = text.split(" at ", 1)[1].split(" ", 1)[0] if " at " in text else "the data folder"
        return (f"{folder} is in use by another dagfold process (a running `dagfold up` or `run`?); stop it, "
                "or pass another --data")
    if "cluster metadata" in low or "broker transport failure" in low or "_transport" in low:
        return (f"{text.splitlines()[0]}: no Kafka broker answers there; start one (`make kafka-up`) or fix "
                "--log (DAGFOLD_LOG)")
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename or text}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


GLOBAL_OPTIONS = ("--log-format", "--config")


def _hoist_globals(args: list[str]) -> list[str]:
    """``dagfold up --log-format json`` as well as ``dagfold --log-format json up``: the app's own options
    move in front of the command (click takes a group's options only there)."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest += args[i:]
            break
        if a in GLOBAL_OPTIONS and i + 1 < len(args):
            front += args[i:i + 2]
            i += 2
            continue
        if a.split("=", 1)[0] in GLOBAL_OPTIONS and "=" in a:
            front.append(a)
        else:
            rest.append(a)
        i += 1
    return front + rest


# The exit status of a writer fenced by a newer instance of itself: no crash, the role is held elsewhere.
# A supervisor that restarts on failure should not restart on it (systemd: RestartPreventExitStatus=75),
# or the restarted instance fences the holder, whose restart fences it again. 75 is sysexits' EX_TEMPFAIL.
EXIT_FENCED = 75


def main(argv: list[str] | None = None) -> None:
    """The ``dagfold`` entry point: the app, with user errors as one line (``-v`` or DAGFOLD_DEBUG=1: the
    traceback too)."""
    args = _hoist_globals(list(sys.argv[1:] if argv is None else argv))
    verbose = "-v" in args or "--verbose" in args or os.environ.get("DAGFOLD_DEBUG") == "1"
    app.pretty_exceptions_enable = False
    try:
        app(args=args, prog_name="dagfold")
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
    except FencedError as exc:  # a writer (scheduler, allocator) that a newer instance of itself took over
        err.print(Text.assemble(("fenced:", "yellow"), " a newer instance of this writer took over its log "
                                f"transactions ({exc}); this one stands down (exit {EXIT_FENCED})"))
        raise SystemExit(EXIT_FENCED) from None
    except Exception as exc:  # a user error or a bug: one line; the traceback with -v
        if verbose:
            traceback.print_exc()
        err.print(Text.assemble(("error:", "red"), f" {explain(exc)}"))  # the consoles read no markup
        if not verbose:
            err.print(Text("(-v shows the traceback)", style="dim"))
        raise SystemExit(1) from None
