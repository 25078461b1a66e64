"""A fake ``pynvml`` (nvidia-ml-py) for tests: the same names, signatures and error type as the real
module, over a GPU model the test sets (utilisation, memory, temperature, clocks, throttle reasons,
ECC counts, pending Xid events). Only what ``dagfold.services.agent.devices.NvmlDevices`` calls is here."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 0x8
nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    util: int = 0  # percent
    mem_used: int = 0  # bytes
    mem_total: int = 141 * 2**30
    temp: int = 40
    sm_clock: int = 1980
    sm_max: int = 1980
    reasons: int = 0
    ecc: int = 0
    ecc_supported: bool = True


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu() for _ in range(2)])
    events: list[tuple[int, int]] = field(default_factory=list)  # pending (gpu index, xid)
    registered: set[int] = field(default_factory=set)

    def xid(self, index: int, code: int) -> None:
        self.events.append((index, code))

    def module(self) -> Any:
        """The fake as a module-like namespace (what ``import pynvml`` gives)."""
        fake = self
        ns: dict[str, Any] = {k: v for k, v in globals().items() if k.isupper() or k.startswith("nvml")}
        ns["NVMLError"] = NVMLError

        def handle(i: int) -> Any:
            if not 0 <= i < len(fake.gpus):
                raise NVMLError(2)
            return SimpleNamespace(index=i)

        def g(h: Any) -> FakeGpu:
            return fake.gpus[h.index]

        def ecc(h: Any, kind: int, counter: int) -> int:
            if not g(h).ecc_supported:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return g(h).ecc

        def wait(es: Any, timeout_ms: int) -> Any:
            pending = [e for e in fake.events if e[0] in fake.registered]
            if not pending:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            fake.events.remove(pending[0])
            return SimpleNamespace(device=SimpleNamespace(index=pending[0][0]), eventType=0x8,
                                   eventData=pending[0][1], gpuInstanceId=0, computeInstanceId=0)

        ns.update(
            nvmlInit=lambda: None,
            nvmlShutdown=lambda: None,
            nvmlDeviceGetCount=lambda: len(fake.gpus),
            nvmlDeviceGetHandleByIndex=handle,
            nvmlDeviceGetIndex=lambda h: h.index,
            nvmlDeviceGetName=lambda h: g(h).name,
            nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=g(h).util, memory=0),
            nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=g(h).mem_total, used=g(h).mem_used,
                                                              free=g(h).mem_total - g(h).mem_used),
            nvmlDeviceGetTemperature=lambda h, sensor: g(h).temp,
            nvmlDeviceGetClockInfo=lambda h, kind: g(h).sm_clock,
            nvmlDeviceGetMaxClockInfo=lambda h, kind: g(h).sm_max,
            nvmlDeviceGetCurrentClocksEventReasons=lambda h: g(h).reasons,
            nvmlDeviceGetTotalEccErrors=ecc,
            nvmlEventSetCreate=lambda: SimpleNamespace(),
            nvmlDeviceRegisterEvents=lambda h, types, es: fake.registered.add(h.index),
            nvmlEventSetWait_v2=wait,
        )
        return SimpleNamespace(**ns)
