"""A checkpointing demo job for node agents: ``python -m dagfold.services.agent.demo_job [STEPS [STEP_S]]``.

STEPS and STEP_S default to the task's arguments ``steps`` and ``step_s``
(``DAGFOLD_ARGS_JSON``), else 20 and 0.05. It runs STEPS steps, prints ``{"progress": f}`` after each, writes a
checkpoint (the step reached) every few steps and on SIGTERM, and resumes
from ``DAGFOLD_RESUME_CHECKPOINT`` (or the newest checkpoint in
``DAGFOLD_CHECKPOINT_DIR``). Steps take STEP_S / DAGFOLD_SPEED seconds. When
it finishes it writes its "generated asset", ``sample.json`` (model, prompt,
steps, the step it resumed from), into ``DAGFOLD_OUTPUT_DIR`` and prints a
small ``{"output": ...}`` result.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    args = json.loads(os.environ.get("DAGFOLD_ARGS_JSON") or "{}")
    params = args.get("params") if isinstance(args.get("params"), dict) else {}
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else int(args.get("steps", params.get("steps", 20)))
    step_s = float(sys.argv[2]) if len(sys.argv) > 2 else float(args.get("step_s", params.get("step_s", 0.05)))
    speed = float(os.environ.get("DAGFOLD_SPEED", "1"))
    ckdir = Path(os.environ.get("DAGFOLD_CHECKPOINT_DIR", "."))
    resume = os.environ.get("DAGFOLD_RESUME_CHECKPOINT")
    start = 0
    src = Path(resume) if resume else max(ckdir.glob("step-*.json"), default=None,
                                           key=lambda p: int(p.stem.split("-")[1]))
    if src is not None and src.exists():
        start = json.loads(src.read_text())["step"]
    print(json.dumps({"resumed_from": start, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
    state = {"step": start, "stop": False}

    def checkpoint() -> None:
        p = ckdir / f"step-{state['step']}.json"
        p.write_text(json.dumps({"step": state["step"]}))
        print(json.dumps({"checkpoint": str(p)}), flush=True)

    def on_term(signum: int, frame: object) -> None:
        state["stop"] = True

    signal.signal(signal.SIGTERM, on_term)
    while state["step"] < steps:
        if state["stop"]:
            checkpoint()
            return 0
        time.sleep(step_s / speed)
        state["step"] += 1
        print(json.dumps({"progress": state["step"] / steps}), flush=True)
        if state["step"] % 5 == 0:
            checkpoint()
    out_dir = os.environ.get("DAGFOLD_OUTPUT_DIR")
    asset = {"model": args.get("model"), "prompt": args.get("prompt"), "steps": steps, "resumed_from": start}
    if out_dir:
        (Path(out_dir) / "sample.json").write_text(json.dumps(asset, sort_keys=True))
    print(json.dumps({"output": {"steps": steps, "resumed_from": start}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
