"""The local API token: a secret that ``dagfold up --token`` requires of every API call, as Jupyter does.

For a machine that other users share: without it, anyone who can reach the loopback port can use the open
API. The token is written to a file only its owner can read (``~/.dagfold/tokens/<host>-<port>``, mode 0600
in a 0700 folder; ``DAGFOLD_TOKEN_DIR`` moves the folder), so the same user's CLI finds it with no flag, and
``dagfold up`` prints the dashboard's address with the token (``/ui/?token=...``: the page keeps it and
removes it from the address bar).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})  # noqa: S104 - names, not binds


def token_dir() -> Path:
    return Path(os.environ.get("DAGFOLD_TOKEN_DIR") or Path.home() / ".dagfold" / "tokens")


def _host_key(host: str, port: int) -> str:
    host = host.strip("[]").lower()
    try:
        loop = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    name = "loopback" if loop or host in LOOPBACK_NAMES else host
    return f"{name.replace(':', '_')}-{port}"


def token_path(host: str, port: int) -> Path:
    return token_dir() / _host_key(host, port)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(host: str, port: int, token: str) -> Path:
    """Store ``token`` for the API at ``host:port``, readable by this user only."""
    folder = token_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = token_path(host, port)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return path


def read_token(api_url: str) -> str | None:
    """The token stored for the API at ``api_url``, or None (no file, or not readable)."""
    try:
        parts = urlsplit(api_url)
        if not parts.hostname:
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return token_path(parts.hostname, port).read_text().strip() or None
    except (OSError, ValueError):  # no file, or a malformed URL (the request itself then says so)
        return None


def remove_token(host: str, port: int, token: str) -> None:
    """Remove the stored token if it is still ``token`` (another stack may have replaced it)."""
    path = token_path(host, port)
    try:
        if path.read_text().strip() == token:
            path.unlink()
    except OSError:
        pass
