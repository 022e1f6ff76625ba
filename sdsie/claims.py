"""The claims registry (reproductions/claims.toml) and its evaluation against run records.

Registry entries (`[[claim]]`): id, statement, published value (a number, a [low, high] range
or a bool), unit, status (validated | corrected | limitation | open), the conditions it was
published under (model, hardware, trials), a tolerance, the reproduction test that measures it,
and the record metric to read. `kind` says how a measurement is judged:

    value    the metric must lie in [low - tol, high + tol] (a number v is the band [v, v])
    span     a spread across tasks: metric (the low end) and metric_high (the high end) must
             each lie within tol of published low / high
    timing   a value, and, when a reference record exists, a rank test for drift (below)
    exact    a bool (a bool metric, or 1 / 0) or an exact number that must equal the published value

Which band applies:

    portable = true          the published band, under any conditions (arithmetic, losslessness)
    record conditions == published conditions (model and hardware)   the published band
    a `[[reference]]` for the record's (model, hardware)            that reference's band
    otherwise                verdict `no_reference`: measured, shown, not judged (add a reference)

Timing drift, as asv does: with a reference record holding raw samples, drift is a Mann-Whitney U
test (p < alpha) over the claim's `samples` key AND a median ratio beyond `factor` in the
worse direction (`better = "lower" | "higher"`). Fewer than `min_samples` samples on either side
is an invalid measurement, not a pass.

A claim's `metric` is a record metric key, arithmetic over metric keys ("100 * (1 / speedup - 1)"),
or `median:<samples key>`, the median of one raw-sample list (a timing read straight from its samples).

Errata (`[[erratum]]`): records are immutable, so when a committed record declared the wrong claim ids
(a hand-kept list in the producing code), the registry corrects that record's declaration, by record
id: `measures` adds claims it measures but did not declare, `unmeasured` ({claim: why}) removes claims
it declared but holds no value for. Judged results say when an erratum applied.

For each claim, the newest record per (model, hardware) is judged. Verdicts: reproduced,
improved (significantly better than its reference: passes, update the reference), drifted and
invalid (fail), unmeasured and no_reference (listed; fail only with `strict`), not_measurable
(the registry says why the claim cannot be re-measured).
"""

from __future__ import annotations

import ast
import math
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdsie.telemetry.records import RunRecord

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "Band",
    "Claim",
    "ClaimResult",
    "DriftPolicy",
    "DriftTest",
    "Erratum",
    "Evaluation",
    "Reference",
    "Registry",
    "RegistryError",
    "STATUSES",
    "VERDICTS",
    "drift_test",
    "evaluate",
    "format_value",
    "judge_record",
    "load_registry",
    "missing_inputs",
    "missing_tests",
]

STATUSES = ("validated", "corrected", "limitation", "open")
KINDS = ("value", "span", "timing", "exact")
VERDICTS = ("reproduced", "improved", "drifted", "invalid", "no_reference", "unmeasured", "not_measurable")
FAILING = frozenset({"drifted", "invalid"})
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_TEST_RE = re.compile(r"^reproductions/[\w/]+\.py::\w+(\[[^\]]+\])?$")
# `metric` / `metric_high`: a record metric key, or arithmetic over identifier keys written with spaces,
# e.g. "100 * (1 / m1_g128_geomean_speedup - 1)" (see is_expression).
_CLAIM_KEYS = {
    "id", "statement", "published", "unit", "status", "conditions", "kind", "metric", "metric_high",
    "samples", "better", "tolerance", "rel_tolerance", "test", "portable", "original", "source", "note",
    "not_measurable",
}
_REFERENCE_KEYS = {"claim", "model", "hardware", "value", "tolerance", "rel_tolerance", "record", "note"}
_ERRATUM_KEYS = {"record", "measures", "unmeasured", "note"}
_SAMPLE_MEDIAN = "median:"  # metric = "median:<samples key>"


class RegistryError(ValueError):
    """The registry file is malformed; the message names the file and the entry."""


# -- data -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Band:
    """Inclusive [low, high] after tolerance; `exact` holds a bool/number for exact claims."""

    low: float
    high: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def __str__(self) -> str:
        return f"{_fmt(self.low)}" if self.low == self.high else f"[{_fmt(self.low)}, {_fmt(self.high)}]"


Published = float | tuple[float, float] | bool


@dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    published: Published
    unit: str
    status: str
    conditions: dict[str, Any]
    kind: str = "value"
    metric: str | None = None
    metric_high: str | None = None
    samples: str | None = None
    better: str | None = None
    tolerance: float = 0.0
    rel_tolerance: float = 0.0
    test: str | None = None
    portable: bool = False
    original: Published | None = None
    source: str = ""
    note: str = ""
    not_measurable: str | None = None

    @property
    def measurable(self) -> bool:
        return self.metric is not None

    def band(self, value: Published | None = None, tolerance: float | None = None,
             rel_tolerance: float | None = None) -> Band:
        """The acceptance band around `value` (default: the published value)."""
        return _band(self.published if value is None else value,
                     self.tolerance if tolerance is None else tolerance,
                     self.rel_tolerance if rel_tolerance is None else rel_tolerance)


@dataclass(frozen=True)
class Reference:
    """A claim's expected value under other conditions, with its raw-sample record for drift tests."""

    claim: str
    model: str
    hardware: str
    value: Published | None = None
    tolerance: float | None = None
    rel_tolerance: float | None = None
    record: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Erratum:
    """A correction to one committed record's declared claim ids (records themselves are immutable)."""

    record: str  # record id
    measures: tuple[str, ...] = ()  # claims the record measures but did not declare
    unmeasured: dict[str, str] = field(default_factory=dict)  # declared claim id -> why the record lacks it
    note: str = ""


@dataclass(frozen=True)
class DriftPolicy:
    alpha: float = 0.002  # asv's p threshold for Mann-Whitney U
    factor: float = 1.10  # minimum median ratio that counts as a change (asv's default factor)
    min_samples: int = 9  # Google benchmark compare.py's minimum for a U test


@dataclass
class Registry:
    claims: dict[str, Claim]
    references: list[Reference]
    drift: DriftPolicy
    path: Path | None = None
    errata: dict[str, Erratum] = field(default_factory=dict)  # by record id

    def claim_ids_of(self, record: RunRecord) -> list[str]:
        """The claims a record measures: its declared ids, corrected by its erratum if it has one."""
        erratum = self.errata.get(record.record_id)
        if erratum is None:
            return list(record.claim_ids)
        kept = [c for c in record.claim_ids if c not in erratum.unmeasured]
        return kept + [c for c in erratum.measures if c not in kept]

    def reference_for(self, claim_id: str, model: str, hardware: str) -> Reference | None:
        for ref in self.references:
            if (ref.claim, ref.model, ref.hardware) == (claim_id, model, hardware):
                return ref
        return None


@dataclass(frozen=True)
class DriftTest:
    p_value: float
    ratio: float  # median(measured) / median(reference)
    n_reference: int
    n_measured: int
    direction: str  # "worse" | "better" | "same"

    def __str__(self) -> str:
        return (f"Mann-Whitney U p={self.p_value:.2g}, median ratio {self.ratio:.3f} "
                f"(n={self.n_reference} ref, {self.n_measured} new): {self.direction}")


@dataclass
class ClaimResult:
    claim: Claim
    verdict: str
    detail: str
    record: RunRecord | None = None
    measured: Any = None
    expected: Band | bool | None = None
    basis: str | None = None  # "published" | "reference" | "portable"
    conditions: dict[str, Any] | None = None
    drift: DriftTest | None = None
    reference_record: RunRecord | None = None

    @property
    def failed(self) -> bool:
        return self.verdict in FAILING

    def summary(self) -> str:
        c = self.claim
        published = format_value(c.published)
        measured = "-" if self.measured is None else format_value(self.measured)
        where = "" if self.conditions is None else f" [{self.conditions['model']} / {self.conditions['hardware']}]"
        unit = f" {c.unit}" if c.unit else ""
        return f"{self.verdict.upper():<14} {c.id}: published {published}{unit}, measured {measured}{where}. " \
               f"{self.detail}"


@dataclass
class Evaluation:
    results: list[ClaimResult]
    errors: list[str] = field(default_factory=list)  # record-level problems (unknown claim ids, ...)

    def failed(self, strict: bool = False) -> bool:
        blocking = FAILING | ({"unmeasured", "no_reference"} if strict else set())
        return bool(self.errors) or any(r.verdict in blocking for r in self.results)

    def by_verdict(self) -> dict[str, list[ClaimResult]]:
        out: dict[str, list[ClaimResult]] = {v: [] for v in VERDICTS}
        for r in self.results:
            out[r.verdict].append(r)
        return out


