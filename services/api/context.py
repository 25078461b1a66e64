"""What every route needs: the read models, the command sender, auth and admission.

One object built by ``create_app`` and passed to the route modules, so routes
are plain closures over it (typed, no globals, several apps per process in
tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from dagfold.artifacts import ArtifactStore, open_store
from dagfold.commands import CommandSender
from dagfold.config import COMMANDS, Config
from dagfold.exceptions import CodecError, LogError, disk_full
from dagfold.log.base import Log
from dagfold.projections.cluster import ClusterModel
from dagfold.projections.jobs import ReadModel
from dagfold.projections.operator import OperatorModel
from dagfold.services.api.admission import Admission
from dagfold.services.api.auth import AuthConfig, Principal
from dagfold.services.api.errors import ApiError, not_found
from dagfold.services.api.graph import LayoutCache
from dagfold.services.callbacks.egress import EgressRules
from dagfold.services.callbacks.ledger import CallbackLedger
from dagfold.services.worker.handlers import HandlerRegistry
from dagfold.tenants import DEFAULT, Entitlements

logger = logging.getLogger("dagfold.api")


class ApiSender:
    """The API's use of the one ``CommandSender`` (shared by request threads): its errors become
    HTTP answers. ``log`` None: a read-only API (dagfold serve), every send refused."""

    def __init__(self, log: Log | None) -> None:
        self._sender = CommandSender(log, "api") if log is not None else None

    def send(self, record: dict[str, Any], key: str, topic: str = COMMANDS) -> None:
        if self._sender is None:
            raise ApiError(405, "read_only", "this API is read-only: it has no command log")
        try:
            self._sender.send(record, key, topic)
        except CodecError as exc:
            raise ApiError(400, "invalid_spec", str(exc)) from None
        except LogError as exc:
            logger.warning("api: cannot write %s: %s", record["type"], exc)
            reason = "no space left on device" if disk_full(exc) else str(exc)
            raise ApiError(503, "log_unavailable", f"the command log is unavailable: {reason}",
                           headers={"Retry-After": "30"}) from None

    def close(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close()
            except LogError as exc:
                logger.warning("api: producer close failed: %s", exc)


@dataclass
class ApiContext:
    log: Log | None  # None: a read-only API
    rm: ReadModel
    config: Config
    sender: ApiSender
    auth: AuthConfig
    admission: Admission
    body_limit: int
    sse_poll_s: float = 0.25
    layouts: LayoutCache = field(default_factory=LayoutCache)
    callbacks: CallbackLedger | None = None  # the notifier's ledger when it runs in this process
    # where callbacks may go (DAGFOLD_CALLBACK_ALLOW): literal addresses it denies are refused at submission
    egress: EgressRules = field(default_factory=EgressRules.from_env)
    artifacts: ArtifactStore | None = None  # task outputs (opened from config.artifacts_url on first use)
    # the workers' capabilities when they run in this process (dagfold up): handlers outside them are refused
    handlers: HandlerRegistry | None = None

    def __post_init__(self) -> None:
        if self.config.api_port not in self.egress.own_ports:  # this API's own port is never a callback's
            self.egress = replace(self.egress, own_ports=self.egress.own_ports | {self.config.api_port})

    def artifact_store(self) -> ArtifactStore:
        if self.artifacts is None:
            self.artifacts = open_store(self.config.artifacts_url, self.config.data_dir)
        return self.artifacts

    @property
    def ops(self) -> OperatorModel:
        return OperatorModel(self.rm.store)

    @property
    def cluster(self) -> ClusterModel:
        return ClusterModel(self.rm.store)

    def entitlements(self, tenant: str) -> Entitlements | None:
        """What ``tenant`` may use: as last set through the log (admin API, the auth file at start), else the
        auth file's; with keys configured a tenant without settings gets the defaults (no shell). None: an
        open API's tenant without settings (no restriction but the deployment's handlers)."""
        stored = self.rm.tenant_settings(tenant)
        if stored is not None:
            return Entitlements.from_record(stored["entitlements"])
        if tenant in self.auth.limits:
            return self.auth.limits[tenant]
        return DEFAULT if self.auth.enabled else None

    def job_for(self, job_id: str, principal: Principal) -> dict[str, Any]:
        """The job if it exists and the caller may see it; else the same 404 either way.

        A tenant's caller is checked against the job's tenant alone before the job is decoded, so another
        tenant's job answers 404 as fast as a missing one (no timing oracle on its size).
        """
        if not principal.admin:
            tenant = self.rm.job_tenant(job_id)
            if tenant is None or not principal.can_see(tenant):
                raise not_found(job_id)
        job = self.rm.get_job(job_id)
        if job is None:
            raise not_found(job_id)
        return job

    def job_summary_for(self, job_id: str, principal: Principal) -> dict[str, Any]:
        """``job_for``, except that a tenant whose submission of ``job_id`` lost the race for the ID to another
        tenant's job sees that submission as rejected (``job_id_taken``), never the other job and never 404."""
        try:
            return self.job_for(job_id, principal)
        except ApiError:
            claim = self.own_rejected_claim(job_id, principal)
            if claim is None:
                raise
            return claim

    def own_rejected_claim(self, job_id: str, principal: Principal) -> dict[str, Any] | None:
        """The caller's own submission of ``job_id`` rejected ``job_id_taken`` (it lost the race for the ID to
        another tenant's job), as a rejected job summary; None if there is none (or the caller is an admin)."""
        return self.rm.rejected_claim(principal.tenant, job_id) if principal.tenant is not None else None




def parse_time_ms(value: str | None, name: str) -> int | None:
    """A time given as ms since the epoch or as ISO 8601 (``2024-05-01T12:00:00Z``)."""
    if value is None or value == "":
        return None
    v = value.strip()
    if v.isascii() and v.lstrip("-").isdigit():  # isdigit alone accepts "²", which int() refuses
        n = int(v)
        if n < 0 or n > 10**16 - 1:
            raise ApiError(400, "invalid_request", f"{name}: ms since the epoch must be in [0, 1e16)")
        return n
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, "invalid_request", f"{name}: give ms since the epoch or ISO 8601, not {value!r}") from None
    if dt.tzinfo is None:
        raise ApiError(400, "invalid_request", f"{name}: an ISO 8601 time needs a zone (Z or +hh:mm)")
    try:
        return max(int(dt.timestamp() * 1000), 0)
    except (OverflowError, OSError, ValueError):
        raise ApiError(400, "invalid_request", f"{name}: time out of range") from None


class LiveEntitlements(Mapping[str, Entitlements]):
    """Tenants' entitlements as ``ApiContext.entitlements`` finds them now (the log's copy, else the auth
    file's): admission reads rate limits and open-job caps through it, so a change made through the admin
    API applies without a restart. Only ``get`` is used per request (one read-model lookup)."""

    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    def __getitem__(self, tenant: str) -> Entitlements:
        ent = self._ctx.entitlements(tenant)
        if ent is None:
            raise KeyError(tenant)
        return ent

    def __iter__(self) -> Iterator[str]:
        return iter(self._ctx.auth.limits)

    def __len__(self) -> int:
        return len(self._ctx.auth.limits)

    def __bool__(self) -> bool:
        return True
