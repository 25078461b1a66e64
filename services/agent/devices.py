"""GPU inventory and health as the allocator needs them: per GPU, so one bad GPU is cordoned alone.

``NvmlDevices`` reads real GPUs through NVML (``nvidia-ml-py``, the ``gpu``
extra, imported only here): per GPU utilisation, memory, temperature, clock
(throttle) event reasons, uncorrectable ECC errors and critical Xid events
(an NVML event set, drained at every heartbeat). Throughput is not read here:
clocks say how fast a GPU may run, not how fast its job goes; the agent
measures it from the jobs' progress (``dagfold.services.agent.agent``). ``SimulatedDevices`` is a device
model with injectable faults for tests and demos, for the whole host or one
GPU: ``crash`` (the agent goes silent), ``throttle`` (thermal throttling,
jobs at half speed), ``ecc``/``xid`` (error counters), ``slow`` (throughput
far below nominal with no flag raised: the allocator notices it against the
fleet).

Both produce a ``Health`` snapshot with one ``GpuHealth`` per GPU. A GPU that
is not ``ok`` is cordoned by the allocator (no new placements there; its jobs
checkpoint and move) while the host serves on with its other GPUs; the host
as a whole reports ``ok`` unless every GPU is bad (then it is drained).
Uncorrectable ECC errors and hardware Xids are sticky until the agent
restarts (the GPU needs a reset); throttling clears when it stops.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from dagfold.services.agent.exceptions import NvmlUnavailable

FAULTS = ("crash", "throttle", "ecc", "xid", "slow")
GPU_FAULTS = ("throttle", "ecc", "xid")
# Xids that mean the GPU itself is bad (double-bit ECC, row-remap failure, fallen off the bus, uncontained
# memory errors, GSP errors, ...); others (13, 31, 43: the application's faults) are counted, not cordoned.
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


@dataclass(frozen=True)
class GpuHealth:
    index: int
    health: str = "ok"  # ok | throttled | ecc_errors | xid
    detail: str | None = None
    utilization: float | None = None  # 0..1
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    temperature_c: float | None = None
    throttle_reasons: int = 0
    ecc_errors: int = 0
    xid_errors: int = 0
    last_xid: int | None = None

    def record(self) -> dict[str, Any]:
        return {"index": self.index, "health": self.health, "detail": self.detail, "utilization": self.utilization,
                "memory_used_mib": self.memory_used_mib, "memory_total_mib": self.memory_total_mib,
                "temperature_c": self.temperature_c, "throttle_reasons": self.throttle_reasons,
                "ecc_errors": self.ecc_errors, "xid_errors": self.xid_errors, "last_xid": self.last_xid}


@dataclass(frozen=True)
class Health:
    health: str  # ok | throttled | ecc_errors | xid | slow
    detail: str | None = None
    perf: float | None = None
    temperature_c: float | None = None
    ecc_errors: int = 0
    xid_errors: int = 0
    throttle_events: int = 0
    gpus: tuple[GpuHealth, ...] = ()

    @property
    def utilization(self) -> float | None:
        us = [g.utilization for g in self.gpus if g.utilization is not None]
        return sum(us) / len(us) if us else None


def host_health(gpus: list[GpuHealth], perf: float | None) -> Health:
    """The host's snapshot from its GPUs': ok unless every GPU is bad (then the first bad one's reason)."""
    bad = [g for g in gpus if g.health != "ok"]
    temps = [g.temperature_c for g in gpus if g.temperature_c is not None]
    base: dict[str, Any] = {"perf": perf, "temperature_c": max(temps) if temps else None,
                            "ecc_errors": sum(g.ecc_errors for g in gpus),
                            "xid_errors": sum(g.xid_errors for g in gpus),
                            "throttle_events": sum(1 for g in gpus if g.health == "throttled"), "gpus": tuple(gpus)}
    if gpus and len(bad) == len(gpus):
        return Health(bad[0].health, "; ".join(f"GPU {g.index}: {g.detail}" for g in bad), **base)
    return Health("ok", None, **base)


class Devices(Protocol):
    gpu_type: str
    count: int

    def health(self, busy: frozenset[int] = frozenset()) -> Health:
        """A snapshot; ``busy`` are the GPUs the agent's processes hold (the simulated model's utilisation)."""

    def speed(self) -> float:
        """Relative speed jobs run at (1.0 nominal); the simulated model slows jobs down with it."""


@dataclass
class SimulatedDevices:
    """A host of ``count`` GPUs of ``gpu_type`` whose faults tests switch on and off (host-wide or per GPU)."""

    count: int = 8
    gpu_type: str = "H100"
    faults: set[str] = field(default_factory=set)
    ecc: int = 0
    xid: int = 0
    throttles: int = 0
    gpu_faults: dict[int, set[str]] = field(default_factory=dict)

    def inject(self, fault: str, gpu: int | None = None) -> None:
        if fault not in FAULTS or (gpu is not None and fault not in GPU_FAULTS):
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)} (per GPU: "
                             f"{', '.join(GPU_FAULTS)})")
        if gpu is not None:
            if not 0 <= gpu < self.count:
                raise ValueError(f"no GPU {gpu} on a host of {self.count}")
            self.gpu_faults.setdefault(gpu, set()).add(fault)
            return
        self.faults.add(fault)
        if fault == "ecc":
            self.ecc += 1
        elif fault == "xid":
            self.xid += 1
        elif fault == "throttle":
            self.throttles += 1

    def clear(self, fault: str, gpu: int | None = None) -> None:
        if gpu is not None:
            self.gpu_faults.get(gpu, set()).discard(fault)
        else:
            self.faults.discard(fault)

    @property
    def crashed(self) -> bool:
        return "crash" in self.faults

    def speed(self) -> float:
        if "slow" in self.faults:
            return 0.3
        return 0.5 if "throttle" in self.faults else 1.0

    def health(self, busy: frozenset[int] = frozenset()) -> Health:
        temp = 92.0 if "throttle" in self.faults else 55.0
        gpus = []
        for i in range(self.count):
            f = self.gpu_faults.get(i, set())
            g: dict[str, Any] = {"utilization": round(0.95 * self.speed(), 4) if i in busy else 0.0,
                                 "memory_used_mib": 60_000 if i in busy else 0, "memory_total_mib": 81_559,
                                 "temperature_c": 90.0 if "throttle" in f else temp,
                                 "ecc_errors": int("ecc" in f), "xid_errors": int("xid" in f),
                                 "last_xid": 79 if "xid" in f else None,
                                 "throttle_reasons": 0x40 if "throttle" in f else 0}
            if "ecc" in f:
                gpus.append(GpuHealth(i, "ecc_errors", "uncorrectable ECC errors: 1", **g))
            elif "xid" in f:
                gpus.append(GpuHealth(i, "xid", "Xid 79 (GPU has fallen off the bus)", **g))
            elif "throttle" in f:
                gpus.append(GpuHealth(i, "throttled", "thermal slowdown (reasons 0x40)", **g))
            else:
                gpus.append(GpuHealth(i, **g))
        base: dict[str, Any] = {"perf": self.speed(), "temperature_c": temp, "ecc_errors": self.ecc,
                                "xid_errors": self.xid, "throttle_events": self.throttles, "gpus": tuple(gpus)}
        if "ecc" in self.faults:
            return Health("ecc_errors", f"uncorrectable ECC errors: {self.ecc}", **base)
        if "xid" in self.faults:
            return Health("xid", f"Xid errors: {self.xid}", **base)
        if "throttle" in self.faults:
            return Health("throttled", f"thermal throttling at {temp:.0f} C", **base)
        per_gpu = host_health(gpus, self.speed())
        return Health(per_gpu.health, per_gpu.detail, **base)