# -- formatting -----------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.4g}"


def format_value(v: Any) -> str:
    if isinstance(v, tuple):
        return f"{_fmt(v[0])}-{_fmt(v[1])}"
    return _fmt(v) if isinstance(v, (int, float)) else str(v)


def _band(value: Published, tol: float, rel: float) -> Band:
    if isinstance(value, bool):
        raise ValueError("a bool claim has no band; it is judged exactly")
    low, high = (value, value) if isinstance(value, (int, float)) else value
    slack_low = tol + rel * abs(low) if math.isfinite(low) else 0.0
    slack_high = tol + rel * abs(high) if math.isfinite(high) else 0.0
    return Band(low - slack_low, high + slack_high)


# -- loading and validation --------------------------------------------------------------------------


def load_registry(path: str | Path = "reproductions/claims.toml") -> Registry:
    """Parse and validate the registry; RegistryError names the file and the offending entry."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise RegistryError(f"{path}: cannot read the claims registry: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise RegistryError(f"{path}: invalid TOML: {err}") from None
    try:
        return _parse_registry(data, path)
    except ValueError as err:
        raise RegistryError(f"{path}: {err}") from None


def _parse_registry(data: Mapping[str, Any], path: Path | None) -> Registry:
    if data.get("schema_version") != 1:
        raise ValueError(f"schema_version must be 1, got {data.get('schema_version')!r}")
    unknown = set(data) - {"schema_version", "drift", "claim", "reference", "erratum"}
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)}")
    claims: dict[str, Claim] = {}
    for i, entry in enumerate(data.get("claim", [])):
        claim = _parse_claim(entry, i)
        if claim.id in claims:
            raise ValueError(f"duplicate claim id {claim.id!r}")
        claims[claim.id] = claim
    references = [_parse_reference(entry, i, claims) for i, entry in enumerate(data.get("reference", []))]
    keys = [(r.claim, r.model, r.hardware) for r in references]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise ValueError(f"more than one reference for {sorted(dupes)}")
    errata: dict[str, Erratum] = {}
    for i, entry in enumerate(data.get("erratum", [])):
        erratum = _parse_erratum(entry, i, claims)
        if erratum.record in errata:
            raise ValueError(f"more than one erratum for record {erratum.record!r}")
        errata[erratum.record] = erratum
    return Registry(claims, references, _parse_drift(data.get("drift", {})), path, errata)


def _parse_drift(data: Mapping[str, Any]) -> DriftPolicy:
    unknown = set(data) - {"alpha", "factor", "min_samples"}
    if unknown:
        raise ValueError(f"[drift] has unknown keys {sorted(unknown)}")
    policy = DriftPolicy(**data)
    if not 0 < policy.alpha < 1 or policy.factor < 1 or policy.min_samples < 3:
        raise ValueError(f"[drift] needs 0 < alpha < 1, factor >= 1, min_samples >= 3, got {policy}")
    return policy


def _parse_published(value: Any, where: str) -> Published:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise ValueError(f"{where} is NaN")
        return float(value)
    if isinstance(value, list) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        low, high = float(value[0]), float(value[1])
        if not low <= high:
            raise ValueError(f"{where} range must have low <= high, got {value}")
        return (low, high)
    raise ValueError(f"{where} must be a number, a [low, high] pair or a bool, got {value!r}")


def _parse_claim(entry: Mapping[str, Any], index: int) -> Claim:
    cid = entry.get("id", f"#{index}")
    where = f"claim {cid!r}"
    unknown = set(entry) - _CLAIM_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    for key in ("id", "statement", "unit", "status"):
        if not isinstance(entry.get(key), str) or (key != "unit" and not entry[key]):
            raise ValueError(f"{where}: {key} must be a non-empty string")
    if not _ID_RE.match(entry["id"]):
        raise ValueError(f"{where}: id must match {_ID_RE.pattern}")
    if entry["status"] not in STATUSES:
        raise ValueError(f"{where}: status must be one of {STATUSES}, got {entry['status']!r}")
    fields = dict(entry)
    fields["published"] = _parse_published(entry.get("published"), f"{where}: published")
    if "original" in entry:
        fields["original"] = _parse_published(entry["original"], f"{where}: original")
    fields["conditions"] = _parse_conditions(entry.get("conditions"), where)
    claim = Claim(**fields)
    _check_claim(claim, where)
    return claim


def _parse_conditions(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: conditions must be a table with model, hardware, trials")
    for key in ("model", "hardware"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise ValueError(f"{where}: conditions.{key} must be a non-empty string")
    trials = value.get("trials")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"{where}: conditions.trials must be an int >= 1, got {trials!r}")
    return dict(value)


def _check_claim(c: Claim, where: str) -> None:
    if c.kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {KINDS}, got {c.kind!r}")
    if c.tolerance < 0 or c.rel_tolerance < 0:
        raise ValueError(f"{where}: tolerances must be >= 0")
    if c.metric is None:
        if not c.not_measurable:
            raise ValueError(f"{where}: give a metric to measure it, or not_measurable = 'why not'")
        return
    if c.not_measurable:
        raise ValueError(f"{where}: has both a metric and not_measurable")
    for metric in (c.metric, c.metric_high):
        if metric is not None and metric.startswith(_SAMPLE_MEDIAN) and not metric[len(_SAMPLE_MEDIAN):]:
            raise ValueError(f"{where}: {metric!r} names no samples key")
        if metric is not None and is_expression(metric) and not metric.startswith(_SAMPLE_MEDIAN):
            try:
                parse_expression(metric)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
    if c.test is None or not _TEST_RE.match(c.test):
        raise ValueError(f"{where}: test must be a node id 'reproductions/<file>.py::<test>', got {c.test!r}")
    if c.kind == "exact" and isinstance(c.published, tuple):
        raise ValueError(f"{where}: an exact claim needs a single published value")
    if c.kind != "exact" and isinstance(c.published, bool):
        raise ValueError(f"{where}: a bool published value needs kind = 'exact'")
    if c.kind == "span" and (c.metric_high is None or not isinstance(c.published, tuple)):
        raise ValueError(f"{where}: a span claim needs a [low, high] published value and metric_high")
    if c.kind != "span" and c.metric_high is not None:
        raise ValueError(f"{where}: metric_high is only for kind = 'span'")
    if c.kind == "timing":
        if c.samples is None or c.better not in ("lower", "higher"):
            raise ValueError(f"{where}: a timing claim needs samples (raw sample key) and better = lower|higher")
    elif c.samples is not None or c.better is not None:
        raise ValueError(f"{where}: samples / better are only for kind = 'timing'")


def _parse_reference(entry: Mapping[str, Any], index: int, claims: Mapping[str, Claim]) -> Reference:
    where = f"reference #{index} ({entry.get('claim')!r})"
    unknown = set(entry) - _REFERENCE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    claim = claims.get(entry.get("claim"))  # type: ignore[arg-type]
    if claim is None:
        raise ValueError(f"{where}: no claim with that id")
    for key in ("model", "hardware"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{where}: {key} must be a non-empty string")
    fields = dict(entry)
    if "value" in entry:
        fields["value"] = _parse_published(entry["value"], f"{where}: value")
    elif "record" not in entry:
        raise ValueError(f"{where}: needs a value, a record id, or both")
    if claim.portable:
        raise ValueError(f"{where}: claim {claim.id} is portable (judged on its published band everywhere)")
    return Reference(**fields)


def _parse_erratum(entry: Mapping[str, Any], index: int, claims: Mapping[str, Claim]) -> Erratum:
    where = f"erratum #{index} ({entry.get('record')!r})"
    unknown = set(entry) - _ERRATUM_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    if not isinstance(entry.get("record"), str) or not entry["record"]:
        raise ValueError(f"{where}: record must be a record id")
    if not isinstance(entry.get("note", ""), str) or not entry.get("note"):
        raise ValueError(f"{where}: note must say why the record's declaration is corrected")
    measures = entry.get("measures", [])
    unmeasured = entry.get("unmeasured", {})
    if not isinstance(measures, list) or not all(isinstance(c, str) for c in measures):
        raise ValueError(f"{where}: measures must be a list of claim ids")
    if not isinstance(unmeasured, Mapping) or not all(isinstance(v, str) and v for v in unmeasured.values()):
        raise ValueError(f"{where}: unmeasured must map claim ids to the reason the record lacks them")
    if not measures and not unmeasured:
        raise ValueError(f"{where}: corrects nothing (give measures and/or unmeasured)")
    for cid in [*measures, *unmeasured]:
        if cid not in claims:
            raise ValueError(f"{where}: no claim with id {cid!r}")
        if not claims[cid].measurable:
            raise ValueError(f"{where}: claim {cid} is not measurable")
    both = sorted(set(measures) & set(unmeasured))
    if both:
        raise ValueError(f"{where}: {both} both measured and unmeasured")
    return Erratum(entry["record"], tuple(measures), dict(unmeasured), entry["note"])


def missing_inputs(claim: Claim, metrics: Mapping[str, Any], samples: Mapping[str, Any]) -> list[str]:
    """The metric and sample keys a claim reads that `metrics` / `samples` lack (empty: it can be judged).

    For producers that declare claim ids from the registry: declare a claim only where this is empty.
    """
    missing = []
    for metric in (claim.metric, claim.metric_high):
        if metric is None:
            continue
        if metric.startswith(_SAMPLE_MEDIAN):
            key = metric[len(_SAMPLE_MEDIAN):]
            missing += [] if key in samples else [f"samples {key!r}"]
        elif is_expression(metric):
            names = {n.id for n in ast.walk(parse_expression(metric)) if isinstance(n, ast.Name)}
            missing += [f"metric {n!r}" for n in sorted(names) if n not in metrics]
        elif metric not in metrics:
            missing.append(f"metric {metric!r}")
    return missing


def missing_tests(registry: Registry, root: str | Path = ".") -> list[str]:
    """Claims whose reproduction test node does not exist (file or function missing)."""
    missing = []
    for claim in registry.claims.values():
        if claim.test is None:
            continue
        file, _, name = claim.test.partition("::")
        name = name.split("[", 1)[0]
        path = Path(root) / file
        if not path.is_file() or name not in _test_functions(path):
            missing.append(f"{claim.id}: {claim.test}")
    return missing


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


# -- evaluation ------------------------------------------------------------------------------------------


def drift_test(reference: Sequence[float], measured: Sequence[float], better: str, policy: DriftPolicy) -> DriftTest:
    """Rank test + minimum effect size (asv). Raises ValueError with too few samples."""
    from scipy.stats import mannwhitneyu

    if min(len(reference), len(measured)) < policy.min_samples:
        raise ValueError(f"a rank test needs >= {policy.min_samples} samples per side, "
                         f"got {len(reference)} reference and {len(measured)} new")
    p_value = float(mannwhitneyu(reference, measured, alternative="two-sided").pvalue)
    ref_median = statistics.median(reference)
    if ref_median == 0:
        raise ValueError("reference median is 0: a ratio effect size is undefined")
    ratio = statistics.median(measured) / ref_median
    direction = "same"
    if p_value < policy.alpha:
        slower, faster = ratio > policy.factor, ratio < 1 / policy.factor
        if (better == "lower" and slower) or (better == "higher" and faster):
            direction = "worse"
        elif (better == "lower" and faster) or (better == "higher" and slower):
            direction = "better"
    return DriftTest(p_value, ratio, len(reference), len(measured), direction)


def is_expression(metric: str) -> bool:
    """A metric written with spaces or parentheses is arithmetic over metric keys, else a plain key."""
    return any(c in metric for c in " ()")


_EXPR_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
               ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.UAdd)


def parse_expression(text: str) -> ast.Expression:
    """Parse a derived metric (+ - * /, numbers, identifier metric keys); ValueError on anything else."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"metric expression {text!r} does not parse: {err.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _EXPR_NODES) or (isinstance(node, ast.Constant) and not _is_num(node.value)):
            raise ValueError(f"metric expression {text!r} may use only numbers, metric names and + - * /")
    return tree


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _eval(node: ast.AST, metrics: Mapping[str, Any]) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body, metrics)
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        if node.id not in metrics:
            raise ValueError(f"record lacks metric {node.id!r}")
        if not _is_num(metrics[node.id]):
            raise ValueError(f"metric {node.id!r} is not a number")
        return float(metrics[node.id])
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, metrics)
        return -value if isinstance(node.op, ast.USub) else value
    assert isinstance(node, ast.BinOp)
    a, b = _eval(node.left, metrics), _eval(node.right, metrics)
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    if b == 0:
        raise ValueError("metric expression divides by zero")
    return a / b


