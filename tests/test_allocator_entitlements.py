"""Tenant entitlements in the GPU allocator (issue 12, bullet 5): GPU quotas per pool and per GPU type, and
weights and quotas that change through the log while the allocator runs.

The fold-level cases use the virtual-time harness (the production fold); the last one runs ``dagfold up``'s
stack in this process with an auth file and changes a tenant's quota through the admin API. Each failed on
the code before: the allocator ignored ``pool/type`` quotas and read settings only from the auth file at start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagfold.codec import Record, default_codec
from dagfold.commands import set_allocator_entitlements
from dagfold.config import ALLOCATOR_EVENTS, Config
from dagfold.services.allocator.harness import AllocatorHarness
from dagfold.services.allocator.options import options_for_pool
from dagfold.tenants import Entitlements
from tests.cli_support import free_port
from tests.gpu_support import read_all


def harness(**ents: dict[str, Any]) -> AllocatorHarness:
    """Pool ``default``: one H100 host and one A100 host of 8 GPUs; ``ents`` as the auth file's tenants."""
    h = AllocatorHarness(options_for_pool("default", {t: Entitlements.parse(e) for t, e in ents.items()},
                                          notify_scheduler=False))
    h.register("h", gpu_type="H100", gpus=8)
    h.register("a", gpu_type="A100", gpus=8)
    return h


def set_ent(h: AllocatorHarness, tenant: str, doc: dict[str, Any], source: str = "admin_api") -> None:
    """What the admin API writes to ``allocator.commands`` (encoded and decoded: the schema holds it)."""
    codec = default_codec()
    for cmd in set_allocator_entitlements(tenant, Entitlements.parse(doc).to_record(), 1, source):
        h.process(codec.decode(codec.encode(cmd, validate_record=True)))


def granted_on(h: AllocatorHarness, job_id: str) -> str | None:
    """The GPU type job_id's allocation runs on (None: not granted)."""
    aid = h.alloc_of(job_id)
    if aid is None:
        return None
    return h.fold.state.nodes[h.fold.state.allocs[aid].parts[0].node].gpu_type


def test_a_tenant_over_its_quota_for_one_gpu_type_waits_while_its_other_types_and_other_tenants_are_served() -> None:
    h = harness(acme={"gpu_quota": {"default/H100": 2}})
    for j in ("h1", "h2", "h3"):
        h.request(j, tenant="acme", gpus=1, gpu_type=["H100"])
    assert [granted_on(h, j) for j in ("h1", "h2", "h3")] == ["H100", "H100", None]  # the third waits
    h.request("beta-h", tenant="beta", gpus=1, gpu_type=["H100"])  # another tenant: H100s are free for it
    h.request("acme-a", tenant="acme", gpus=1, gpu_type=["A100"])  # acme's other type
    h.request("acme-any", tenant="acme", gpus=1)  # any type: placed on the type acme still may use
    h.request("acme-either", tenant="acme", gpus=1, gpu_type=["H100", "A100"])
    assert [granted_on(h, j) for j in ("beta-h", "acme-a", "acme-any", "acme-either")] == [
        "H100", "A100", "A100", "A100"]
    assert granted_on(h, "h3") is None
    h.release(h.alloc_of("h1"))  # acme is under its H100 quota again: its waiting request goes first
    assert granted_on(h, "h3") == "H100"
    # bigger than the quota of every type it names: it could never run, so it is refused at once
    h.request("h-big", tenant="acme", gpus=4, gpu_type=["H100"])
    assert h.of_type("RequestRejected")[-1]["job_id"] == "h-big"
    assert "default/H100: 2" in h.of_type("RequestRejected")[-1]["reason"]
    assert h.replayed_digest() == h.digest()


def test_a_pool_quota_and_type_quotas_apply_together() -> None:
    h = harness(acme={"gpu_quota": {"default": 3, "default/A100": 1}})
    for j in ("x1", "x2", "x3", "x4"):
        h.request(j, tenant="acme", gpus=1)
    assert sorted(str(granted_on(h, j)) for j in ("x1", "x2", "x3", "x4")) == ["A100", "H100", "H100", "None"]


def test_weights_and_quotas_set_through_the_log_apply_at_once_and_on_replay() -> None:
    h = harness(acme={"gpu_quota": {"default/H100": 1}})
    h.request("h1", tenant="acme", gpus=1, gpu_type=["H100"])
    h.request("h2", tenant="acme", gpus=1, gpu_type=["H100"])
    assert granted_on(h, "h2") is None
    set_ent(h, "acme", {"gpu_quota": {"default/H100": 2}, "weight": 4})
    assert h.of_type("TenantEntitlementsSet")[-1]["tenant"] == "acme"
    assert granted_on(h, "h2") == "H100"  # the raised quota served the waiting request, no restart
    assert h.fold.state.weight("acme") == 4.0 and h.fold.state.weight("other") == 1.0
    set_ent(h, "acme", {"gpu_quota": {"default": 2}})  # lowered: nothing is stopped, nothing more granted
    h.request("a1", tenant="acme", gpus=1, gpu_type=["A100"])
    assert granted_on(h, "a1") is None and h.fold.state.weight("acme") == 1.0
    # the same state from the events alone, and from the store after a restart
    assert h.replayed_digest() == h.digest()
    h.fold.reload()
    assert h.fold.state.quota_milli("acme") == 2000 and h.fold.state.weight("acme") == 1.0


