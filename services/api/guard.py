"""The API's guard against browsers: Host (DNS rebinding), cross-origin writes, and the optional local token.

The API's local default is open on 127.0.0.1, and a browser on the same machine reaches loopback too. Three
checks, in an ASGI middleware before any route, keep a web page on another origin out:

- **Host.** A page on ``attacker.example`` whose DNS name is rebound to 127.0.0.1 sends its requests with
  ``Host: attacker.example``; same-origin for the browser, so it could read the answers. Only loopback names,
  the address the API binds to, and ``DAGFOLD_API_ALLOWED_HOSTS`` (comma-separated; ``*`` accepts any, for a
  proxy that checks Host itself) are accepted: 403 ``host_not_allowed`` otherwise.
- **Cross-origin writes.** A page may send a POST to any origin without asking first (a form, or ``fetch``
  with ``mode: no-cors``), it only cannot read the answer. Every request other than GET/HEAD/OPTIONS is
  refused (403 ``cross_origin``) when the browser says it comes from elsewhere: ``Sec-Fetch-Site`` other than
  ``same-origin``/``none``, or an ``Origin`` that is not the API's own (nor in
  ``DAGFOLD_API_ALLOWED_ORIGINS``). Clients that are not browsers send neither header and pass. Job specs are
  further accepted only as JSON or YAML (routes_jobs.body_format): types a page can only send after a CORS
  preflight, which this API never grants.
- **Local token** (``dagfold up --token``, ``DAGFOLD_API_TOKEN``), for machines that other users share: every
  API and metrics request must carry it (``Authorization: Bearer`` or ``X-API-Key``), unless API keys are
  configured, which then decide who may call. The dashboard's page, its static files and ``/healthz`` stay
  public; they hold no data.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from dagfold.localtoken import LOOPBACK_NAMES

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SAME_SITE = frozenset({"same-origin", "none"})
PUBLIC_PREFIXES = ("/ui", "/healthz", "/favicon")
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 - compared with, never bound


def _hostname(host: str) -> str | None:
    """The host name of a Host header value (port and IPv6 brackets removed, lower case), or None."""
    try:
        parts = urlsplit("//" + host)
        _ = parts.port  # raises on a malformed port
    except ValueError:
        return None
    return parts.hostname


def is_loopback(name: str) -> bool:
    """A loopback name or address (127.0.0.0/8, ::1). Never by prefix: 127.0.0.1.nip.io is anyone's DNS name."""
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class GuardConfig:
    allowed_hosts: frozenset[str] = frozenset()  # beyond loopback; "*" accepts any
    allowed_origins: frozenset[str] = frozenset()  # beyond the API's own origin, e.g. "https://ops.example"
    token: str | None = None

    @classmethod
    def from_env(cls, bind_host: str = "127.0.0.1", env: Mapping[str, str] | None = None) -> GuardConfig:
        env = os.environ if env is None else env

        def items(name: str) -> Iterable[str]:
            return (s.strip().lower().rstrip("/") for s in env.get(name, "").split(",") if s.strip())

        hosts = set(items("DAGFOLD_API_ALLOWED_HOSTS"))
        if bind_host.strip("[]").lower() not in WILDCARD_BINDS:
            hosts.add(bind_host.strip("[]").lower())
        return cls(frozenset(hosts), frozenset(items("DAGFOLD_API_ALLOWED_ORIGINS")),
                   env.get("DAGFOLD_API_TOKEN") or None)

    def host_allowed(self, name: str) -> bool:
        return is_loopback(name) or "*" in self.allowed_hosts or name in self.allowed_hosts


class BrowserGuard:
    """ASGI middleware applying ``GuardConfig``; ``keys_enabled``: API keys decide instead of the token."""

    def __init__(self, app: ASGIApp, config: GuardConfig, keys_enabled: bool = False) -> None:
        self.app = app
        self.config = config
        self.keys_enabled = keys_enabled
        self._token = config.token.encode() if config.token and not keys_enabled else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for k, v in scope.get("headers") or []:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        refusal = self.refusal(scope, headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, reason = refusal
        body = json.dumps({"error": {"code": code, "reason": reason}}).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope: Scope, headers: Mapping[str, str]) -> tuple[int, str, str] | None:
        """Why the request is refused, as (status, code, reason), or None."""
        host = headers.get("host", "")
        name = _hostname(host)
        if name is None or not self.config.host_allowed(name):
            return (403, "host_not_allowed", f"Host {host[:100]!r} is not a name of this API (set "
                    "DAGFOLD_API_ALLOWED_HOSTS to serve it under another name)")
        if scope.get("method", "GET") not in SAFE_METHODS:
            site = headers.get("sec-fetch-site")
            if site is not None and site.lower() not in SAME_SITE:
                return (403, "cross_origin", f"a {site} request from a browser cannot change anything here")
            origin = headers.get("origin")
            if origin is not None and not self._same_origin(origin, host, scope):
                return (403, "cross_origin", f"origin {origin[:100]!r} may not send requests to this API")
        if self._token is not None and not scope.get("path", "/").startswith(PUBLIC_PREFIXES) \
                and scope.get("path", "/") != "/":
            given = _credential(headers)
            if given is None or not hmac.compare_digest(given.encode(), self._token):
                return (401, "unauthorized", "this API needs its local token: Authorization: Bearer <token> "
                        "(the CLI reads it from ~/.dagfold/tokens; the dashboard from /ui/?token=...)")
        return None

    def _same_origin(self, origin: str, host: str, scope: Scope) -> bool:
        origin = origin.lower().rstrip("/")
        if origin in self.config.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file pages) and anything odd
        return parts.netloc == host.lower()


def _credential(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None
