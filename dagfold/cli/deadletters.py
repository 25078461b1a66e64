"""``dagfold deadletters``: list dead letters, show one, resubmit a dead-lettered SubmitJob (over the API).

Registered on the main ``dagfold`` app by ``dagfold.cli.main``. Dead letters are
hostile records: everything printed comes bounded from the API and is printed
with ``markup=False`` (a reason holding ``[red]`` stays text).
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

import typer

from dagfold.cli.common import DEFAULT_API, ApiOpt, JsonOpt, KeyOpt, _print_json, _request, _table, _ts, out

dl_app = typer.Typer(no_args_is_help=False, help="Dead letters: records a service could not take, and why.")


def _page_all(api: str, api_key: str | None, since: str | None, limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while len(items) < limit:
        params: dict[str, Any] = {"limit": min(500, limit - len(items))}
        if since:
            params["since"] = since
        if cursor:
            params["cursor"] = cursor
        page = _request("GET", api, "/v1/deadletters", api_key, params=params)
        items += page["deadletters"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    return items


@dl_app.callback(invoke_without_command=True)
def deadletters(ctx: typer.Context, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False,
                since: str | None = typer.Option(None, "--since", help="only dead letters at or after (ISO 8601 "
                                                 "with a zone, or epoch ms)"),
                limit: int = typer.Option(100, "--limit", min=1, max=100_000, help="at most this many, newest first"),
                ) -> None:
    """List dead letters, newest first: source topic/partition/offset, service, reason, a preview (admin key)."""
    if ctx.invoked_subcommand is not None:
        return
    items = _page_all(api, api_key, since, limit)
    if as_json:
        _print_json(items)
        return
    if not items:
        out.print("no dead letters")
        return
    t = _table("id", "time", "source", "service", "type", "job", "reason")
    for d in items:
        t.add_row(d["id"], _ts(d["ts_ms"]), f"{d['source_topic']}/{d['source_partition']}@{d['source_offset']}",
                  d["service"], (d.get("record_type") or "undecodable").rsplit(".", 1)[-1],
                  (d.get("job_id") or "")[:40] + (f" ({d['job_state']})" if d.get("job_state") else ""),
                  d["reason"][:100])
    out.print(t, markup=False, highlight=False)
    out.print(f"{len(items)} dead letter(s); `dagfold deadletters show ID` for a preview, "
              "`dagfold deadletters resubmit ID` for a SubmitJob", markup=False, highlight=False)


DlArg = Annotated[str, typer.Argument(help="dead letter ID (from the list)")]


@dl_app.command()
def show(dl_id: DlArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
    """Show one dead letter with its decoded preview."""
    d = _request("GET", api, f"/v1/deadletters/{quote(dl_id, safe='')}", api_key)
    if as_json:
        _print_json(d)
        return
    for k in ("id", "ts_ms", "source_topic", "source_partition", "source_offset", "service", "reason", "key",
              "record_type", "job_id", "job_state", "value_bytes", "preview"):
        out.print(f"{k}: {_ts(d[k]) if k == 'ts_ms' else d.get(k)}", markup=False, highlight=False)


@dl_app.command()
def resubmit(dl_id: DlArg, api: ApiOpt = DEFAULT_API, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
    """Resubmit a dead-lettered SubmitJob after a fix: decoded again, validated, sent to its job's partition."""
    res = _request("POST", api, f"/v1/deadletters/{quote(dl_id, safe='')}/resubmit", api_key)
    if as_json:
        _print_json(res)
    elif res.get("resubmitted"):
        out.print(f"resubmitted {dl_id}: job {res['job_id']}", markup=False, highlight=False)
    else:
        out.print(f"job {res['job_id']} already exists ({res['state']}); nothing sent", markup=False, highlight=False)
