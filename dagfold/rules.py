"""The one table of identifier and number rules: every name a job spec carries, checked the same everywhere.

The API's models (``dagfold/jobspec/model.py``, ``services/api/routes_gpu.py``) take their field
constraints from this table (so the OpenAPI document states them too), and the scheduler's own validation
(``dagfold/jobspec/validation.py``) applies the same rules to records that upstream producers write to
the log without the API. One table, so the two can never drift apart.

What every identifier rule forbids: the empty string, more than ``max_len`` characters, the names ``.``
and ``..`` (and any name of dots only: they mean something in URL paths and file paths), and control
characters (C0, DEL, C1: NUL, ESC and the like reach terminals and logs), plus ``/`` in every name that
becomes a URL path segment or a file name. Names that operators type or that select resources (tenant,
tier, queue, pool, handler, GPU type) are further limited to ``[A-Za-z0-9._-]`` (handler also ``:``),
so they cannot carry markup, quotes or spaces into a table, a metric label or a shell.

Numbers: finite (no NaN, no infinity), and a boolean is not a number.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

# Control characters: C0, DEL and C1. ESC (\x1b) is among them: no terminal escapes in names.
_CONTROLS = "\\x00-\\x1f\\x7f-\\x9f"


@dataclass(frozen=True)
class IdRule:
    """How one kind of identifier may look. ``chars`` is a regex character class body."""

    name: str
    max_len: int
    chars: str
    label: str  # the charset as people read it, for messages

    @property
    def pattern(self) -> str:
        """A whole-value regex: one or more allowed characters, at least one of them not a dot.

        Written without look-arounds so that pydantic's (Rust) regex and JSON Schema use it as is.
        """
        c = self.chars
        nodot = c.replace(".", "") if not c.startswith("^") else c + "."
        return f"^[{c}]*[{nodot}][{c}]*$"

    def check(self, value: Any) -> str | None:
        """Why ``value`` breaks the rule, or None. Length first: the regex never sees a long value."""
        if not isinstance(value, str):
            return f"{self.name} must be a string"
        if not value:
            return f"{self.name} must not be empty"
        if len(value) > self.max_len:
            return f"{self.name} is {len(value)} characters, at most {self.max_len}"
        if not _FULL[self.name].fullmatch(value):
            return f"{self.name} {value[:40]!r} may contain only {self.label}"
        if not value.strip("."):
            return f"{self.name} {value!r} is reserved ('.' and '..' are path names)"
        return None


def _rule(name: str, max_len: int, chars: str, label: str) -> IdRule:
    return IdRule(name, max_len, chars, label)


_NAME_CHARS = "A-Za-z0-9._\\-"
_PRINTABLE_NO_SLASH = f"^{_CONTROLS}/"
_PRINTABLE = f"^{_CONTROLS}"

#: The table. Keys are what the spec calls the field.
RULES: dict[str, IdRule] = {r.name: r for r in (
    _rule("job_id", 256, "A-Za-z0-9._:\\-", "letters, digits and . _ : -"),
    _rule("task_id", 256, _PRINTABLE_NO_SLASH, "printable characters other than '/'"),
    _rule("tenant", 128, _NAME_CHARS, "letters, digits and . _ -"),
    _rule("tier", 64, _NAME_CHARS, "letters, digits and . _ -"),
    _rule("queue", 200, _NAME_CHARS, "letters, digits and . _ -"),
    _rule("pool", 200, _NAME_CHARS, "letters, digits and . _ -"),
    _rule("handler", 128, "A-Za-z0-9._:\\-", "letters, digits and . _ : -"),
    _rule("gpu_type", 64, _NAME_CHARS, "letters, digits and . _ -"),
    _rule("idempotency_key", 256, _PRINTABLE, "printable characters"),
    _rule("job_name", 200, _PRINTABLE, "printable characters"),
    _rule("label_key", 128, _PRINTABLE_NO_SLASH.replace("/", "") + " ", "printable characters other than space"),
)}
_FULL = {name: re.compile(f"[{r.chars}]+") for name, r in RULES.items()}

MAX_LABELS = 64
MAX_LABEL_VALUE_LEN = 256
MAX_URL_LEN = 2048
MAX_REASON_LEN = 2000


def check_id(kind: str, value: Any) -> str | None:
    """Why ``value`` is not a valid ``kind`` (a key of ``RULES``), or None."""
    return RULES[kind].check(value)


def check_labels(labels: Any) -> str | None:
    """At most ``MAX_LABELS`` labels; keys by the ``label_key`` rule, values printable and bounded."""
    if not isinstance(labels, dict):
        return "labels must be a mapping of strings"
    if len(labels) > MAX_LABELS:
        return f"{len(labels)} labels, at most {MAX_LABELS}"
    for k, v in labels.items():
        bad = check_id("label_key", k)
        if bad:
            return "label key: " + bad
        if not isinstance(v, str) or len(v) > MAX_LABEL_VALUE_LEN or _CONTROL_CHAR.search(v):
            return f"label {k!r}: value must be at most {MAX_LABEL_VALUE_LEN} printable characters"
    return None


_CONTROL_CHAR = re.compile(f"[{_CONTROLS}]")


def has_control(value: str) -> bool:
    """Whether ``value`` holds a control character (C0, DEL, C1)."""
    return _CONTROL_CHAR.search(value) is not None


def finite_number(value: Any) -> bool:
    """A real number, finite, and not a boolean (``True`` is an int to Python, not a count to a spec)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def path_segment(value: str) -> str:
    """``value`` as one URL path segment, for clients (the CLI, the SDK): every reserved character escaped
    ('/', '#', '?', '%'), and a name of dots too (HTTP clients remove '.' and '..' segments, so a job named
    '..' would reach another route)."""
    return "%2E" * len(value) if value and not value.strip(".") else quote(str(value), safe="")
