"""`dagfold up --examples` (what `make run` shows a newcomer) submits every example of the repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagfold.cli.main import submit_examples

ROOT = Path(__file__).resolve().parents[1]


class _Sender:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, cmd: dict[str, Any]) -> None:
        self.sent.append(cmd)


class _Stack:
    """Only what submit_examples uses of a Stack: its command sender."""

    def __init__(self) -> None:
        self.sender = _Sender()


def test_up_examples_submits_every_example() -> None:
    stack = _Stack()
    submit_examples(stack)
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    montage = ROOT.parent / "shared/data/wfcommons/montage-chameleon-2mass-01d-001.json.gz"
    assert len(examples) >= 5
    assert len(stack.sender.sent) == len(examples) + montage.exists()
    assert all(c["type"] == "dagfold.command.SubmitJob" for c in stack.sender.sent)
