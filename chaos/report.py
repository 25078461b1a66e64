"""Print a chaos run's report (``report.json``) as tables, for the terminal and for docs/reliability.md."""

from __future__ import annotations

from typing import Any


def _table(title: str, rows: list[tuple[str, Any]]) -> list[str]:
    out = [f"| {title} | |", "|---|---:|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"chaos run: profile {r['profile']}, seed {r['seed']}", ""]
    lines += _table("faults injected", [*sorted(r.get("faults", {}).items()), ("**total**", r.get("faults total"))])
    lines.append("")
    jobs = r.get("jobs", {})
    tasks = r.get("tasks", {})
    lines += _table("jobs and tasks", [*[(f"jobs {k}", v) for k, v in jobs.items()],
                                       *[(f"tasks: {k}", v) for k, v in tasks.items()],
                                       *[(f"side effects: {k}", v) for k, v in (r.get("side effects") or {}).items()],
                                       ("dead letters", r.get("dead letters"))])
    lines.append("")
    lines += _table("violations", [*r.get("violations by kind", {}).items(),
                                   ("**total**", r.get("violations total"))])
    unexpected = r.get("unexpected exits") or []
    if unexpected:
        lines += ["", f"unexpected process exits (crashes, restarted by the harness): {len(unexpected)}"]
        lines += [f"  t={u['t']}s {u['process']} exit code {u['exit_code']}: {u.get('reason', '')}"
                  for u in unexpected[:20]]
    if r.get("replay"):
        rp = r["replay"]
        lines += ["", f"dagfold replay --verify: exit {rp.get('exit code')}, {rp.get('applied')} events, "
                      f"{rp.get('events_per_s')} events/s, {rp.get('differences')} difference(s); "
                      f"{rp.get('stores compared')} instance stores compared with the replay"]
    if r.get("allocator"):
        a = r["allocator"]
        lines += ["", f"allocator (pool chaos): {a.get('events')} events, {a.get('grants')} grants, "
                      f"{a.get('stores compared')} allocator store(s) equal to the pool's events rebuilt; "
                      f"GPU jobs {a.get('GPU jobs')} (succeeded {a.get('GPU jobs succeeded')}), GPUs granted "
                      f"twice {a.get('GPUs granted twice')}, allocations held at the end "
                      f"{a.get('allocations held at the end')}"]
    if r.get("timings s"):
        lines += ["", "timings (s since start): " + ", ".join(f"{k} {v}" for k, v in r["timings s"].items())]
    if r.get("violations"):
        lines += ["", "violations (first 50):"] + [f"  {v}" for v in r["violations"][:50]]
    return "\n".join(lines)
