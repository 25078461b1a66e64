"""Exactly-once side effects from at-least-once workers: a custom handler with ``SideEffectLedger``.

dagfold runs a task *at least once*: a second attempt follows a failure or an
expired lease (a worker that died after doing the work but before its report
was durable), and a dispatch record can be delivered twice (a worker that died
before committing its offset). Every attempt of a task gets the same
``ctx.idempotency_key`` (``"<job>/<task>"``), so a handler makes an external
side effect happen once by keying it on that key.

``charge_customer`` charges a customer; the "payment system" is a file that
gets one line per charge. ``SideEffectLedger.once`` runs the charge only if
its key was never recorded, records the receipt durably (SQLite), and returns
the stored receipt to every later attempt or redelivery.

Use it in a worker process (importing this module registers the handler)::

    PYTHONPATH=. dagfold worker --log kafka://127.0.0.1:9092 --handler-module examples.side_effects

    # a job
    tasks:
      - id: charge
        handler: charge_customer
        args: {customer: c-42, amount_cents: 1999, charges_file: /tmp/charges.txt,
               ledger: /tmp/side-effects.sqlite}

The ledger is a file on one host: workers of *different* hosts need a shared
ledger, or (better) a payment API that takes the idempotency key itself (pass
it ``ctx.idempotency_key``). See ``docs/semantics.md``, "For handler authors".

Demo, an embedded stack in this process: the first attempt charges and then
fails (as if the next call timed out), the retry returns the first receipt and
charges nothing::

    .venv/bin/python examples/side_effects.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dagfold.services.worker import SideEffectLedger, TaskContext, register_handler  # noqa: E402

DEFAULT_LEDGER = Path(os.environ.get("DAGFOLD_SIDE_EFFECTS_DB", ".dagfold/side-effects.sqlite"))

_ledgers: dict[Path, SideEffectLedger] = {}
_ledgers_lock = threading.Lock()


def ledger_at(path: Path) -> SideEffectLedger:
    """One ledger per file per process (it is safe to share between worker threads)."""
    path = path.resolve()
    with _ledgers_lock:
        if path not in _ledgers:
            _ledgers[path] = SideEffectLedger(path)
        return _ledgers[path]


def charge_customer(ctx: TaskContext) -> dict[str, Any]:
    """Charge ``args.customer`` ``args.amount_cents`` once per task, however often the task runs.

    Args: ``customer``, ``amount_cents``, ``charges_file`` (the payment system's
    book), ``ledger`` (SQLite file of side effects done; default
    ``$DAGFOLD_SIDE_EFFECTS_DB`` or ``.dagfold/side-effects.sqlite``), and for the
    demo ``fail_after_charge_on_attempts`` (a list of attempt numbers that fail
    right after the charge, before the task could report).
    """
    customer = str(ctx.args["customer"])
    amount = int(ctx.args["amount_cents"])
    book = Path(ctx.args["charges_file"])
    ledger = ledger_at(Path(ctx.args.get("ledger") or DEFAULT_LEDGER))

    def charge() -> dict[str, Any]:
        # The external call. It must not be retried by anything but the ledger.
        with open(book, "a") as f:
            f.write(f"{ctx.idempotency_key} {customer} {amount}\n")
            f.flush()
            os.fsync(f.fileno())
        return {"charge_id": f"ch-{ctx.idempotency_key}", "customer": customer, "amount_cents": amount,
                "charged_by_attempt": ctx.attempt}

    # One key per side effect of the task: the task key plus the effect's name.
    receipt = ledger.once(f"{ctx.idempotency_key}:charge", charge)
    if ctx.attempt in ctx.args.get("fail_after_charge_on_attempts", []):
        raise RuntimeError("the receipt could not be mailed (demo failure after the charge)")
    return receipt


register_handler("charge_customer", charge_customer, replace=True)


def demo(data: Path) -> dict[str, Any]:
    """Run a two-task job on an embedded stack; the charge task fails once after charging."""
    from dagfold.commands import submit_job
    from dagfold.config import Config
    from dagfold.jobspec import parse_spec, to_job_spec
    from dagfold.services.stack import Stack, StackOptions

    book = data / "charges.txt"
    spec = to_job_spec(parse_spec({
        "id": "order-1001",
        "retry": {"max_attempts": 3, "initial_interval_s": 0.2},
        "tasks": [
            {"id": "charge", "handler": "charge_customer",
             "args": {"customer": "c-42", "amount_cents": 1999, "charges_file": str(book),
                      "ledger": str(data / "side-effects.sqlite"), "fail_after_charge_on_attempts": [1]}},
            {"id": "ship", "depends_on": ["charge"]},
        ],
    }))
    with Stack(Config(data_dir=data / "stack"), StackOptions(workers=2, api=False)) as stack:
        stack.sender.send(submit_job(spec, source="example"))
        job = stack.wait_job(spec["job_id"], timeout_s=60)
        attempts = stack.read_model.get_attempts(spec["job_id"], "charge")
    return {"job": job, "attempts": attempts, "charges": book.read_text().splitlines() if book.exists() else []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--data", type=Path, help="a folder for the demo (default: a new temporary one)")
    a = p.parse_args(argv)
    data = a.data or Path(tempfile.mkdtemp(prefix="dagfold-side-effects-"))
    data.mkdir(parents=True, exist_ok=True)
    res = demo(data)
    job = res["job"] or {}
    print(f"job {job.get('job_id')}: {job.get('state')}")
    for at in res["attempts"]:
        print(f"  charge attempt {at['attempt']}: {at['outcome']}"
              + (f" ({at['reason']})" if at.get("reason") else "")
              + (f" -> {at['result_json']}" if at.get("result_json") else ""))
    print(f"charges recorded: {len(res['charges'])}")
    for line in res["charges"]:
        print(f"  {line}")
    return 0 if job.get("state") == "succeeded" and len(res["charges"]) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