def _metric(record: RunRecord, metric: str) -> Any:
    if metric.startswith(_SAMPLE_MEDIAN):
        key = metric[len(_SAMPLE_MEDIAN):]
        if not record.samples.get(key):
            raise ValueError(f"record lacks samples {key!r}")
        return statistics.median(record.samples[key])
    if is_expression(metric):
        return _eval(parse_expression(metric), record.metrics)
    if metric not in record.metrics:
        raise ValueError(f"record lacks metric {metric!r}")
    return record.metrics[metric]


def _as_bool(value: Any, claim: Claim) -> bool:
    """A bool claim reads a bool metric, or 1 / 0 (benchmarks that store every metric as a float)."""
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    raise ValueError(f"metric {claim.metric!r} = {value!r} is neither a bool nor 0 / 1")


def _measured(claim: Claim, record: RunRecord) -> Any:
    assert claim.metric is not None
    values = [_metric(record, claim.metric)]
    if claim.kind == "span":
        values.append(_metric(record, claim.metric_high or ""))
    if claim.kind == "exact":
        return _as_bool(values[0], claim) if isinstance(claim.published, bool) else values[0]
    if any(isinstance(v, bool) for v in values):
        raise ValueError(f"metric {claim.metric!r} is a bool but the claim is numeric")
    return (values[0], values[1]) if claim.kind == "span" else values[0]


