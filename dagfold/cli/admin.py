"""Operator commands that run against the log and data folders directly.

``scheduler`` runs one scheduler instance (scale-out: start several with
different ``--instance`` on Kafka, they share the partitions); ``replay`` and
``audit`` read the log offline, next to a running stack. Registered on the main
``dagfold`` app by ``dagfold.cli``.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dagfold.cli.common import DataOpt, LogOpt, VerboseOpt, _config, _logging, app, err, fail, out, run_until_stopped

if TYPE_CHECKING:
    from dagfold.config import Config
    from dagfold.log import Log


def _parse_ts(value: str | None) -> int | None:
    """Milliseconds since the epoch, from an ISO-8601 time or a number of ms."""
    if value is None:
        return None
    if value.isascii() and value.isdigit():  # isdigit alone accepts "²", which int() refuses
        return int(value)
    try:
        return int(datetime.fromisoformat(value).timestamp() * 1000)
    except ValueError:
        raise fail(f"bad time {value!r}: use ISO-8601 (2026-11-30T12:00:00) or epoch ms") from None


@app.command()
def scheduler(log: LogOpt = None, data: DataOpt = None,
              instance: str = typer.Option("0", "--instance", help="unique per scheduler process"),
              verbose: VerboseOpt = False) -> None:
    """Run one scheduler instance; several instances in one Kafka cluster share the partitions."""
    from dagfold.log import open_log
    from dagfold.services.scheduler.runner import SchedulerRunner

    _logging(verbose)
    cfg = _config(log, data)
    lg = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
    run_until_stopped(SchedulerRunner(lg, cfg, instance).run, lg.close)


@app.command()
def traces(log: LogOpt = None, data: DataOpt = None, verbose: VerboseOpt = False) -> None:
    """Export each job's spans over OTLP, built from the events (needs OTEL_EXPORTER_OTLP_ENDPOINT).

    What `dagfold up` runs when tracing is on; several processes share the partitions (group dagfold-traces).
    """
    from dagfold.log import open_log
    from dagfold.services.tracing import SpanExporter
    from dagfold.tracing import otlp_enabled

    _logging(verbose)
    if not otlp_enabled():
        raise fail("tracing is off: set OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    cfg = _config(log, data)
    lg = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
    exporter = SpanExporter(lg)
    run_until_stopped(exporter.run, exporter.close, lg.close)


@app.command()
def replay(out_dir: Path = typer.Option(..., "--out", help="fresh folder for the rebuilt state"),
           log: LogOpt = None, data: DataOpt = None,
           from_ts: str | None = typer.Option(None, "--from", help=(
               "report the events at or after this time (ISO or ms); state is still rebuilt from the start")),
           to_ts: str | None = typer.Option(None, "--to", help="stop at this time (ISO or ms): the state as of then"),
           job: str | None = typer.Option(None, "--job", help="only this job"),
           events_file: Path | None = typer.Option(None, "--events", help=(
               "also write each event of the window to this file, one JSON object a line")),
           verify_live: bool = typer.Option(False, "--verify", help="compare with the live state in --data"),
           as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Rebuild scheduler state and the read model from the events log into --out.

    State is always rebuilt from the start of the log (a job accepted before --from is kept);
    --from/--to choose the window of events reported, --to also ends the replay (state as of then).
    Serve the result read-only with `dagfold serve OUT`.
    """
    import json

    from dagfold.config import EVENTS
    from dagfold.log import LogRecord, TopicPartition
    from dagfold.services.scheduler.replay import ReplayFilter, verify
    from dagfold.services.scheduler.replay import replay as do_replay

    cfg = _config(log, data)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise fail(f"{out_dir} is not empty; replay needs a fresh folder")
    try:
        filt = ReplayFilter(_parse_ts(from_ts), _parse_ts(to_ts), job)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if verify_live and filt.to_ms is not None:
        raise fail("--verify compares with the live state, which is past --to; drop --to")
    lg = _open_read_only(cfg)
    sink = None
    fh = None
    if events_file is not None:
        try:
            fh = events_file.open("w")
        except OSError as exc:
            lg.close()
            raise fail(f"cannot write {events_file}: {exc}") from None

        def sink(r: LogRecord, ev: dict[str, object]) -> None:
            assert fh is not None
            row = {"partition": r.partition, "offset": r.offset, "timestamp_ms": r.timestamp_ms,
                   "job_id": r.key.decode(errors="replace") if r.key else None,
                   **{k: (v.hex() if isinstance(v, bytes) else v) for k, v in ev.items()}}
            fh.write(json.dumps(row, default=str) + "\n")
    try:
        total = sum(lg.end_offsets([TopicPartition(EVENTS, p) for p in range(cfg.partitions)]).values())
        t0 = time.perf_counter()
        with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, disable=as_json) as bar:
            task = bar.add_task("events", total=total)
            result = do_replay(lg, out_dir, cfg.partitions, filt, lambda n: bar.advance(task, n),
                               on_window_event=sink)
        dt = time.perf_counter() - t0
    finally:
        lg.close()
        if fh is not None:
            fh.close()
    by_type = dict(sorted(result.window_by_type.items()))
    window = {"from_ms": filt.from_ms, "to_ms": filt.to_ms, "events": result.window,
              "jobs": len(result.window_jobs), "by_type": by_type,
              "offsets": {str(p): list(r) for p, r in sorted(result.window_offsets.items())}}
    report: dict[str, object] = {"applied": result.total, "seconds": round(dt, 3),
                                 "events_per_s": round(result.total / dt) if dt else None,
                                 "undecodable": result.skipped_undecodable, "out": str(out_dir),
                                 "window": window}
    diffs = []
    if verify_live:
        diffs = verify(cfg.data_dir, out_dir, cfg.partitions, job, lg.partition_for)
        report["differences"] = [d.__dict__ for d in diffs]
    if as_json:
        out.print_json(json.dumps(report))
    else:
        out.print(f"replayed {result.total} events in {dt:.2f}s into {out_dir}")
        if filt.from_ms is not None or filt.to_ms is not None:
            out.print(f"window [{from_ts or 'start'}, {to_ts or 'end'}]: {result.window} events of "
                      f"{len(result.window_jobs)} job(s): "
                      + (", ".join(f"{k}={v}" for k, v in by_type.items()) or "none"))
        if verify_live:
            out.print("verify: no difference" if not diffs else f"verify: {len(diffs)} difference(s)")
            for d in diffs:
                out.print(f"  partition {d.partition} job {d.job_id or '-'}: {d.what}")
    if diffs:
        raise typer.Exit(1)