class NvmlDevices:
    """Real GPUs through NVML (see module docstring). ``nvml`` is the ``pynvml`` module (tests pass a fake)."""

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml  # nvidia-ml-py
            except ImportError as exc:
                raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'dagfold[gpu]')") from exc
            nvml = pynvml
        try:
            nvml.nvmlInit()
            self.count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML: {exc}") from exc
        if self.count == 0:
            raise NvmlUnavailable("NVML finds no GPU")
        self._nvml: Any = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
        name = nvml.nvmlDeviceGetName(self._handles[0])
        name = name.decode() if isinstance(name, bytes) else name
        self.gpu_type = _short_name(name)
        self.xids: dict[int, list[int]] = {}  # per GPU index: critical Xid codes seen
        self.sticky: dict[int, tuple[str, str]] = {}  # GPUs bad until the agent restarts (ECC, hardware Xid)
        self._events: Any = None
        with contextlib.suppress(nvml.NVMLError, AttributeError):
            self._events = nvml.nvmlEventSetCreate()
        if self._events is not None:
            for h in self._handles:
                with contextlib.suppress(nvml.NVMLError):  # not supported on every GPU/driver
                    nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events)
        self._bad_reasons = 0
        for name_ in ("HwThermalSlowdown", "SwThermalSlowdown", "HwSlowdown", "HwPowerBrakeSlowdown"):
            self._bad_reasons |= int(getattr(nvml, "nvmlClocksEventReason" + name_,
                                             getattr(nvml, "nvmlClocksThrottleReason" + name_, 0)))

    def speed(self) -> float:
        return 1.0

    def _drain_xids(self) -> None:
        """Read every pending critical Xid event (non-blocking)."""
        nv = self._nvml
        if self._events is None:
            return
        for _ in range(1000):  # bounded: a storm of events is read over several heartbeats
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                return  # NVML_ERROR_TIMEOUT: none pending (or the wait is not supported)
            try:
                idx = int(nv.nvmlDeviceGetIndex(data.device))
            except nv.NVMLError:
                continue
            xid = int(data.eventData)
            self.xids.setdefault(idx, []).append(xid)
            del self.xids[idx][:-100]
            if xid in HARDWARE_XIDS:
                self.sticky.setdefault(idx, ("xid", f"Xid {xid}"))

    def _reasons(self, h: Any) -> int:
        nv = self._nvml
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(h))

    def _gpu(self, i: int, h: Any) -> GpuHealth:
        nv = self._nvml
        g: dict[str, Any] = {}
        with contextlib.suppress(nv.NVMLError):
            g["utilization"] = round(float(nv.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0, 4)
        with contextlib.suppress(nv.NVMLError):
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            g["memory_used_mib"], g["memory_total_mib"] = int(mem.used) // 2**20, int(mem.total) // 2**20
        with contextlib.suppress(nv.NVMLError):
            g["temperature_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        reasons = 0
        with contextlib.suppress(nv.NVMLError):
            reasons = self._reasons(h)
        g["throttle_reasons"] = reasons
        ecc = 0
        with contextlib.suppress(nv.NVMLError):  # ECC not supported or not enabled
            ecc = int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        g["ecc_errors"] = ecc
        xids = self.xids.get(i, [])
        g["xid_errors"], g["last_xid"] = len(xids), (xids[-1] if xids else None)
        if ecc:
            self.sticky.setdefault(i, ("ecc_errors", f"{ecc} uncorrectable ECC errors"))
        if i in self.sticky:
            state, detail = self.sticky[i]
            return GpuHealth(i, state, detail, **g)
        if reasons & self._bad_reasons:
            return GpuHealth(i, "throttled", f"clocks slowed (reasons 0x{reasons:x})", **g)
        return GpuHealth(i, **g)

    def health(self, busy: frozenset[int] = frozenset()) -> Health:
        self._drain_xids()
        return host_health([self._gpu(i, h) for i, h in enumerate(self._handles)], None)


def _short_name(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'Tesla V100-SXM2-16GB' -> 'V100'."""
    for token in name.replace("-", " ").split():
        if token[:1] in "AHVTLPB" and any(c.isdigit() for c in token) and token.upper() != "NVIDIA":
            return token.upper()
    return name


def detect(simulated: SimulatedDevices | None = None) -> Devices:
    """NVML when it finds GPUs, else the simulated model (or the one given)."""
    if simulated is not None:
        return simulated
    try:
        return NvmlDevices()
    except NvmlUnavailable:
        return SimulatedDevices()
