"""Settings of the callback notifier, read once from ``DAGFOLD_CALLBACK_*`` (like ``dagfold.config``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dagfold.services.callbacks.egress import EgressRules
from dagfold.services.callbacks.exceptions import CallbackConfigError
from dagfold.services.callbacks.signing import SECRET_FILE, load_or_create_secret

log = logging.getLogger("dagfold.callbacks")

ENV_SECRET = "DAGFOLD_CALLBACK_SECRET"


@dataclass(frozen=True)
class CallbackOptions:
    """How callbacks are signed, sent and retried.

    Attempt *n* that fails retryably is tried again after
    ``min(max_backoff_s, base_backoff_s * 2**(n-1))``, of which a random half
    is jitter (at least ``Retry-After`` on a 429/503 that sends one, within
    ``max_backoff_s``). After ``max_attempts`` attempts the delivery is given up.

    ``timeout_s`` bounds a whole attempt (connect, TLS, send, the answer's
    headers together), not each read. ``concurrency`` attempts run at once, at most
    ``tenant_concurrency`` of them for one tenant, so a tenant whose receivers hang
    waits for its own slots and leaves the others free. ``egress`` says where
    callbacks may go (``egress.EgressRules``: no loopback, private, link-local...
    address unless ``DAGFOLD_CALLBACK_ALLOW`` opens it).
    """

    secret: str
    timeout_s: float = 10.0
    max_attempts: int = 8
    base_backoff_s: float = 1.0
    max_backoff_s: float = 300.0
    concurrency: int = 8  # deliveries in flight at once (one slow receiver does not hold up the others)
    tenant_concurrency: int = 4  # of which one tenant's (a tenant whose receivers hang leaves the rest free)
    egress: EgressRules = field(default_factory=EgressRules)

    def __post_init__(self) -> None:
        if not self.secret:
            raise CallbackConfigError("the callback secret is empty")
        if (self.timeout_s <= 0 or self.max_attempts < 1 or self.base_backoff_s < 0 or self.concurrency < 1
                or self.tenant_concurrency < 1):
            raise CallbackConfigError("callback options: timeout_s > 0, max_attempts >= 1, base_backoff_s >= 0, "
                                      "concurrency >= 1 and tenant_concurrency >= 1 are required")
        if self.max_backoff_s < self.base_backoff_s:
            raise CallbackConfigError("callback options: max_backoff_s must be >= base_backoff_s")

    @classmethod
    def from_env(cls, data_dir: Path, env: Mapping[str, str] | None = None) -> CallbackOptions:
        """``DAGFOLD_CALLBACK_SECRET`` (else a generated secret kept in ``data_dir``), ``DAGFOLD_CALLBACK_TIMEOUT_S``,
        ``_MAX_ATTEMPTS``, ``_BASE_BACKOFF_S``, ``_MAX_BACKOFF_S``, ``_CONCURRENCY``, ``_TENANT_CONCURRENCY``,
        ``_ALLOW`` (``EgressRules.from_env``)."""
        e = os.environ if env is None else env
        secret = e.get(ENV_SECRET, "")
        if not secret:
            path = data_dir / SECRET_FILE
            secret = load_or_create_secret(path)
            log.info("%s is not set: callbacks are signed with the secret in %s", ENV_SECRET, path)

        def num(name: str, default: float) -> float:
            raw = e.get(f"DAGFOLD_CALLBACK_{name}")
            if raw is None or raw == "":
                return default
            try:
                return float(raw)
            except ValueError:
                raise CallbackConfigError(f"DAGFOLD_CALLBACK_{name} must be a number, not {raw!r}") from None

        return cls(secret=secret, timeout_s=num("TIMEOUT_S", cls.timeout_s),
                   max_attempts=int(num("MAX_ATTEMPTS", cls.max_attempts)),
                   base_backoff_s=num("BASE_BACKOFF_S", cls.base_backoff_s),
                   max_backoff_s=num("MAX_BACKOFF_S", cls.max_backoff_s),
                   concurrency=int(num("CONCURRENCY", cls.concurrency)),
                   tenant_concurrency=int(num("TENANT_CONCURRENCY", cls.tenant_concurrency)),
                   egress=EgressRules.from_env(e))
