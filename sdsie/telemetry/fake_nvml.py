"""A scriptable stand-in for `pynvml`, for CPU tests of the energy meter and environment capture.

It exposes the names the meter uses, with pynvml's units (mJ, mW, MHz, deg C) and error
convention (`NVMLError.value` holds the NVML return code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["FakeNvml", "FakeNvmlError", "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_UNKNOWN"]

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_UNKNOWN = 999


class FakeNvmlError(Exception):
    def __init__(self, value: int, message: str = "") -> None:
        self.value = value
        super().__init__(message or f"NVML error {value}")


def _source(values: Callable[[], float] | Iterable[float] | float | None) -> Callable[[], float] | None:
    if values is None or callable(values):
        return values
    if isinstance(values, (int, float)):
        return lambda: values
    return iter(values).__next__


class FakeNvml:
    """Fake NVML backend.

    energy_mj: counter readings, in order (a callable, an iterable or a constant); None = unsupported.
    power_mw:  power readings likewise; None = unsupported.
    fail:      method name -> exception raised by that call (e.g. an NVML error mid-window).
    `events` logs every counter / power read, so tests can check ordering against device syncs.
    """

    NVMLError = FakeNvmlError
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0

    def __init__(
        self,
        energy_mj: Callable[[], float] | Iterable[float] | float | None = None,
        power_mw: Callable[[], float] | Iterable[float] | float | None = None,
        *,
        fail: dict[str, BaseException] | None = None,
        power_limit_mw: int = 700_000,
        sm_clock_mhz: int = 1980,
        mem_clock_mhz: int = 3201,
        temperature_c: int = 41,
        devices: int = 1,
        name: str = "Fake H200",
        events: list[str] | None = None,
    ) -> None:
        self._energy = _source(energy_mj)
        self._power = _source(power_mw)
        self.fail = dict(fail or {})
        self.power_limit_mw, self.temperature_c = power_limit_mw, temperature_c
        self.clocks = {self.NVML_CLOCK_SM: sm_clock_mhz, self.NVML_CLOCK_MEM: mem_clock_mhz}
        self.devices, self.name = devices, name
        self.events = events if events is not None else []

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            raise self.fail[method]

    def nvmlInit(self) -> None:
        self._maybe_fail("nvmlInit")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._maybe_fail("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < self.devices:
            raise FakeNvmlError(2, f"Invalid Argument: no device {index}")
        return ("fake-handle", index)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self.name

    def nvmlSystemGetDriverVersion(self) -> str:
        return "999.99"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        self._maybe_fail("nvmlDeviceGetTotalEnergyConsumption")
        if self._energy is None:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
        self.events.append("energy")
        return int(self._energy())

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        self._maybe_fail("nvmlDeviceGetPowerUsage")
        if self._power is None:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
        self.events.append("power")
        return int(self._power())

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._maybe_fail("nvmlDeviceGetEnforcedPowerLimit")
        return self.power_limit_mw

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        self._maybe_fail("nvmlDeviceGetClockInfo")
        return self.clocks[clock_type]

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._maybe_fail("nvmlDeviceGetTemperature")
        return self.temperature_c
