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
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dagfold.cli.common import DataOpt, LogOpt, _config, _logging, app, err, fail, out, run_until_stopped


def _parse_ts(value: str | None) -> int | None:
    """Milliseconds since the epoch, from an ISO-8601 time or a number of ms."""
    if value is None:
        return None
    if value.isdigit():
        return int(value)
    try:
        return int(datetime.fromisoformat(value).timestamp() * 1000)
    except ValueError:
        raise fail(f"bad time {value!r}: use ISO-8601 (2026-11-30T12:00:00) or epoch ms") from None


@app.command()
def scheduler(log: LogOpt = "embedded", data: DataOpt = None,
              instance: str = typer.Option("0", "--instance", help="unique per scheduler process"),
              verbose: bool = typer.Option(False, "-v")) -> None:
    """Run one scheduler instance; several instances in one Kafka cluster share the partitions."""
    from dagfold.log import open_log
    from services.scheduler.runner import SchedulerRunner

    _logging(verbose)
    cfg = _config(log, data)
    lg = open_log(cfg.log_url, cfg.data_dir)
    run_until_stopped(SchedulerRunner(lg, cfg, instance).run, lg.close)


@app.command()
def replay(out_dir: Path = typer.Option(..., "--out", help="fresh folder for the rebuilt state"),
           log: LogOpt = "embedded", data: DataOpt = None,
           from_ts: str | None = typer.Option(None, "--from", help="only events at or after (ISO or ms)"),
           to_ts: str | None = typer.Option(None, "--to", help="only events at or before: state as of then"),
           job: str | None = typer.Option(None, "--job", help="only this job"),
           verify_live: bool = typer.Option(False, "--verify", help="compare with the live state in --data"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Rebuild scheduler state and the read model from the events log into --out."""
    import json

    from dagfold.config import EVENTS
    from dagfold.exceptions import DagfoldError
    from dagfold.log import TopicPartition, open_log
    from services.scheduler.replay import ReplayFilter, verify
    from services.scheduler.replay import replay as do_replay

    cfg = _config(log, data)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise fail(f"{out_dir} is not empty; replay needs a fresh folder")
    filt = ReplayFilter(_parse_ts(from_ts), _parse_ts(to_ts), job)
    if verify_live and (filt.from_ms is not None or filt.to_ms is not None):
        raise fail("--verify compares a full replay; drop --from/--to")
    try:
        lg = open_log(cfg.log_url, cfg.data_dir, read_only=True)
    except DagfoldError as exc:
        raise fail(str(exc), 1) from None
    try:
        total = sum(lg.end_offsets([TopicPartition(EVENTS, p) for p in range(cfg.partitions)]).values())
        t0 = time.perf_counter()
        with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, disable=as_json) as bar:
            task = bar.add_task("events", total=total)
            result = do_replay(lg, out_dir, cfg.partitions, filt, lambda n: bar.advance(task, n))
        dt = time.perf_counter() - t0
    finally:
        lg.close()
    report: dict[str, object] = {"applied": result.total, "seconds": round(dt, 3),
                                 "events_per_s": round(result.total / dt) if dt else None,
                                 "undecodable": result.skipped_undecodable, "out": str(out_dir)}
    diffs = []
    if verify_live:
        diffs = verify(cfg.data_dir, out_dir, cfg.partitions, job)
        report["differences"] = [d.__dict__ for d in diffs]
    if as_json:
        out.print_json(json.dumps(report))
    else:
        out.print(f"replayed {result.total} events in {dt:.2f}s into {out_dir}")
        if verify_live:
            out.print("verify: no difference" if not diffs else f"verify: {len(diffs)} difference(s)")
            for d in diffs:
                out.print(f"  partition {d.partition} job {d.job_id or '-'}: {d.what}")
    if diffs:
        raise typer.Exit(1)


@app.command()
def audit(job_id: str, log: LogOpt = "embedded", data: DataOpt = None,
          fmt: str = typer.Option("json", "--format", help="json or csv")) -> None:
    """Export a job's complete timeline: every command and event with partition, offset and cause."""
    from dagfold.audit import job_timeline, to_csv, to_json
    from dagfold.exceptions import DagfoldError
    from dagfold.log import open_log

    if fmt not in ("json", "csv"):
        raise fail("--format must be json or csv")
    cfg = _config(log, data)
    try:
        lg = open_log(cfg.log_url, cfg.data_dir, read_only=True)
    except DagfoldError as exc:
        raise fail(str(exc), 1) from None
    try:
        rows = job_timeline(lg, job_id, cfg.partitions)
    finally:
        lg.close()
    if not rows:
        raise fail(f"no record of job {job_id} in the log", 1)
    sys.stdout.write(to_json(rows) if fmt == "json" else to_csv(rows))


