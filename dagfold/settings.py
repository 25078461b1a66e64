"""Every setting of a dagfold process in one place: its flag, environment variable, default and meaning.

``Settings`` (pydantic-settings) declares them; ``load_settings`` resolves them with the precedence
flag > environment (``DAGFOLD_*``) > settings file (TOML, ``--config`` / ``DAGFOLD_CONFIG``) > default,
and turns a bad value into one ``SettingsError`` line that names the setting and what it allows.
``Config.from_env`` builds the processes' frozen ``Config`` from it; ``dagfold config`` prints the
resolved table with each value's source; docs/operations.md holds the same table
(``settings_markdown``; a test keeps the two equal).

Variables a task process *receives* (``DAGFOLD_JOB_ID``, ``DAGFOLD_ARGS_JSON``, ...) are not settings:
``TASK_ENVIRONMENT`` lists them.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from dagfold.exceptions import DagfoldError

ENV_PREFIX = "DAGFOLD_"
CONFIG_ENV = "DAGFOLD_CONFIG"

# Set by dagfold for a task's process (shell handler, GPU job launcher): read there, never settings.
TASK_ENVIRONMENT = ("DAGFOLD_JOB_ID", "DAGFOLD_TASK_ID", "DAGFOLD_ATTEMPT", "DAGFOLD_IDEMPOTENCY_KEY",
                    "DAGFOLD_ARGS_JSON", "DAGFOLD_ALLOC_ID", "DAGFOLD_EPOCH", "DAGFOLD_CHECKPOINT_DIR",
                    "DAGFOLD_RESUME_CHECKPOINT", "DAGFOLD_OUTPUT_DIR", "DAGFOLD_SPEED", "DAGFOLD_WORK_DIR")


class SettingsError(DagfoldError, ValueError):
    """A setting has a value it does not allow; the message names it and what it allows."""


def _s(default: Any, meaning: str, flag: str = "", group: str = "core", **kw: Any) -> Any:
    return Field(default, description=meaning, json_schema_extra={"flag": flag, "group": group}, **kw)


class Settings(BaseSettings):
    """The settings table (env var = ``DAGFOLD_`` + the upper-cased field name)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid", case_sensitive=False,
                                      env_ignore_empty=True)  # VAR= means unset, as the readers before

    # -- where the log and the state live
    log: str = _s("embedded", "log backend: `embedded` (a RocksDB folder, one process) or "
                  "`kafka://HOST:PORT[,HOST:PORT][?prefix=P]`", "--log", min_length=1)
    data: Path = _s(Path(".dagfold"), "data folder: state, projections, embedded log, callback ledger", "--data")
    topic_prefix: str = _s("", "prefix of every topic, group and transactional id on the cluster "
                           "(`?prefix=` in --log wins)", pattern=r"^[A-Za-z0-9._-]*$", max_length=100)
    artifacts: str = _s("", "task outputs and GPU checkpoints: empty = DATA/artifacts, `file:PATH` or "
                        "`s3://bucket/prefix?endpoint=URL&region=R`")
    # -- topics (created at start when missing)
    partitions: int = _s(8, "partitions of the commands and events topics (the scheduler's parallelism)",
                         ge=1, le=10_000)
    dispatch_partitions: int | None = _s(None, "partitions of each dispatch.<queue> topic (unset: 8 on the "
                                         "embedded log, 1 on Kafka)", ge=1, le=10_000)
    allocator_partitions: int = _s(4, "partitions of the allocator topics (GPU pools hash onto them)", ge=1, le=1000)
    replication: int = _s(1, "replication factor of every topic (3 in production; min.insync 2 then)", ge=1, le=15)
    events_retention_ms: int = _s(-1, "retention of the events and dead-letter topics, ms (-1: forever; "
                                  "they are the audit log)", ge=-1)
    commands_retention_ms: int = _s(7 * 24 * 3600 * 1000, "retention of commands, dispatch and control, ms",
                                    ge=-1)
    finished_job_retention_ms: int = _s(-1, "how long a finished job's state (scheduler and read models: the API "
                                        "answers 404 after) is kept after its end, ms (-1: forever); its events "
                                        "stay in the log for events_retention_ms", ge=-1)
    # -- scheduler
    redispatch_after_s: float = _s(300.0, "a runnable task no worker took this many seconds after its dispatch is "
                                   "dispatched again (a lost dispatch record), then after twice as long, up to 8x; "
                                   "0: never. Keep it well above the queues' normal wait", group="scheduler", ge=0)
    redispatch_after_s_by_queue: str = _s("", "per queue, replacing redispatch_after_s: `queue=seconds,queue=seconds`",
                                          group="scheduler",
                                          pattern=r"^(\s*[A-Za-z0-9._-]+\s*=\s*[0-9]+(\.[0-9]+)?\s*"
                                                  r"(,\s*[A-Za-z0-9._-]+\s*=\s*[0-9]+(\.[0-9]+)?\s*)*)?$")
    commit_interval_s: float = _s(0.1, "how long the scheduler's log transaction stays open across polls, seconds "
                                  "(Kafka Streams' commit.interval.ms): dispatches leave at once, events and "
                                  "offsets commit within it; 0: one transaction per poll", group="scheduler",
                                  ge=0, le=10)
    # -- API
    api_host: str = _s("127.0.0.1", "address the API listens on (`dagfold up`)", group="api", min_length=1)
    port: int = _s(8080, "port of the API and dashboard (`dagfold up`)", "--port", group="api", ge=1, le=65535)
    auth_file: Path | None = _s(None, "API keys per tenant (YAML/JSON); without it and DAGFOLD_API_KEYS the API "
                                "is open", "--auth-file", group="api")
    api_keys: str = _s("", "API keys from the environment: `key:tenant,key:admin`", group="api")
    api_allowed_hosts: str = _s("", "more Host names the API answers (comma-separated; `*`: any, behind a proxy "
                                "that checks Host)", group="api")
    api_allowed_origins: str = _s("", "more origins whose browser pages may write (comma-separated)", group="api")
    api_token: str | None = _s(None, "a local token every API and metrics request must carry (shared machines; "
                               "`dagfold up --token`)", group="api")
    token_dir: Path | None = _s(None, "where `dagfold up --token` keeps its token for the same user's CLI "
                                "(default ~/.dagfold/tokens)", group="client")
    submit_rate: float = _s(20.0, "submissions per second per tenant (token bucket)", group="api", ge=0)
    submit_burst: int = _s(50, "submission burst per tenant", group="api", ge=1)
    max_open_jobs: int = _s(10_000, "unfinished jobs per tenant; more are refused (429)", group="api", ge=1)
    trace_ui: str = _s("", "a trace viewer's page of one trace, `{trace_id}` replaced (e.g. Jaeger's "
                       "`http://127.0.0.1:16686/trace/{trace_id}`): the dashboard links each job to it",
                       group="api", pattern=r"^(https?://[^\s]*\{trace_id\}[^\s]*)?$")
    # -- clients
    api: str = _s("http://127.0.0.1:8080", "the API client commands talk to", "--api", group="client",
                  pattern=r"^https?://")
    api_key: str | None = _s(None, "the client's API key (sent as a bearer token)", "--api-key", group="client")
    # -- processes
    metrics_port: int | None = _s(None, "serve Prometheus /metrics on this port (worker, scheduler, ...)",
                                  "--metrics-port", group="process", ge=1, le=65535)
    log_format: Literal["text", "json"] = _s("text", "process log lines: `text`, or `json` with trace_id, job_id, "
                                             "task_id, attempt, partition and offset fields", "--log-format",
                                             group="process")
    handlers: str | None = _s(None, "handlers the workers run, comma-separated (default: noop, sleep and those "
                              "registered in Python; `shell` only where listed)", "--handlers", group="process")
    task_user: str | None = _s(None, "run task processes as this user (the worker runs as root)", "--task-user",
                               group="process")
    allow_root_tasks: bool = _s(False, "run task processes (shell tasks, GPU jobs) as root when no task user is "
                                "given; refused at start otherwise", "--allow-root-tasks", group="process")
    task_dir: Path | None = _s(None, "folder of the per-attempt work folders of task processes (default: the "
                               "system temp folder)", "--task-dir", group="process")
    traces_nice: int = _s(10, "how far the span exporter (`dagfold traces`, its thread in `dagfold up`) lowers its "
                          "CPU priority, as `nice` does: on a busy host the scheduler and workers go first and "
                          "spans wait; 0: the same as theirs", group="process", ge=0, le=19)
    kafka_sasl_password: str | None = _s(None, "the Kafka SASL password (kept out of --log, which every local "
                                         "user sees in the process list)", group="core")
    # -- job-end callbacks (the notifier)
    callback_secret: str = _s("", "HMAC key of callback signatures (empty: one generated into "
                              "DATA/callbacks-secret; set it in production)", group="callbacks")
    callback_timeout_s: float = _s(10.0, "one delivery attempt as a whole (connect, TLS, send, the answer), "
                                   "seconds", group="callbacks", gt=0)
    callback_max_attempts: int = _s(8, "delivery attempts before giving up", group="callbacks", ge=1)
    callback_base_backoff_s: float = _s(1.0, "first retry delay, seconds (doubles)", group="callbacks", ge=0)
    callback_max_backoff_s: float = _s(300.0, "longest retry delay, seconds", group="callbacks", ge=0)
    callback_concurrency: int = _s(8, "deliveries in flight at once", group="callbacks", ge=1)
    callback_tenant_concurrency: int = _s(4, "of those, one tenant's at most (its slow receivers leave the rest "
                                          "free)", group="callbacks", ge=1)
    callback_allow: str = _s("", "addresses callbacks may reach although loopback, private, link-local...: "
                             "comma-separated CIDRs (`127.0.0.1/32,10.1.0.0/16`), never the API's, metrics' or "
                             "Kafka brokers' ports there; empty: public addresses only", group="callbacks",
                             pattern=r"^[0-9A-Fa-f:.,/\s]*$")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (passed as init values) > environment > the settings file > defaults."""
        path = _FILE.get()
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if path is not None:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=path),)
        return sources


_FILE: ContextVar[Path | None] = ContextVar("dagfold_settings_file", default=None)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _allowed(info: FieldInfo) -> str:
    parts = []
    for m in info.metadata:
        for attr, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{word} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            parts.append(f"matching {m.pattern}")
    ann = info.annotation
    kind = getattr(ann, "__name__", str(ann)).replace("NoneType", "none")
    if "Literal" in str(ann):
        kind = "one of " + ", ".join(repr(a) for a in getattr(ann, "__args__", ()))
    return f"{kind}{' ' + ' and '.join(parts) if parts else ''} (default {info.default!r})"


def settings_file(env: Mapping[str, str] | None = None) -> Path | None:
    """The settings file named by DAGFOLD_CONFIG (``dagfold --config FILE`` sets it), if any."""
    value = (os.environ if env is None else env).get(CONFIG_ENV)
    return Path(value) if value else None


def load_settings(flags: Mapping[str, Any] | None = None, file: Path | None = None) -> Settings:
    """The settings: flag > environment > file (``file`` or DAGFOLD_CONFIG) > default. A bad value raises
    ``SettingsError`` naming the setting as the user gave it (variable, flag or file key) and what it allows."""
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    path = file or settings_file()
    if path is not None:
        try:
            tomllib.loads(path.read_text())
        except OSError as exc:
            raise SettingsError(f"settings file {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"settings file {path} is not TOML: {exc}") from None
    token = _FILE.set(path)
    try:
        return Settings(**given)
    except ValidationError as exc:
        e = exc.errors()[0]
        name = str(e["loc"][0]) if e["loc"] else "?"
        info = Settings.model_fields.get(name)
        if info is None:
            raise SettingsError(f"settings file {path}: unknown setting {name!r}; `dagfold config` lists "
                                "them") from None
        src = source_of(name, given, path)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        where = {"env": env_name(name), "flag": str(extra.get("flag") or name)}.get(src, f"{name} in {path}")
        raise SettingsError(f"{where}={e.get('input')!r}: {e['msg'][:1].lower() + e['msg'][1:]}; allowed: "
                            f"{_allowed(info)}") from None
    finally:
        _FILE.reset(token)


def source_of(name: str, flags: Mapping[str, Any], path: Path | None) -> str:
    """Where a setting's value comes from: flag, env, file or default (the same order as the sources)."""
    if flags.get(name) is not None:
        return "flag"
    if any(k.upper() == env_name(name) for k in os.environ):
        return "env"
    if path is not None:
        try:
            if name in tomllib.loads(path.read_text()):
                return "file"
        except (OSError, tomllib.TOMLDecodeError):
            pass
    return "default"


def settings_rows() -> list[dict[str, str]]:
    """The table: setting, flag, environment variable, default, meaning (group order)."""
    rows = []
    for name, info in Settings.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        default = info.default
        rows.append({"setting": name, "flag": str(extra.get("flag") or ""), "env": env_name(name),
                     "default": "" if default in (None, "") else str(default), "group": str(extra.get("group")),
                     "meaning": info.description or ""})
    return rows


def settings_markdown() -> str:
    """docs/operations.md's settings table."""
    lines = ["| environment variable | flag | default | meaning |", "|---|---|---|---|"]
    for r in settings_rows():
        flag = f"`{r['flag']}`" if r["flag"] else ""
        default = f"`{r['default']}`" if r["default"] else ""
        meaning = r["meaning"].replace("|", "\\|")
        lines.append(f"| `{r['env']}` | {flag} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"
