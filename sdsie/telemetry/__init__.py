"""Telemetry: run records with environment capture, and the NVML energy meter."""

from sdsie.telemetry.records import (
    RecordError,
    RunRecord,
    capture_environment,
    load_record,
    load_records,
    write_record,
)

__all__ = ["RecordError", "RunRecord", "capture_environment", "load_record", "load_records", "write_record"]
