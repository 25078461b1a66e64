"""Signing of callback bodies: ``X-Dagfold-Signature: sha256=<hex HMAC-SHA256(secret, raw body)>``.

A receiver recomputes the HMAC over the exact bytes it received (before any
JSON parsing) with the shared secret and compares in constant time
(``verify``). The body carries ``sent_ms``, so the signature also covers the
send time: a receiver may refuse deliveries older than it accepts.

Without ``DAGFOLD_CALLBACK_SECRET`` the notifier signs with a secret it
generates once and keeps in ``<data>/callbacks-secret`` (mode 0600), so a
local stack signs out of the box; production sets the variable.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from dagfold.services.callbacks.exceptions import CallbackConfigError

SIGNATURE_HEADER = "X-Dagfold-Signature"
DELIVERY_HEADER = "X-Dagfold-Delivery"
TIMESTAMP_HEADER = "X-Dagfold-Timestamp"
PREFIX = "sha256="
SECRET_FILE = "callbacks-secret"


def sign(secret: str, body: bytes) -> str:
    """The signature header value of ``body``: ``sha256=`` + hex HMAC-SHA256."""
    return PREFIX + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str | None) -> bool:
    """Whether ``header`` is the signature of ``body`` under ``secret`` (constant-time comparison)."""
    if not header or not header.startswith(PREFIX):
        return False
    return hmac.compare_digest(sign(secret, body), header)


def load_or_create_secret(path: Path) -> str:
    """The secret stored in ``path``; created (32 random bytes, hex, mode 0600) when missing."""
    try:
        if path.exists():
            value = path.read_text().strip()
            if value:
                return value
        path.parent.mkdir(parents=True, exist_ok=True)
        value = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        return value
    except OSError as exc:
        raise CallbackConfigError(f"cannot read or create the callback secret {path}: {exc}") from exc
