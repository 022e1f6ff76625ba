"""Run records: the one format every benchmark writes, and every claim and report reads.

A record is one JSON file under `telemetry/`, plain or gzipped (`.json.gz`: `gzip_record` stores the large kernel
sweeps that way, which keeps the tree that travels to a GPU machine small; loading reads both):

    schema_version  int                     SCHEMA_VERSION of the writer
    record_id       str                     unique id (also part of the file name)
    claim_ids       [str]                   registry ids this run measures (reproductions/claims.toml)
    suite           str                     the benchmark that produced it ("kernel_bandwidth", ...)
    config          {str: json}             every knob of the run (shapes, thresholds, K, dtype, ...)
    samples         {str: [float]}          raw samples, never only summaries (per-trial timings, traces)
    metrics         {str: float|bool}       derived numbers; claims read these by key
    environment     {str: json}             `capture_environment()`: git, versions, GPU, seeds, hashes
    conditions      {model, hardware, trials}  what a claim's reference must match to be compared
    created         str                     ISO-8601 UTC time the record was made
    complete        bool                    False for a run that stopped early (the claims gate fails it)
    digest          str                     sha256 of the canonical JSON of all fields above

Writes are atomic (temp file in the same directory, then a hard link / replace) and never
overwrite. Loading verifies JSON, schema and digest, and raises `RecordError` naming the file:
a corrupt, partial or hand-edited record is reported, never skipped.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sdsie.telemetry.env import capture_environment, checkpoint_hash, module_hash, text_hash, utc_now

__all__ = [
    "SCHEMA_VERSION",
    "CONDITION_KEYS",
    "RecordError",
    "RunRecord",
    "capture_environment",
    "checkpoint_hash",
    "module_hash",
    "text_hash",
    "write_record",
    "write_raw",
    "gzip_record",
    "load_record",
    "load_records",
    "records_for_claim",
    "PARTIAL_SUFFIX",
]

SCHEMA_VERSION = 1
CONDITION_KEYS = ("model", "hardware", "trials")
PARTIAL_SUFFIX = ".partial"  # a temp file left behind by an interrupted write
RECORD_SUFFIXES = (".json", ".json.gz")  # a record's file, plain or gzipped
_SUITE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RecordError(ValueError):
    """A record that cannot be trusted: unreadable, truncated, schema-invalid or tampered with."""

    def __init__(self, path: Path | str | None, problem: str) -> None:
        self.path = None if path is None else Path(path)
        self.problem = problem
        where = f"record {self.path}" if self.path is not None else "record"
        super().__init__(f"{where}: {problem}")


def _new_id() -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{stamp}-{secrets.token_hex(4)}"


def short_id(record_id: str) -> str:
    """The hex after a record id's timestamp (`_new_id`): how docs and tables cite a record."""
    return record_id.split("-", 1)[-1]


