"""Bounded parsing of JSON and YAML documents from outside: size, depth and aliases checked before any tree is built.

A parser amplifies: a 525-byte YAML document whose aliases refer to aliases expands to gigabytes once it is
built (or serialised), and a 10,000-deep array makes a recursive builder or encoder raise RecursionError.
So every document from outside (HTTP bodies, spec files) goes through here:

- its size is checked on the raw bytes, before parsing (``max_bytes``);
- YAML anchors and aliases are refused while the event stream is read, before anything is composed (a job
  spec has no use for them, and refusing them is the only bound that costs nothing);
- nesting depth is bounded (``MAX_DEPTH``, 64): YAML while its events are read, JSON by a scan of its
  brackets outside strings (linear, in C: a regex and a translate) before ``json.loads``;
- JSON's non-standard ``NaN`` and ``Infinity`` are refused (numbers must be finite).

Hand-written rather than a library: neither the standard ``json`` nor PyYAML bounds depth or aliases, and
the bounds are a few lines over their own event/byte streams. YAML events come from libyaml
(``CSafeLoader``) when it is installed, so the check reads the document at C speed.
"""

from __future__ import annotations

import json
from array import array
from itertools import accumulate
from typing import Any

import yaml

from dagfold.exceptions import DagfoldError

MAX_DEPTH = 64
#: YAML is for people; a larger spec is sent as JSON (libyaml builds ~10 MB/s of Python objects).
MAX_YAML_BYTES = 8 * 1024 * 1024

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1, +1, -1, -1


class ParseError(DagfoldError):
    """The document is malformed or over a bound; ``code`` says which, the message names the limit."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _raw(data: str | bytes, max_bytes: int | None, what: str) -> bytes:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if max_bytes is not None and len(raw) > max_bytes:
        raise ParseError("too_large", f"{what} is {len(raw)} bytes, the limit is {max_bytes}")
    return raw


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` outside strings (0 for a scalar), without parsing."""
    # Escaped backslashes, then escaped quotes, go first; every quote left opens or closes a string, so the
    # even pieces between quotes are the text outside strings.
    outside = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    skeleton = outside.translate(None, _NOT_BRACKETS)
    if not skeleton:
        return 0
    return max(0, max(accumulate(array("b", skeleton.translate(_DEPTH_STEP)))))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here (numbers must be finite)")


def load_json(data: str | bytes, *, max_bytes: int | None = None, max_depth: int = MAX_DEPTH,
              what: str = "document") -> Any:
    """Parse JSON within the bounds; ``ParseError`` otherwise."""
    raw = _raw(data, max_bytes, what)
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise ParseError("too_deep", f"{what} nests {depth} levels deep, the limit is {max_depth}")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:  # unreachable after the depth scan; kept so that no input can raise it
        raise ParseError("too_deep", f"{what} nests deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise ParseError("invalid", f"{what} is not valid JSON: {exc}") from None


def load_yaml(data: str | bytes, *, max_bytes: int | None = MAX_YAML_BYTES, max_depth: int = MAX_DEPTH,
              what: str = "document") -> Any:
    """Parse YAML (or JSON, which is YAML) within the bounds: no anchors or aliases; ``ParseError`` otherwise."""
    raw = _raw(data, max_bytes, what)
    depth = 0
    try:
        for event in yaml.parse(raw, Loader=_Loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise ParseError("yaml_alias", f"{what}: YAML anchors and aliases (&, *, <<) are not accepted; "
                                 "write the values out")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > max_depth:
                    raise ParseError("too_deep", f"{what} nests deeper than {max_depth} levels, the limit")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(raw, Loader=_Loader)  # noqa: S506 - a safe loader, and the events were checked
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # libyaml's own bound (1000) met while it scans ahead
            raise ParseError("too_deep", f"{what} nests deeper than {max_depth} levels, the limit") from None
        raise ParseError("invalid", f"{what} is not valid YAML/JSON: {exc}") from None
    except RecursionError:
        raise ParseError("too_deep", f"{what} nests deeper than {max_depth} levels") from None
