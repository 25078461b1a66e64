"""``dagfold sim ...``: the simulator's Typer sub-app (mounted by the main CLI as ``sim``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from dagfold.services.allocator.exceptions import AllocatorError

sim_app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="Run the GPU allocator's fold in virtual time: FGD protocol, openb replay, synthetic day.")

OutOpt = Annotated[Path, typer.Option("--out", help="write the results (JSON) here")]
DataOpt = Annotated[Path | None, typer.Option("--data", help="shared data folder (holds openb/ and fgd/)")]
ImgOpt = Annotated[Path | None, typer.Option("--img", help="also write PNG plots to this folder")]


def parse_seeds(spec: str) -> list[int]:
    """'42-51' or '42,43,50' (or a mix) -> sorted seeds."""
    seeds: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            seeds.update(range(int(a), int(b) + 1))
        else:
            seeds.add(int(part))
    if not seeds:
        raise typer.BadParameter("no seeds given")
    return sorted(seeds)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    _say(f"wrote {out}")


@sim_app.command("fgd")
def fgd(out: OutOpt,
        trace: Annotated[list[str], typer.Option("--trace", help="default, multigpu50, gpuspec33 or all; repeatable")]
        = ["default"],  # noqa: B006 - typer needs a literal default
        seeds: Annotated[str, typer.Option("--seeds", help="e.g. 42-51")] = "42-51",
        policies: Annotated[str, typer.Option("--policies", help="our placement policies to run")]
        = "frag,bestfit,firstfit",
        data: DataOpt = None, img: ImgOpt = None) -> None:
    """The FGD paper's protocol: resample to 130% of capacity, place one by one, never release."""
    from dagfold.services.allocator import report, sim_fgd
    from dagfold.services.allocator.runner import allocator_gc
    from dagfold.services.allocator.traces import TRACES, data_dir

    traces = list(TRACES) if "all" in trace else trace
    for t in traces:
        if t not in TRACES:
            raise typer.BadParameter(f"unknown trace {t!r}; known: {', '.join(TRACES)}")
    try:
        d = data_dir(data)
        with allocator_gc():  # the allocator process's GC setting (as in dagfold allocator)
            result = sim_fgd.run(d, traces, parse_seeds(seeds), tuple(p for p in policies.split(",") if p),
                                 progress=_say)
    except (AllocatorError, OSError) as exc:
        _say(f"error: {exc}")
        raise typer.Exit(2) from exc
    _write(out, result)
    print(report.fgd_table(result))
    if img is not None:
        for p in report.plot_fgd(result, img):
            _say(f"wrote {p}")


@sim_app.command("openb")
def openb(out: OutOpt, data: DataOpt = None, img: ImgOpt = None,
          policies: Annotated[str, typer.Option("--policies", help="placement policies, comma-separated")] = (
              "ours,bestfit,fifo"),
          limit: Annotated[int | None, typer.Option("--limit", help="only the first N pods (quick runs)")] = None,
          time_scale: Annotated[float, typer.Option("--time-scale", help="compress arrival times by this factor")]
          = 1.0) -> None:
    """Time-ordered replay of the openb trace: utilization over time, queueing delay, completion times."""
    from dagfold.services.allocator import report
    from dagfold.services.allocator.sim_openb import run_openb
    from dagfold.services.allocator.traces import data_dir

    try:
        d = data_dir(data)
        runs = {}
        for p in (x for x in policies.split(",") if x):
            runs[p] = run_openb(d, p, limit=limit, time_scale=time_scale)
            _say(f"openb {p}: queue p99 {runs[p]['queue_delay_p99_s']} s, wall {runs[p]['wall_s']} s")
    except (AllocatorError, OSError) as exc:
        _say(f"error: {exc}")
        raise typer.Exit(2) from exc
    result = {"time_scale": time_scale, "policies": runs}
    _write(out, result)
    if img is not None:
        _say(f"wrote {report.plot_openb(result, img, suffix='' if time_scale == 1.0 else f'-x{time_scale:g}')}")


@sim_app.command("day")
def day(out: OutOpt,
        gpus: Annotated[int, typer.Option("--gpus", help="GPUs (8 per host)")] = 10000,
        jobs: Annotated[int, typer.Option("--jobs", help="jobs in the measured day")] = 100000,
        seed: Annotated[int, typer.Option("--seed", help="random seed of the synthetic day")] = 42,
        hb_s: Annotated[float, typer.Option("--hb-s", help="node heartbeat interval (virtual seconds)")] = 300.0,
        baselines: Annotated[bool, typer.Option("--baselines/--no-baselines", help="also run fifo and best-fit")]
        = True,
        img: ImgOpt = None,
        sweep: Annotated[str | None, typer.Option(
            "--sweep", help="offered loads as fractions of capacity, e.g. 0.7,0.85,0.95,1.1 (job count follows "
                            "from --gpus; --jobs is ignored): every policy at each load, one table")] = None) -> None:
    """A synthetic day: tiers, tenants (one floods), gangs, runtimes 2-45 min, node faults."""
    from dagfold.services.allocator import report
    from dagfold.services.allocator.sim_day import run_day, run_sweep

    if gpus < 8 or jobs < 100:
        raise typer.BadParameter("need at least 8 GPUs and 100 jobs")
    if sweep is not None:
        try:
            loads = tuple(float(x) for x in sweep.split(",") if x.strip())
        except ValueError as exc:
            raise typer.BadParameter(f"--sweep takes fractions like 0.7,0.85, not {sweep!r}") from exc
        if not loads or any(not 0.05 <= x <= 3.0 for x in loads):
            raise typer.BadParameter("--sweep loads must be between 0.05 and 3.0")
        swept = run_sweep(gpus, loads, seed, hb_s=hb_s, progress=_say)
        _write(out, swept)
        print(report.sweep_table(swept))
        return
    result = run_day(gpus, jobs, seed, "ours", True, hb_s)
    _say(f"day ours: utilization {result['utilization']}, wall {result['wall_s']} s")
    quiet = run_day(gpus, jobs, seed, "ours", False, hb_s)
    _say(f"day ours without the flood: wall {quiet['wall_s']} s")
    with_f, without_f = result["small_tenant_wait_p99_s"], quiet["small_tenant_wait_p99_s"]
    result["small_tenant"] = {
        "wait_p99_s_with_flood": with_f, "wait_p99_s_without_flood": without_f,
        "ratio": None if not without_f else round((with_f or 0) / without_f, 3),
        "within_2x": (with_f or 0) <= 2 * max(without_f or 0, 1.0)}
    result["no_flood"] = {k: quiet[k] for k in ("utilization", "wait_p50_s", "wait_p99_s",
                                                 "small_tenant_wait_p99_s", "wall_s")}
    if baselines:
        result["baselines"] = {}
        for pol in ("fifo", "bestfit"):
            result["baselines"][pol] = run_day(gpus, jobs, seed, pol, True, hb_s)
            _say(f"day {pol}: utilization {result['baselines'][pol]['utilization']}, "
                 f"wall {result['baselines'][pol]['wall_s']} s")
    _write(out, result)
    if img is not None:
        _say(f"wrote {report.plot_day(result, img)}")