def _open_read_only(cfg: Config) -> Log:
    """The configured log opened for reading (replay, audit), or a one-line error (status 1)."""
    from dagfold.exceptions import DagfoldError
    from dagfold.log import open_log

    try:
        return open_log(cfg.log_url, cfg.data_dir, read_only=True, prefix=cfg.topic_prefix)
    except DagfoldError as exc:
        raise fail(str(exc), 1) from None


class AuditFormat(StrEnum):
    json = "json"
    csv = "csv"


@app.command()
def audit(job_id: Annotated[str, typer.Argument(help="the job's full ID")], log: LogOpt = None, data: DataOpt = None,
          fmt: AuditFormat = typer.Option(AuditFormat.json, "--format", help="output format"),
          since: str | None = typer.Option(None, "--since", help="only records at or after (ISO or ms)"),
          until: str | None = typer.Option(None, "--until", help="only records at or before (ISO or ms)"),
          trace: bool = typer.Option(False, "--trace", help="the job's spans instead (JSON), rebuilt from "
                                     "its events; exported over OTLP too when OTEL_EXPORTER_OTLP_ENDPOINT is set"),
          ) -> None:
    """Export a job's complete timeline: every command and event with partition, offset and cause."""
    from dagfold.audit import job_timeline, to_csv, to_json

    if trace:
        _audit_trace(job_id, log, data)
        return

    since_ms, until_ms = _parse_ts(since), _parse_ts(until)
    if since_ms is not None and until_ms is not None and since_ms > until_ms:
        raise fail(f"the window is empty: --since ({since}) is after --until ({until})")
    cfg = _config(log, data)
    lg = _open_read_only(cfg)
    try:
        rows = job_timeline(lg, job_id, cfg.partitions)
    finally:
        lg.close()
    if not rows:
        raise fail(f"no record of job {job_id} in the log", 1)
    rows = [r for r in rows if (since_ms is None or r["timestamp_ms"] >= since_ms)
            and (until_ms is None or r["timestamp_ms"] <= until_ms)]
    sys.stdout.write(to_json(rows) if fmt == "json" else to_csv(rows))