def test_a_reservation_of_a_tenant_now_over_its_quota_is_cleared() -> None:
    """A head-of-line request holds a reservation; its tenant's quota is lowered below what it would need: the
    reservation goes (it would hold hosts back from everyone while the request may not run) and it waits."""
    h = harness()
    h.request("big0", tenant="beta", gpus=8, gpu_type=["H100"], max_runtime_s=600)
    h.request("big1", tenant="acme", gpus=8, gpu_type=["H100"], max_runtime_s=600)
    assert [e["job_id"] for e in h.of_type("ReservationMade")] == ["big1"]
    set_ent(h, "acme", {"gpu_quota": {"default/H100": 4}})
    assert h.of_type("ReservationCleared")[-1]["job_id"] == "big1"
    assert "quota" in h.of_type("ReservationCleared")[-1]["reason"]
    assert not h.fold.state.meta["reservations"] and granted_on(h, "big1") is None
    h.release(h.alloc_of("big0"))
    assert granted_on(h, "big1") is None  # still over its quota
    set_ent(h, "acme", {"gpu_quota": {"default/H100": 8}})
    assert granted_on(h, "big1") == "H100"
    assert h.replayed_digest() == h.digest()


def test_auth_file_settings_resent_at_start_do_not_undo_an_admin_change() -> None:
    h = harness()
    set_ent(h, "acme", {"weight": 2}, "auth_file")
    set_ent(h, "acme", {"weight": 5}, "admin_api")
    set_ent(h, "acme", {"weight": 2}, "auth_file")  # an API restart with the same file
    assert [e["entitlements"]["weight"] for e in h.of_type("TenantEntitlementsSet")] == [2.0, 5.0]
    assert h.fold.state.weight("acme") == 5.0


def test_malformed_settings_from_the_log_are_refused() -> None:
    from dagfold.services.allocator.exceptions import InvalidCommandError

    h = harness()
    [cmd] = set_allocator_entitlements("acme", Entitlements().to_record(), 1)
    cmd["entitlements"]["gpu_quota"] = {"default/h 100": 1.0}
    with pytest.raises(InvalidCommandError, match="gpu_type 'h 100'"):
        h.process(cmd)
    assert not h.of_type("TenantEntitlementsSet")


# -- live: dagfold up's stack, the admin API, the allocator running ----------------------------------------

ADMIN = "admin-key-0123456789"
BETA = "beta-key-0123456789"


def _wait(what: str, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_quota_changed_through_the_admin_api_reaches_the_running_allocator(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from dagfold.services.stack import Stack, StackOptions

    auth = tmp_path / "auth.yaml"
    auth.write_text(f"keys: {{{ADMIN}: admin, {BETA}: beta}}\ntenants: {{beta: {{gpu_quota: {{default: 1}}}}}}\n")
    monkeypatch.setenv("DAGFOLD_AUTH_FILE", str(auth))
    cfg = Config(data_dir=tmp_path / "data", partitions=2, dispatch_partitions=1, api_port=free_port())
    with Stack(cfg, StackOptions(workers=0, gpu_nodes=1, gpus_per_node=2)) as stack:
        base = f"http://127.0.0.1:{cfg.api_port}"
        hb = {"Authorization": f"Bearer {BETA}"}
        job = {"model": "m", "resources": {"gpus": 1}, "params": {"steps": 3000, "step_s": 0.1}}  # 5 min
        for jid in ("q1", "q2"):
            r = httpx.post(f"{base}/v1/gpu-jobs", json={"job_id": jid, **job}, headers=hb, timeout=10)
            assert r.status_code == 202, r.text

        def events() -> list[Record]:
            assert stack.log is not None
            return read_all(stack.log, ALLOCATOR_EVENTS)

        def kinds(job_id: str) -> list[str]:
            return [e["type"].rsplit(".", 1)[1] for e in events() if e.get("job_id") == job_id]

        _wait("q1 granted, q2 queued", lambda: "AllocationGranted" in kinds("q1") and "RequestQueued" in kinds("q2"))
        time.sleep(1.0)  # several heartbeats and passes: q2 still waits for beta's quota of 1 GPU
        assert "AllocationGranted" not in kinds("q2")
        r = httpx.put(f"{base}/v1/tenants/beta/entitlements", json={"gpu_quota": {"default": 2}, "weight": 3},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert r.status_code == 202, r.text
        _wait("q2 granted after the change", lambda: "AllocationGranted" in kinds("q2"))
        evs = events()
        at = [i for i, e in enumerate(evs) if e["type"].endswith("TenantEntitlementsSet")
              and e["entitlements"]["gpu_quota"] == {"default": 2.0}]
        granted = [i for i, e in enumerate(evs) if e["type"].endswith("AllocationGranted") and e["job_id"] == "q2"]
        assert at and granted and at[0] < granted[0]
        assert evs[at[0]]["entitlements"]["weight"] == 3.0 and evs[at[0]]["source"] == "admin_api"
        assert not [e for e in evs if e.get("job_id") == "q1" and e["type"].endswith(("Released", "Expired"))]
        assert not stack.failed, stack.errors
        for jid in ("q1", "q2"):
            httpx.post(f"{base}/v1/gpu-jobs/{jid}/cancel", headers=hb, timeout=10)
