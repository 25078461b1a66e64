"""The scheduler's command handler index (``handlers.HANDLERS``), built from each handler's ``@handles``:
every command schema has exactly one handler, and a second handler for a command is refused at import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dagfold.services.scheduler.handlers import HANDLERS, handles, listing

SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"


def command_schemas() -> set[str]:
    out = set()
    for p in SCHEMAS.glob("dagfold.command.*.avsc"):
        schema = json.loads(p.read_text())
        out.add(f"{schema['namespace']}.{schema['name']}")
    return out


def test_every_command_schema_has_one_handler_and_nothing_else() -> None:
    assert len(command_schemas()) >= 15
    assert sorted(command_schemas() - set(HANDLERS)) == [], "command schemas without a handler"
    assert sorted(set(HANDLERS) - command_schemas()) == [], "handlers for commands that have no schema"


def test_a_second_handler_for_a_command_is_refused() -> None:
    first = HANDLERS["dagfold.command.PauseJob"]

    def another(ctx: object, cmd: object) -> None: ...

    with pytest.raises(ValueError, match="PauseJob has two handlers"):
        handles("dagfold.command.PauseJob")(another)  # type: ignore[arg-type]
    assert HANDLERS["dagfold.command.PauseJob"] is first
    assert handles("dagfold.command.PauseJob")(first) is first  # the same one again (a reload) is no second


def test_the_listing_names_every_command_once() -> None:
    rows = listing().splitlines()[2:]
    assert len(rows) == len(HANDLERS)
    assert "| ``jobs`` | PauseJob | ``pause_job`` |" in rows
