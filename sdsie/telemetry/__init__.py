"""Telemetry: run records with environment capture, and the NVML energy meter."""

from sdsie.telemetry.energy import (
    EnergyMeter,
    EnergyMeterError,
    EnergyUnavailable,
    EnergyWindow,
    IdleBaseline,
    WindowTooShortError,
)
from sdsie.telemetry.records import (
    RecordError,
    RunRecord,
    capture_environment,
    load_record,
    load_records,
    write_record,
)

__all__ = [
    "EnergyMeter",
    "EnergyMeterError",
    "EnergyUnavailable",
    "EnergyWindow",
    "IdleBaseline",
    "RecordError",
    "RunRecord",
    "WindowTooShortError",
    "capture_environment",
    "load_record",
    "load_records",
    "write_record",
]