@dataclass
class RunRecord:
    """One benchmark run. Construct, then `write_record(record)`; validated on construction."""

    claim_ids: list[str]
    suite: str
    config: dict[str, Any]
    samples: dict[str, list[float]]
    metrics: dict[str, float | bool]
    environment: dict[str, Any]
    conditions: dict[str, Any]
    complete: bool = True
    record_id: str = field(default_factory=_new_id)
    created: str = field(default_factory=utc_now)
    schema_version: int = SCHEMA_VERSION
    source: Path | None = field(default=None, compare=False, repr=False)  # set by load_record

    def __post_init__(self) -> None:
        self.validate()

    # -- schema ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first schema violation."""
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(_schema_message(self.schema_version))
        _check_str("record_id", self.record_id)
        if not _SUITE_RE.match(self.suite if isinstance(self.suite, str) else ""):
            raise ValueError(f"suite must match {_SUITE_RE.pattern}, got {self.suite!r}")
        if not isinstance(self.claim_ids, list) or not all(isinstance(c, str) and c for c in self.claim_ids):
            raise ValueError(f"claim_ids must be a list of non-empty strings, got {self.claim_ids!r}")
        for name in ("config", "environment"):
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
            _check_json(name, value)
        _check_samples(self.samples)
        _check_metrics(self.metrics)
        _check_conditions(self.conditions)
        if not isinstance(self.complete, bool):
            raise ValueError(f"complete must be a bool, got {self.complete!r}")
        _check_created(self.created)

    # -- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the persisted fields, with the integrity digest."""
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}
        body = json.loads(json.dumps(body))  # deep copy, tuples -> lists
        body["digest"] = _digest(body)
        return body

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """Build from a loaded dict; raises ValueError on missing/extra keys or a digest mismatch."""
        if not isinstance(data, Mapping):
            raise ValueError(f"top level must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        digest = data.pop("digest", None)
        persisted = {f.name for f in fields(cls) if f.name != "source"}
        missing = sorted(persisted - set(data))
        extra = sorted(set(data) - persisted)
        if missing:
            raise ValueError(f"missing fields {missing} (partial or foreign record)")
        if extra:
            raise ValueError(f"unknown fields {extra}")
        if data["schema_version"] != SCHEMA_VERSION:
            raise ValueError(_schema_message(data["schema_version"]))
        if digest is None:
            raise ValueError("missing digest")
        expected = _digest(data)
        if digest != expected:
            raise ValueError(f"digest mismatch (stored {str(digest)[:12]}..., content {expected[:12]}...): "
                             "the file was edited or corrupted after it was written")
        return cls(**data)

    def metric(self, key: str) -> float | bool:
        if key not in self.metrics:
            raise KeyError(f"record {self.record_id} ({self.suite}) has no metric {key!r}")
        return self.metrics[key]


def _schema_message(version: Any) -> str:
    return f"schema_version {version!r} is not supported (this reader knows {SCHEMA_VERSION})"


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_json(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} is not plain finite JSON: {err}") from None


def _check_samples(samples: Any) -> None:
    if not isinstance(samples, dict):
        raise ValueError(f"samples must be a dict[str, list[float]], got {type(samples).__name__}")
    for key, values in samples.items():
        _check_str("samples key", key)
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"samples[{key!r}] must be a non-empty list of numbers")
        bad = [v for v in values if not _is_number(v) or not math.isfinite(v)]
        if bad:
            raise ValueError(f"samples[{key!r}] holds non-finite or non-numeric values, e.g. {bad[0]!r}")


def _check_metrics(metrics: Any) -> None:
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict[str, float | bool], got {type(metrics).__name__}")
    for key, value in metrics.items():
        _check_str("metrics key", key)
        if isinstance(value, bool):
            continue
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"metrics[{key!r}] must be a finite number or bool, got {value!r}")


def _check_conditions(conditions: Any) -> None:
    if not isinstance(conditions, dict):
        raise ValueError(f"conditions must be a dict with {CONDITION_KEYS}, got {type(conditions).__name__}")
    missing = [k for k in CONDITION_KEYS if k not in conditions]
    if missing:
        raise ValueError(f"conditions lack {missing} (need model, hardware, trials)")
    _check_str("conditions.model", conditions["model"])
    _check_str("conditions.hardware", conditions["hardware"])
    trials = conditions["trials"]
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"conditions.trials must be an int >= 1, got {trials!r}")
    _check_json("conditions", conditions)


def _check_created(created: Any) -> None:
    try:
        stamp = _dt.datetime.fromisoformat(created)
    except (TypeError, ValueError):
        raise ValueError(f"created must be an ISO-8601 timestamp, got {created!r}") from None
    if stamp.tzinfo is None:
        raise ValueError(f"created must carry a time zone (UTC), got {created!r}")


# -- writing and loading ----------------------------------------------------------------------------


def _record_filename(record: RunRecord) -> str:
    return f"{record.record_id}_{record.suite}.json"