def _judge_band(claim: Claim, measured: Any, expected: Published, ref: Reference | None) -> tuple[bool, Any, str]:
    tol = claim.tolerance if ref is None or ref.tolerance is None else ref.tolerance
    rel = claim.rel_tolerance if ref is None or ref.rel_tolerance is None else ref.rel_tolerance
    if claim.kind == "exact":
        ok = measured == expected and isinstance(measured, bool) == isinstance(expected, bool)  # 1.0 != true
        return ok, expected, "equal to the expected value" if ok else f"NOT equal to {format_value(expected)}"
    if claim.kind == "span":
        if not isinstance(expected, tuple):
            raise ValueError("a span needs a [low, high] expected value")
        lo, hi = _band(expected[0], tol, rel), _band(expected[1], tol, rel)
        ok = lo.contains(measured[0]) and hi.contains(measured[1])
        word = "within" if ok else "OUTSIDE"
        return ok, Band(lo.low, hi.high), f"{word} the span bands: low end {lo}, high end {hi}"
    band = _band(expected, tol, rel)
    ok = band.contains(measured)
    return ok, band, f"{'within' if ok else 'OUTSIDE'} band {band}"


def judge_record(claim: Claim, record: RunRecord, registry: Registry | None = None,
                 records_by_id: Mapping[str, RunRecord] | None = None) -> ClaimResult:
    """Judge one record against one claim (see the module docstring for the rules)."""
    cond = {k: record.conditions[k] for k in ("model", "hardware", "trials")}
    base = {"record": record, "conditions": cond}
    if not record.complete:
        return ClaimResult(claim, "invalid", "partial record (complete = false): the run stopped early", **base)
    try:
        measured = _measured(claim, record)
    except ValueError as err:
        return ClaimResult(claim, "invalid", str(err), **base)
    same = (cond["model"], cond["hardware"]) == (claim.conditions["model"], claim.conditions["hardware"])
    ref = None
    if claim.portable or same:
        basis, expected_value = ("portable" if claim.portable else "published"), claim.published
    else:
        ref = registry.reference_for(claim.id, cond["model"], cond["hardware"]) if registry else None
        if ref is None:
            return ClaimResult(claim, "no_reference", "measured under other conditions with no recorded "
                               "reference for them: add a [[reference]] (sdsie claims pin)", measured=measured,
                               **base)
        basis = "reference"
        expected_value = ref.value
    return _verdict(claim, record, measured, basis, expected_value, ref, registry, records_by_id or {}, base)


