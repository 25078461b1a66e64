"""GPU inventory and health as the allocator needs them.

``NvmlDevices`` reads real GPUs through NVML (``nvidia-ml-py``, an optional
dependency imported only here). ``SimulatedDevices`` is a device model with
injectable faults for tests and demos: ``crash`` (the agent goes silent),
``throttle`` (thermal throttling, jobs at half speed), ``ecc``/``xid`` (error
counters), ``slow`` (throughput far below nominal with no flag raised: the
allocator notices it against the fleet). Both produce a ``Health`` snapshot;
the allocator drains the node on anything but ``ok``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.agent.exceptions import NvmlUnavailable

FAULTS = ("crash", "throttle", "ecc", "xid", "slow")


@dataclass(frozen=True)
class Health:
    health: str  # ok | throttled | ecc_errors | xid | slow
    detail: str | None = None
    perf: float | None = None
    temperature_c: float | None = None
    ecc_errors: int = 0
    xid_errors: int = 0
    throttle_events: int = 0


class Devices(Protocol):
    gpu_type: str
    count: int

    def health(self) -> Health: ...

    def speed(self) -> float:
        """Relative speed jobs run at (1.0 nominal); the simulated model slows jobs down with it."""


@dataclass
class SimulatedDevices:
    """A host of ``count`` GPUs of ``gpu_type`` whose faults tests switch on and off."""

    count: int = 8
    gpu_type: str = "H100"
    faults: set[str] = field(default_factory=set)
    ecc: int = 0
    xid: int = 0
    throttles: int = 0

    def inject(self, fault: str) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        self.faults.add(fault)
        if fault == "ecc":
            self.ecc += 1
        elif fault == "xid":
            self.xid += 1
        elif fault == "throttle":
            self.throttles += 1

    def clear(self, fault: str) -> None:
        self.faults.discard(fault)

    @property
    def crashed(self) -> bool:
        return "crash" in self.faults

    def speed(self) -> float:
        if "slow" in self.faults:
            return 0.3
        return 0.5 if "throttle" in self.faults else 1.0

    def health(self) -> Health:
        temp = 92.0 if "throttle" in self.faults else 55.0
        base: dict[str, Any] = {"perf": self.speed(), "temperature_c": temp, "ecc_errors": self.ecc,
                                "xid_errors": self.xid, "throttle_events": self.throttles}
        if "ecc" in self.faults:
            return Health("ecc_errors", f"uncorrectable ECC errors: {self.ecc}", **base)
        if "xid" in self.faults:
            return Health("xid", f"Xid errors: {self.xid}", **base)
        if "throttle" in self.faults:
            return Health("throttled", f"thermal throttling at {temp:.0f} C", **base)
        return Health("ok", None, **base)


class NvmlDevices:
    """Real GPUs through NVML: type, count, temperature, throttling reasons, ECC and Xid-like errors."""

    def __init__(self) -> None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as exc:
            raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
        try:
            pynvml.nvmlInit()
            self.count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML: {exc}") from exc
        if self.count == 0:
            raise NvmlUnavailable("NVML finds no GPU")
        self._nvml: Any = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
        name = pynvml.nvmlDeviceGetName(self._handles[0])
        name = name.decode() if isinstance(name, bytes) else name
        self.gpu_type = _short_name(name)

    def speed(self) -> float:
        return 1.0

    def health(self) -> Health:
        nv = self._nvml
        temps, ecc, throttled, details = [], 0, 0, []
        bad = nv.nvmlClocksThrottleReasonHwThermalSlowdown | nv.nvmlClocksThrottleReasonSwThermalSlowdown \
            | nv.nvmlClocksThrottleReasonHwSlowdown
        for i, h in enumerate(self._handles):
            with contextlib.suppress(nv.NVMLError):
                temps.append(float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            try:
                reasons = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
                if reasons & bad:
                    throttled += 1
                    details.append(f"GPU {i} throttled (reasons 0x{reasons:x})")
            except nv.NVMLError:
                pass
            try:
                e = nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
                if e:
                    ecc += int(e)
                    details.append(f"GPU {i}: {e} uncorrectable ECC errors")
            except nv.NVMLError:
                pass  # ECC not supported or not enabled
        temp = max(temps) if temps else None
        base: dict[str, Any] = {"perf": None, "temperature_c": temp, "ecc_errors": ecc, "xid_errors": 0,
                                "throttle_events": throttled}
        if ecc:
            return Health("ecc_errors", "; ".join(details), **base)
        if throttled:
            return Health("throttled", "; ".join(details), **base)
        return Health("ok", None, **base)


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