def _audit_trace(job_id: str, log: str | None, data: Path | None) -> None:
    """``dagfold audit JOB --trace``: the job's spans from its partition of events (the IDs and times the
    live exporter gave them: a backend that already holds them keeps one copy of each)."""
    import json

    from dagfold.exceptions import DagfoldError
    from dagfold.services.tracing import job_spans
    from dagfold.tracing import SpanSink, otlp_enabled

    cfg = _config(log, data)
    lg = _open_read_only(cfg)
    try:
        spans = job_spans(lg, job_id)
    except DagfoldError as exc:
        raise fail(str(exc), 1) from None
    finally:
        lg.close()
    if not spans:
        raise fail(f"no span of job {job_id} in the log (not accepted, or no event yet ended a span)", 1)
    sys.stdout.write(json.dumps([s.to_dict() for s in spans], indent=1) + "\n")
    if otlp_enabled():
        sink = SpanSink("audit")
        sink.export(spans)
        ok = sink.flush()
        sink.close()
        if not ok:
            raise fail(f"{len(spans)} spans built; the OTLP export failed (the backend refused or did not "
                       "answer within OTEL_EXPORTER_OTLP_TIMEOUT)", 1)
        print(f"exported {sink.exported} spans of trace {spans[0].trace_id}", file=sys.stderr)


@app.command()
def serve(folder: Path = typer.Argument(..., help="a folder written by `dagfold replay --out` (or a stopped "
                                                   "stack's --data)"),
          port: int = typer.Option(8080, "--port", min=1, max=65535, help="API and dashboard port"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
          auth_file: Path | None = typer.Option(None, "--auth-file", envvar="DAGFOLD_AUTH_FILE",
                                                help="API keys per tenant (YAML/JSON); without it the API is open"),
          verbose: VerboseOpt = False) -> None:
    """Serve a replayed folder read-only: the API and the dashboard over its read model.

    No scheduler, no workers, no log: every write (submit, cancel, redrive) is refused with
    HTTP 405 read_only.
    """
    import uvicorn

    from dagfold.projections.jobs import ReadModel
    from dagfold.projections.store import ReadModelStore
    from dagfold.services.api.app import create_app
    from dagfold.services.api.auth import AuthConfig, AuthConfigError

    _logging(verbose)
    proj = folder / "projections"
    if not proj.is_dir():
        raise fail(f"{folder} has no read model (projections/): give a folder written by `dagfold replay --out`")
    try:
        auth = AuthConfig.from_env(auth_file) if auth_file is not None else AuthConfig.from_env()
    except AuthConfigError as exc:
        raise fail(str(exc)) from None
    try:
        store = ReadModelStore(proj)
    except Exception as exc:  # RocksDB refuses a folder that a running stack holds
        raise fail(f"cannot open {proj}: {exc} (is a stack still running on it?)", 1) from None
    cfg = _config("embedded", folder, port)
    api = create_app(None, ReadModel(store), cfg, auth=auth, read_only=True)
    out.print(f"dagfold serve: {folder} read-only at http://{host}:{port}")
    try:
        uvicorn.run(api, host=host, port=port, log_level="warning")
    finally:
        store.close()