def _verdict(claim: Claim, record: RunRecord, measured: Any, basis: str, expected_value: Published | None,
             ref: Reference | None, registry: Registry | None, records_by_id: Mapping[str, RunRecord],
             base: dict[str, Any]) -> ClaimResult:
    notes, expected, in_band = [], None, True
    trials_ref = claim.conditions["trials"] if basis != "reference" else None
    if trials_ref is not None and record.conditions["trials"] < trials_ref:
        notes.append(f"fewer trials than published ({record.conditions['trials']} < {trials_ref})")
    ref_record = None
    if ref is not None and ref.record is not None:
        ref_record = records_by_id.get(ref.record)
        if ref_record is None:
            return ClaimResult(claim, "invalid", f"reference record {ref.record!r} is not among the records",
                               measured=measured, basis=basis, **base)
        if expected_value is None:
            try:
                expected_value = _measured(claim, ref_record)
            except ValueError as err:
                return ClaimResult(claim, "invalid", f"reference record {ref.record}: {err}", measured=measured,
                                   basis=basis, **base)
    if expected_value is not None:
        try:
            in_band, expected, how = _judge_band(claim, measured, expected_value, ref)
        except ValueError as err:
            return ClaimResult(claim, "invalid", str(err), measured=measured, basis=basis, **base)
        if basis == "reference":
            how += " of the reference pinned for these conditions (the published value is not judged here)"
        notes.insert(0, how)
    drift = None
    if claim.kind == "timing" and ref_record is not None and ref_record.record_id != record.record_id:
        policy = registry.drift if registry is not None else DriftPolicy()
        try:
            drift = drift_test(_samples(ref_record, claim), _samples(record, claim), claim.better or "", policy)
        except ValueError as err:
            return ClaimResult(claim, "invalid", f"timing samples: {err}", measured=measured, basis=basis,
                               reference_record=ref_record, **base)
        notes.append(str(drift))
        in_band = drift.direction != "worse"  # against a reference run, the rank test decides timings
    verdict = "reproduced" if in_band else "drifted"
    if drift is not None and drift.direction == "better":
        verdict = "improved"
    return ClaimResult(claim, verdict, "; ".join(notes), measured=measured, expected=expected, basis=basis,
                       drift=drift, reference_record=ref_record, **base)