def write_record(record: RunRecord, directory: str | os.PathLike[str] = "telemetry") -> Path:
    """Write `record` atomically as a new JSON file in `directory`; never overwrites.

    The file appears complete or not at all: the JSON goes to a temp file in the same directory,
    is fsynced, then hard-linked to its final name (which fails if the name exists). Returns the path.
    """
    record.validate()
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / _record_filename(record)
    if final.exists():
        raise FileExistsError(f"{final} exists: record ids are unique, refusing to overwrite")
    payload = json.dumps(record.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n"
    tmp = out_dir / f".{final.name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}"
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


def write_raw(path: str | os.PathLike[str], payload: Any) -> Path:
    """Write a raw companion file (a sweep, an A/B run, a probe: not a RunRecord) as indented JSON at `path`,
    creating its folder. Raw files sit under telemetry/raw beside the records that cite them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def _publish(tmp: Path, final: Path) -> None:
    """Give `tmp` the name `final` atomically without overwriting an existing file."""
    try:
        os.link(tmp, final)  # atomic, and raises FileExistsError instead of overwriting
    except FileExistsError:
        raise FileExistsError(f"{final} appeared while writing: refusing to overwrite") from None
    except OSError:  # file system without hard links: best effort exclusive replace
        if final.exists():
            raise FileExistsError(f"{final} exists: refusing to overwrite") from None
        os.replace(tmp, final)


def load_record(path: str | os.PathLike[str]) -> RunRecord:
    """Load and verify one record; raises RecordError naming the file on any problem."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise RecordError(path, "partial record left by an interrupted write; delete it and rerun")
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.name.endswith(".json.gz") else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as err:  # gzip: BadGzipFile, EOFError, zlib.error
        raise RecordError(path, f"unreadable: {err}") from None
    if not text.strip():
        raise RecordError(path, "empty file (partial write?)")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as err:
        raise RecordError(path, f"corrupt or truncated JSON: {err}") from None
    try:
        record = RunRecord.from_dict(data)
    except (TypeError, ValueError) as err:
        raise RecordError(path, f"invalid: {err}") from None
    record.source = path
    return record


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite constant {name} is not allowed in a record")


def load_records(directory: str | os.PathLike[str] = "telemetry") -> list[RunRecord]:
    """All records directly in `directory`, oldest first.

    Every `*.json` and `*.json.gz` file there must be a valid record, no two may hold the same record id, and no
    interrupted-write temp file may be left: the first bad file raises RecordError naming it. Subdirectories hold
    other artifacts (raw dumps, logs) and are not read. A missing directory means no records.
    """
    root = Path(directory)
    if not root.exists():
        return []
    if not root.is_dir():
        raise RecordError(root, "not a directory")
    paths = sorted(p for p in root.iterdir() if p.is_file() and _is_record_file(p))
    records = [load_record(p) for p in paths]
    seen: dict[str, Path] = {}
    for r in records:
        if r.record_id in seen:
            raise RecordError(r.source, f"record id {r.record_id} is also in {seen[r.record_id].name}")
        seen[r.record_id] = r.source
    return sorted(records, key=lambda r: (r.created, r.record_id))


def _is_record_file(path: Path) -> bool:
    return path.name.endswith(RECORD_SUFFIXES) or path.name.endswith(PARTIAL_SUFFIX)


def gzip_record(path: str | os.PathLike[str]) -> Path:
    """Store the record at `path` (`*.json`) gzipped beside it as `*.json.gz`, after checking it loads, and remove
    the plain file; the gzip header carries no time, so the bytes depend on the record alone. Returns the new path."""
    path = Path(path)
    if not path.name.endswith(".json"):
        raise ValueError(f"gzip_record takes a record's .json file, got {path}")
    record = load_record(path)
    out = path.with_name(path.name + ".gz")
    if out.exists():
        raise FileExistsError(f"{out} exists: refusing to overwrite")
    out.write_bytes(gzip.compress(path.read_bytes(), compresslevel=9, mtime=0))
    if load_record(out) != record:
        raise RecordError(out, "does not read back as the record it was made from")
    path.unlink()
    return out


def records_for_claim(records: Iterable[RunRecord], claim_id: str) -> list[RunRecord]:
    """Records that declare `claim_id`, oldest first."""
    return sorted((r for r in records if claim_id in r.claim_ids), key=lambda r: (r.created, r.record_id))


def newest_record(records: Iterable[RunRecord], suite: str | None = None,
                  accept: Callable[[RunRecord], bool] | None = None) -> RunRecord | None:
    """The newest of `records` (by creation time, then record id) of `suite` (any suite when None) that `accept`
    accepts (every one when None); None when there is none."""
    chosen = [r for r in records if (suite is None or r.suite == suite) and (accept is None or accept(r))]
    return max(chosen, key=lambda r: (r.created, r.record_id)) if chosen else None
