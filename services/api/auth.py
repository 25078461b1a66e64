"""API keys: who is calling, and which tenant's jobs they may see.

Without configuration the API is open (the local default of ``dagfold up``):
every caller is an unauthenticated admin. With an auth file
(``--auth-file`` / ``DAGFOLD_AUTH_FILE``) or ``DAGFOLD_API_KEYS``, every
``/v1`` route requires ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``;
a key belongs to one tenant, or is an admin key.

Auth file (YAML or JSON)::

    keys:
      k-3f9a...: acme            # a tenant key
      k-77c1...: admin           # an admin key (sees every tenant)
      k-0d2e...: {tenant: admin} # a tenant literally named "admin"
    tenants:                     # optional entitlements per tenant (dagfold.tenants)
      acme: {max_tier: standard, handlers: [noop, sleep, shell], weight: 2,
             gpu_quota: {default: 8}, rate_per_s: 5, burst: 10, max_open_jobs: 100}

A mapping without ``keys`` is read as the ``keys`` mapping itself.
``DAGFOLD_API_KEYS="key1:acme,key2:admin"`` adds keys from the environment.

Keys are looked up by their SHA-256, so the lookup's timing says nothing about
how much of a guessed key matched.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from dagfold.exceptions import DagfoldError
from dagfold.rules import check_id
from dagfold.services.api.errors import ApiError
from dagfold.tenants import DEFAULT, Entitlements, EntitlementsError

ADMIN = "admin"


class AuthConfigError(DagfoldError):
    """The auth file is missing or malformed."""


@dataclass(frozen=True)
class Principal:
    """The caller: a tenant (sees its own jobs) or an admin (sees all)."""

    name: str
    tenant: str | None = None
    admin: bool = False
    authenticated: bool = True

    def can_see(self, tenant: str) -> bool:
        return self.admin or self.tenant == tenant

    def scope(self, requested: str | None) -> str | None:
        """The tenant filter of a listing: a tenant key always lists its own tenant."""
        if self.admin:
            return requested
        if requested is not None and requested != self.tenant:
            raise ApiError(403, "forbidden", "a tenant key can only list its own tenant's jobs")
        return self.tenant


OPEN = Principal("anonymous", None, admin=True, authenticated=False)


TenantLimits = Entitlements  # admission reads rate_per_s, burst and max_open_jobs of a tenant's entitlements


@dataclass(frozen=True)
class AuthConfig:
    """Key digests to principals, plus optional per-tenant entitlements (``tenants:``)."""

    principals: Mapping[str, Principal] = field(default_factory=dict)
    limits: Mapping[str, Entitlements] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.principals)

    def entitlements(self, tenant: str) -> Entitlements:
        """The auth file's settings of ``tenant`` (no restriction when it names none)."""
        return self.limits.get(tenant, DEFAULT)

    def tenants(self) -> dict[str, Entitlements]:
        """Every tenant the file knows (with a key or a ``tenants:`` entry) and its settings."""
        out = {p.tenant: DEFAULT for p in self.principals.values() if p.tenant is not None}
        out.update(self.limits)
        return out

    def lookup(self, key: str) -> Principal | None:
        return self.principals.get(_digest(key))

    @classmethod
    def from_env(cls, auth_file: str | Path | None = None, env: Mapping[str, str] | None = None) -> AuthConfig:
        """From ``auth_file`` (else ``DAGFOLD_AUTH_FILE``) and ``DAGFOLD_API_KEYS``; empty means open."""
        env = os.environ if env is None else env
        path = auth_file or env.get("DAGFOLD_AUTH_FILE") or None
        doc: dict[str, Any] = load_file(Path(path)) if path else {}
        keys = dict(doc.get("keys", {}))
        for item in filter(None, (s.strip() for s in env.get("DAGFOLD_API_KEYS", "").split(","))):
            k, sep, who = item.rpartition(":")
            if not sep or not k or not who:
                raise AuthConfigError("DAGFOLD_API_KEYS must be 'key:tenant,key:admin,...'")
            keys[k] = who
        return cls(_principals(keys), _limits(doc.get("tenants", {})))


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise AuthConfigError(f"cannot read auth file {path}: {exc}") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise AuthConfigError(f"auth file {path} is not valid YAML/JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise AuthConfigError(f"auth file {path} must be a mapping of keys")
    if "keys" not in doc and "tenants" not in doc:
        doc = {"keys": doc}
    doc.setdefault("keys", {})  # tenants only: keys may come from DAGFOLD_API_KEYS
    if not isinstance(doc["keys"], dict):
        raise AuthConfigError(f"auth file {path}: 'keys' must map API keys to a tenant or 'admin'")
    return doc


def _principals(keys: Mapping[Any, Any]) -> dict[str, Principal]:
    out: dict[str, Principal] = {}
    for k, who in keys.items():
        k = str(k)
        if len(k) < 8:
            raise AuthConfigError("API keys must be at least 8 characters")
        if isinstance(who, dict):
            if who.get("role") == ADMIN or who.get("admin") is True:
                p = Principal(ADMIN, None, admin=True)
            elif isinstance(who.get("tenant"), str) and who["tenant"]:
                p = Principal(who["tenant"], _tenant_name(who["tenant"], f"key ...{k[-4:]}"))
            else:
                raise AuthConfigError(f"key ...{k[-4:]}: give 'tenant: NAME' or 'role: admin'")
        elif isinstance(who, str) and who:
            p = Principal(ADMIN, None, admin=True) if who == ADMIN else \
                Principal(who, _tenant_name(who, f"key ...{k[-4:]}"))
        else:
            raise AuthConfigError(f"key ...{k[-4:]}: value must be a tenant name or 'admin'")
        out[_digest(k)] = p
    return out


def _tenant_name(name: str, where: str) -> str:
    """A tenant name of the auth file, checked by the rules table (``dagfold.rules``): the API refuses
    such names in requests, so a key or settings for one could never be used (and a name like
    ``[/bold]`` would reach tables and metric labels)."""
    bad = check_id("tenant", name)
    if bad:
        raise AuthConfigError(f"auth file: {where}: {bad}")
    return name


def _limits(doc: Any) -> dict[str, Entitlements]:
    if not isinstance(doc, dict):
        raise AuthConfigError("'tenants' must map tenant names to their settings")
    out = {}
    for tenant, settings in doc.items():
        name = _tenant_name(str(tenant), "tenants")
        try:
            out[name] = Entitlements.parse(settings, f"tenant {name!r}")
        except EntitlementsError as exc:
            raise AuthConfigError(f"auth file: {exc}") from None
    return out


_bearer = HTTPBearer(auto_error=False, description="API key as a bearer token")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key")


def key_from_request(request: Request) -> str | None:
    """The API key of a request (Authorization: Bearer, else X-API-Key), or None."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def authenticate(config: AuthConfig, request: Request) -> Principal:
    if not config.enabled:
        return OPEN
    key = key_from_request(request)
    if key is None:
        raise ApiError(401, "unauthorized", "an API key is required: Authorization: Bearer <key> or X-API-Key",
                       headers={"WWW-Authenticate": "Bearer"})
    principal = config.lookup(key)
    if principal is None:
        raise ApiError(401, "unauthorized", "unknown API key", headers={"WWW-Authenticate": "Bearer"})
    return principal


def dependency(config: AuthConfig) -> Any:
    """A FastAPI dependency giving the ``Principal`` (declares both key schemes in the OpenAPI spec)."""

    def principal(
        request: Request,
        _b: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
        _k: Annotated[str | None, Depends(_header)],
    ) -> Principal:
        return authenticate(config, request)

    return principal