def _samples(record: RunRecord, claim: Claim) -> list[float]:
    if claim.samples not in record.samples:
        raise ValueError(f"record {record.record_id} has no raw samples {claim.samples!r}")
    return list(record.samples[claim.samples])


def _newest_per_conditions(records: Iterable[RunRecord], claim_id: str, registry: Registry) -> list[RunRecord]:
    newest: dict[tuple[str, str], RunRecord] = {}
    for record in sorted(records, key=lambda r: (r.created, r.record_id)):
        if claim_id in registry.claim_ids_of(record):
            newest[(record.conditions["model"], record.conditions["hardware"])] = record
    return list(newest.values())


def evaluate(registry: Registry, records: Sequence[RunRecord]) -> Evaluation:
    """Judge the newest record per (claim, model, hardware); list unmeasured claims."""
    errors = []
    for record in records:
        unknown = [c for c in record.claim_ids if c not in registry.claims]
        if unknown:
            errors.append(f"record {record.source or record.record_id}: unknown claim ids {unknown}")
        errors += _erratum_errors(registry, record)
    by_id = {r.record_id: r for r in records}
    results: list[ClaimResult] = []
    for claim in registry.claims.values():
        chosen = _newest_per_conditions(records, claim.id, registry)
        if not claim.measurable:
            detail = f"not re-measured: {claim.not_measurable}"
            results.append(ClaimResult(claim, "not_measurable", detail))
            if chosen:
                errors.append(f"claim {claim.id} is marked not_measurable but records declare it")
            continue
        if not chosen:
            results.append(ClaimResult(claim, "unmeasured", _unmeasured_detail(claim, records, registry)))
            continue
        for record in chosen:
            result = judge_record(claim, record, registry, by_id)
            erratum = registry.errata.get(record.record_id)
            if erratum is not None and claim.id in erratum.measures:
                result.detail += f"; read by registry erratum (record {record.record_id} did not declare it)"
            results.append(result)
    return Evaluation(results, errors)


def _erratum_errors(registry: Registry, record: RunRecord) -> list[str]:
    """An erratum must correct its record's actual declaration: drop only declared ids, add only undeclared."""
    erratum = registry.errata.get(record.record_id)
    if erratum is None:
        return []
    where = f"erratum for record {record.source or record.record_id}"
    errors = [f"{where}: unmeasured claim {c} is not declared by the record" for c in erratum.unmeasured
              if c not in record.claim_ids]
    return errors + [f"{where}: claim {c} is already declared by the record" for c in erratum.measures
                     if c in record.claim_ids]


def _unmeasured_detail(claim: Claim, records: Sequence[RunRecord], registry: Registry) -> str:
    why = [f"record {r.record_id} declares it but holds no value: {registry.errata[r.record_id].unmeasured[claim.id]}"
           for r in records if r.record_id in registry.errata and claim.id in registry.errata[r.record_id].unmeasured]
    return "; ".join([*why, f"no record measures it yet; measured by {claim.test}"])
