"""The claims registry (reproductions/claims.toml) and its two judgments of every run record.

Each claim of the seed README is judged twice, separately:

1. **Against the seed's figure** (`SEED_VERDICTS`): `consistent` (the measurement lies in the seed's
   band), `contradicted` (outside it, above or below), `not comparable` (the record's conditions differ
   from the seed's in something the figure depends on; the detail names what differs and what would make
   it comparable) or `unmeasured`. A claim lists the conditions its figure `depends` on (model,
   model_class, hardware, prompts); a `portable` claim (byte counts, closed forms, losslessness) depends on
   none and is comparable everywhere. Where the numbers are not comparable but the claim states a
   `quality` (a sign, an ordering written as a difference) whose own `quality_depends` do match, the
   quality is judged against `quality_band`, and the detail says so.
2. **Against our own reference** (`REFERENCE_VERDICTS`), the regression gate: `stable`, `improved` or
   `drifted` against the `[[reference]]` pinned for exactly the record's conditions (model, hardware,
   prompts); `no reference` where none is pinned (shown, not gated); `invalid` for a partial or malformed
   record. Values are judged by their band; timing claims with a reference record by a Mann-Whitney U
   test over raw samples (p < alpha) AND a median ratio beyond `factor` (asv's rule).

The gate (`Evaluation.failed`) fails on judgment 2 (drifted, invalid), on a portable claim contradicted,
and on record errors; with `strict`, also on unmeasured claims and measured claims with no reference.

Conditions are data on both sides. The seed's are named once (`[seed.<name>]`); a key the seed does not
state (its GPU) can never be matched, so a figure depending on it is never comparable. A record's are
read from the record: `conditions.model`, `conditions.hardware`, the model's class from the registry's
`[models]` table, the prompt set from `environment.prompts_hash` (named by the `[prompts]` table),
checkpoint hashes from `environment.models` (shown).

A metric is a record metric key, arithmetic over keys ("100 * (1 / speedup - 1)"), or
`median:<samples key>`. The registry's schema is documented at the top of reproductions/claims.toml.
"""

from __future__ import annotations

import ast
import math
import re
import statistics
import sys
from collections import Counter
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
    "Conditions",
    "DEFAULT_REGISTRY",
    "DriftPolicy",
    "DriftTest",
    "Erratum",
    "Evaluation",
    "Reference",
    "ReferenceJudgment",
    "Registry",
    "RegistryError",
    "REFERENCE_VERDICTS",
    "SEED_VERDICTS",
    "STATUSES",
    "SeedJudgment",
    "SeedTally",
    "drift_test",
    "evaluate",
    "format_value",
    "judge_record",
    "load_registry",
    "missing_inputs",
    "missing_tests",
    "summary",
    "tally",
]

DEFAULT_REGISTRY = "reproductions/claims.toml"
SCHEMA_VERSION = 2
STATUSES = ("validated", "corrected", "limitation", "open")
KINDS = ("value", "span", "timing", "exact")
SEED_VERDICTS = ("consistent", "contradicted", "not comparable", "unmeasured")
REFERENCE_VERDICTS = ("stable", "improved", "drifted", "invalid", "no reference")
FAILING = frozenset({"drifted", "invalid"})
DEPENDS = ("model", "model_class", "hardware", "prompts")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_TEST_RE = re.compile(r"^reproductions/[\w/]+\.py::\w+(\[[^\]]+\])?$")
_CLAIM_KEYS = {
    "id", "statement", "quote", "published", "unit", "status", "seed", "trials", "kind", "metric", "metric_high",
    "samples", "better", "tolerance", "rel_tolerance", "test", "portable", "depends", "quality", "quality_band",
    "quality_depends", "original", "source", "note", "not_measurable",
}
_AREA_KEYS = (_CLAIM_KEYS - {"id", "statement", "quote", "published", "original"}) | {"name", "claim"}
_SEED_KEYS = {"model", "model_class", "hardware", "prompts"}
_REFERENCE_KEYS = {"model", "hardware", "prompts", "record", "note", "values", "tolerance", "rel_tolerance"}
_ERRATUM_KEYS = {"record", "measures", "unmeasured", "note"}
_SAMPLE_MEDIAN = "median:"  # metric = "median:<samples key>"


class RegistryError(ValueError):
    """The registry file is malformed; the message names the file and the entry."""


# -- data -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Band:
    """Inclusive [low, high] after tolerance."""

    low: float
    high: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def __str__(self) -> str:
        return f"{_fmt(self.low)}" if self.low == self.high else f"[{_fmt(self.low)}, {_fmt(self.high)}]"


Published = float | tuple[float, float] | bool


@dataclass(frozen=True)
class Conditions:
    """What a figure was measured under. None: not stated (a seed condition left out never matches)."""

    model: str
    hardware: str | None = None
    model_class: str | None = None
    prompts: str | None = None
    trials: int | None = None
    checkpoints: tuple[str, ...] = ()

    def get(self, key: str) -> str | None:
        return getattr(self, key)

    def describe(self) -> str:
        parts = [self.model, self.hardware or "GPU not named"]
        if self.prompts is not None:
            parts.append(f"prompts {_short(self.prompts)}")
        if self.trials is not None:
            parts.append(f"N={self.trials}")
        return " / ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "model_class": self.model_class, "hardware": self.hardware,
                "prompts": self.prompts, "trials": self.trials, "checkpoints": list(self.checkpoints)}


@dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    quote: str
    published: Published
    unit: str
    status: str
    seed: Conditions
    depends: tuple[str, ...] = ()
    kind: str = "value"
    metric: str | None = None
    metric_high: str | None = None
    samples: str | None = None
    better: str | None = None
    tolerance: float = 0.0
    rel_tolerance: float = 0.0
    test: str | None = None
    portable: bool = False
    quality: str | None = None
    quality_band: tuple[float, float] | None = None
    quality_depends: tuple[str, ...] = ()
    original: Published | None = None
    source: str = ""
    note: str = ""
    area: str = ""
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
    """Our own expected value of one claim under one set of conditions (model, hardware, prompts)."""

    claim: str
    model: str
    hardware: str
    value: Published
    prompts: str | None = None
    tolerance: float | None = None
    rel_tolerance: float | None = None
    record: str | None = None  # the record it was pinned from; a timing claim's raw-sample baseline
    note: str = ""


@dataclass(frozen=True)
class Erratum:
    """A correction to one committed record's declared claim ids (records themselves are immutable)."""

    record: str
    measures: tuple[str, ...] = ()  # claims the record measures but did not declare
    unmeasured: tuple[str, ...] = ()  # declared claims the record holds no valid value for
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
    models: dict[str, str] = field(default_factory=dict)  # record model -> model class
    prompts: dict[str, str] = field(default_factory=dict)  # prompt-set name -> sha256

    def claim_ids_of(self, record: RunRecord) -> list[str]:
        """The claims a record measures: its declared ids, corrected by its erratum if it has one."""
        erratum = self.errata.get(record.record_id)
        if erratum is None:
            return list(record.claim_ids)
        kept = [c for c in record.claim_ids if c not in erratum.unmeasured]
        return kept + [c for c in erratum.measures if c not in kept]

    def conditions_of(self, record: RunRecord) -> Conditions:
        """A record's conditions, from its conditions field and its environment capture."""
        env = record.environment
        # a suite that hashes its prompt file into its config (the real pair's prompts_sha256) names its set there
        digest = env.get("prompts_hash") or record.config.get("prompts_sha256")
        names = {h: name for name, h in self.prompts.items()}
        models = env.get("models") if isinstance(env.get("models"), list) else []
        checkpoints = tuple(m["checkpoint_sha256"] for m in models
                            if isinstance(m, dict) and isinstance(m.get("checkpoint_sha256"), str))
        model = record.conditions["model"]
        return Conditions(model=model, hardware=record.conditions["hardware"], model_class=self.models.get(model),
                          prompts=names.get(digest, digest) if isinstance(digest, str) else None,
                          trials=record.conditions["trials"], checkpoints=checkpoints)

    def reference_for(self, claim_id: str, cond: Conditions) -> Reference | None:
        """The reference pinned for exactly these conditions (model, hardware, prompts), if any."""
        for ref in self.references:
            if (ref.claim, ref.model, ref.hardware, ref.prompts) == (claim_id, cond.model, cond.hardware,
                                                                    cond.prompts):
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


@dataclass(frozen=True)
class SeedJudgment:
    verdict: str  # one of SEED_VERDICTS
    detail: str
    judged: str | None = None  # "figure" | "quality" where a comparison was made
    expected: Band | bool | float | None = None
    direction: str | None = None  # contradicted: "above" | "below" | "differs"
    differs: tuple[str, ...] = ()  # the condition keys that differ from the seed's


@dataclass(frozen=True)
class ReferenceJudgment:
    verdict: str  # one of REFERENCE_VERDICTS
    detail: str
    expected: Band | bool | float | None = None
    reference: Reference | None = None
    reference_record: RunRecord | None = None
    drift: DriftTest | None = None


@dataclass
class ClaimResult:
    """One claim judged on one record (or on none: unmeasured)."""

    claim: Claim
    seed: SeedJudgment
    reference: ReferenceJudgment | None = None
    record: RunRecord | None = None
    conditions: Conditions | None = None
    measured: Any = None

    @property
    def failed(self) -> bool:
        if self.reference is not None and self.reference.verdict in FAILING:
            return True
        return self.claim.portable and self.seed.verdict == "contradicted"

    def summary(self) -> str:
        c = self.claim
        unit = f" {c.unit}" if c.unit else ""
        measured = "-" if self.measured is None else format_value(self.measured)
        ref = "-" if self.reference is None else self.reference.verdict
        where = "" if self.conditions is None else f" [{self.conditions.describe()}]"
        text = (f"{c.id}: seed {format_value(c.published)}{unit}, measured {measured}{where}. "
                f"vs seed: {self.seed.verdict} ({self.seed.detail})")
        if self.reference is not None:
            text += f". vs reference: {ref} ({self.reference.detail})"
        return text


@dataclass(frozen=True)
class SeedTally:
    """Per seed claim, its judgment against the seed's figure, counted."""

    total: int
    counts: dict[str, int]  # SEED_VERDICTS -> claims
    by_quality: int  # of the consistent / contradicted, how many were judged on their quality only
    differing: dict[str, int]  # condition key -> not-comparable claims for which it differs
    unmeasured_why: dict[str, int]  # reason -> unmeasured claims


@dataclass
class Evaluation:
    results: list[ClaimResult]
    errors: list[str] = field(default_factory=list)  # record-level problems (unknown claim ids, ...)

    def failed(self, strict: bool = False) -> bool:
        if self.errors or any(r.failed for r in self.results):
            return True
        return strict and any(r.claim.measurable and (r.reference is None or r.reference.verdict == "no reference"
                                                      and not r.claim.portable) for r in self.results)

    def by_seed(self) -> dict[str, list[ClaimResult]]:
        out: dict[str, list[ClaimResult]] = {v: [] for v in SEED_VERDICTS}
        for r in self.results:
            out[r.seed.verdict].append(r)
        return out

    def by_reference(self) -> dict[str, list[ClaimResult]]:
        out: dict[str, list[ClaimResult]] = {v: [] for v in REFERENCE_VERDICTS}
        for r in self.results:
            if r.reference is not None:
                out[r.reference.verdict].append(r)
        return out


# -- formatting -----------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.4g}"


def _short(text: str) -> str:
    """A sha256 shortened to 12 hex digits; other text as it is."""
    return text[:12] if re.fullmatch(r"[0-9a-f]{64}", text) else text


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


def load_registry(path: str | Path = DEFAULT_REGISTRY) -> Registry:
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
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {data.get('schema_version')!r}")
    unknown = set(data) - {"schema_version", "drift", "seed", "models", "prompts", "area", "claim", "reference",
                           "erratum"}
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)}")
    seeds = {name: _parse_seed(name, entry) for name, entry in _table(data, "seed").items()}
    models = _string_map(data, "models")
    prompts = _string_map(data, "prompts")
    entries = [(dict(e), {}) for e in data.get("claim", [])]
    for i, area in enumerate(data.get("area", [])):
        unknown = set(area) - _AREA_KEYS
        if unknown or not isinstance(area.get("name"), str):
            raise ValueError(f"area #{i}: needs a name, unknown keys {sorted(unknown)}")
        defaults = {k: v for k, v in area.items() if k != "claim"}
        entries += [(dict(e), defaults) for e in area.get("claim", [])]
    claims: dict[str, Claim] = {}
    for i, (entry, defaults) in enumerate(entries):
        claim = _parse_claim(entry, defaults, i, seeds)
        if claim.id in claims:
            raise ValueError(f"duplicate claim id {claim.id!r}")
        claims[claim.id] = claim
    references = [ref for i, entry in enumerate(data.get("reference", []))
                  for ref in _parse_reference(entry, i, claims, prompts)]
    keys = [(r.claim, r.model, r.hardware, r.prompts) for r in references]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise ValueError(f"more than one reference for {sorted(dupes, key=str)}")
    errata: dict[str, Erratum] = {}
    for i, entry in enumerate(data.get("erratum", [])):
        erratum = _parse_erratum(entry, i, claims)
        if erratum.record in errata:
            raise ValueError(f"more than one erratum for record {erratum.record!r}")
        errata[erratum.record] = erratum
    return Registry(claims, references, _parse_drift(data.get("drift", {})), path, errata, models, prompts)


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"[{key}] must be a table")
    return value


def _string_map(data: Mapping[str, Any], key: str) -> dict[str, str]:
    table = _table(data, key)
    if not all(isinstance(v, str) and v for v in table.values()):
        raise ValueError(f"[{key}] must map names to non-empty strings")
    return dict(table)


def _parse_seed(name: str, entry: Any) -> Conditions:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("model"), str):
        raise ValueError(f"[seed.{name}] needs a model")
    unknown = set(entry) - _SEED_KEYS
    if unknown or not all(isinstance(v, str) and v for v in entry.values()):
        raise ValueError(f"[seed.{name}]: keys {sorted(_SEED_KEYS)} with non-empty strings, got {dict(entry)}")
    return Conditions(**entry)


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


def _keys(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or any(k not in DEPENDS for k in value):
        raise ValueError(f"{where} must be a list of {DEPENDS}, got {value!r}")
    return tuple(value)


def _parse_claim(entry: dict[str, Any], defaults: Mapping[str, Any], index: int,
                 seeds: Mapping[str, Conditions]) -> Claim:
    cid = entry.get("id", f"#{index}")
    where = f"claim {cid!r}"
    unknown = set(entry) - _CLAIM_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    notes = [n for n in (defaults.get("note"), entry.get("note")) if n]
    inherited = {k: v for k, v in defaults.items() if k != "name"}
    if "quality" not in entry:  # an area's quality keys serve only the claims that state a quality
        inherited = {k: v for k, v in inherited.items() if not k.startswith("quality")}
    fields = {**inherited, **entry}
    for key in ("id", "statement", "quote", "unit", "status"):
        if not isinstance(fields.get(key), str) or (key != "unit" and not fields[key]):
            raise ValueError(f"{where}: {key} must be a non-empty string")
    if not _ID_RE.match(fields["id"]):
        raise ValueError(f"{where}: id must match {_ID_RE.pattern}")
    if fields["status"] not in STATUSES:
        raise ValueError(f"{where}: status must be one of {STATUSES}, got {fields['status']!r}")
    if fields.get("seed") not in seeds:
        raise ValueError(f"{where}: seed must name a [seed.<name>] table, got {fields.get('seed')!r}")
    trials = fields.pop("trials", 1)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"{where}: trials must be an int >= 1, got {trials!r}")
    seed = seeds[fields["seed"]]
    fields["seed"] = Conditions(seed.model, seed.hardware, seed.model_class, seed.prompts, trials)
    fields["published"] = _parse_published(fields.get("published"), f"{where}: published")
    if "original" in fields:
        fields["original"] = _parse_published(fields["original"], f"{where}: original")
    fields["depends"] = _keys(fields.get("depends", []), f"{where}: depends")
    fields["quality_depends"] = _keys(fields.get("quality_depends", []), f"{where}: quality_depends")
    if "quality_band" in fields:
        band = _parse_published(fields["quality_band"], f"{where}: quality_band")
        if not isinstance(band, tuple):
            raise ValueError(f"{where}: quality_band must be a [low, high] pair")
        fields["quality_band"] = band
    fields["note"] = " ".join(notes)
    fields["area"] = defaults.get("name", "")
    claim = Claim(**fields)
    _check_claim(claim, where)
    return claim


def _check_claim(c: Claim, where: str) -> None:
    if c.kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {KINDS}, got {c.kind!r}")
    if c.tolerance < 0 or c.rel_tolerance < 0:
        raise ValueError(f"{where}: tolerances must be >= 0")
    if c.portable == bool(c.depends):
        raise ValueError(f"{where}: give depends = [the conditions its figure depends on], or portable = true")
    if (c.quality is None) != (c.quality_band is None) or (c.quality is None and c.quality_depends):
        raise ValueError(f"{where}: a quality needs quality (what it says), quality_band and quality_depends")
    if c.quality is not None and set(c.quality_depends) >= set(c.depends):
        raise ValueError(f"{where}: quality_depends must be fewer conditions than depends (else it adds nothing)")
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


def _per_claim(entry: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = entry.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {key} must be a table of claim id = value")
    return value


def _parse_reference(entry: Mapping[str, Any], index: int, claims: Mapping[str, Claim],
                     prompts: Mapping[str, str]) -> list[Reference]:
    where = f"reference #{index} ({entry.get('model')!r} / {entry.get('hardware')!r})"
    unknown = set(entry) - _REFERENCE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    for key in ("model", "hardware", "note"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{where}: {key} must be a non-empty string")
    if "prompts" in entry and not isinstance(entry["prompts"], str):
        raise ValueError(f"{where}: prompts must name a prompt set of [prompts] (or be its sha256)")
    values = _per_claim(entry, "values", where)
    tols, rels = _per_claim(entry, "tolerance", where), _per_claim(entry, "rel_tolerance", where)
    if not values:
        raise ValueError(f"{where}: pins no values")
    stray = sorted((set(tols) | set(rels)) - set(values))
    if stray:
        raise ValueError(f"{where}: tolerance for claims it pins no value for: {stray}")
    out = []
    for cid, value in values.items():
        claim = claims.get(cid)
        if claim is None:
            raise ValueError(f"{where}: no claim with id {cid!r}")
        if claim.portable:
            raise ValueError(f"{where}: claim {cid} is portable (judged on the seed's figure everywhere)")
        for name, table in (("tolerance", tols), ("rel_tolerance", rels)):
            if cid in table and (not _is_num(table[cid]) or table[cid] < 0):
                raise ValueError(f"{where}: {name} of {cid} must be a number >= 0")
        out.append(Reference(cid, entry["model"], entry["hardware"], _parse_published(value, f"{where}: {cid}"),
                             entry.get("prompts"), tols.get(cid), rels.get(cid), entry.get("record"),
                             entry["note"]))
    return out


def _parse_erratum(entry: Mapping[str, Any], index: int, claims: Mapping[str, Claim]) -> Erratum:
    where = f"erratum #{index} ({entry.get('record')!r})"
    unknown = set(entry) - _ERRATUM_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    if not isinstance(entry.get("record"), str) or not entry["record"]:
        raise ValueError(f"{where}: record must be a record id")
    if not isinstance(entry.get("note", ""), str) or not entry.get("note"):
        raise ValueError(f"{where}: note must say why the record's declaration is corrected")
    lists = {key: entry.get(key, []) for key in ("measures", "unmeasured")}
    for key, ids in lists.items():
        if not isinstance(ids, list) or not all(isinstance(c, str) for c in ids):
            raise ValueError(f"{where}: {key} must be a list of claim ids")
    if not lists["measures"] and not lists["unmeasured"]:
        raise ValueError(f"{where}: corrects nothing (give measures and/or unmeasured)")
    for cid in [*lists["measures"], *lists["unmeasured"]]:
        if cid not in claims:
            raise ValueError(f"{where}: no claim with id {cid!r}")
        if not claims[cid].measurable:
            raise ValueError(f"{where}: claim {cid} is not measurable")
    both = sorted(set(lists["measures"]) & set(lists["unmeasured"]))
    if both:
        raise ValueError(f"{where}: {both} both measured and unmeasured")
    return Erratum(entry["record"], tuple(lists["measures"]), tuple(lists["unmeasured"]), entry["note"])


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


# -- metrics ---------------------------------------------------------------------------------------------


def drift_test(reference: Sequence[float], measured: Sequence[float], better: str, policy: DriftPolicy) -> DriftTest:
    """Rank test + minimum effect size (asv). Raises ValueError with too few samples."""
    from sdsie.stats import rank_test_p

    if min(len(reference), len(measured)) < policy.min_samples:
        raise ValueError(f"a rank test needs >= {policy.min_samples} samples per side, "
                         f"got {len(reference)} reference and {len(measured)} new")
    p_value = rank_test_p(reference, measured)
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


# -- judging ---------------------------------------------------------------------------------------------


def _judge_band(claim: Claim, measured: Any, expected: Published, tol: float, rel: float,
                ) -> tuple[bool, Any, str, str | None]:
    """(inside, expected band or value, how, direction when outside: above | below | differs)."""
    if claim.kind == "exact":
        ok = measured == expected and isinstance(measured, bool) == isinstance(expected, bool)  # 1.0 != true
        return ok, expected, "equal to" if ok else "NOT equal to", None if ok else "differs"
    if claim.kind == "span":
        if not isinstance(expected, tuple):
            raise ValueError("a span needs a [low, high] expected value")
        lo, hi = _band(expected[0], tol, rel), _band(expected[1], tol, rel)
        ok = lo.contains(measured[0]) and hi.contains(measured[1])
        direction = None if ok else ("below" if measured[0] < lo.low or measured[1] < hi.low else "above")
        return ok, Band(lo.low, hi.high), f"{'within' if ok else 'OUTSIDE'} the span bands (low end {lo}, " \
                                          f"high end {hi}) of", direction
    band = _band(expected, tol, rel)
    ok = band.contains(measured)
    direction = None if ok else ("below" if measured < band.low else "above")
    return ok, band, f"{'within' if ok else 'OUTSIDE'} band {band} of", direction


def _differs(claim: Claim, keys: Iterable[str], cond: Conditions) -> tuple[str, ...]:
    return tuple(k for k in keys if claim.seed.get(k) is None or claim.seed.get(k) != cond.get(k))


def _why_not_comparable(claim: Claim, differs: Sequence[str], cond: Conditions) -> str:
    parts = []
    for key in differs:
        seed, here = claim.seed.get(key), cond.get(key)
        here_text = "not stated" if here is None else f'"{_short(here)}"'
        if seed is None:
            parts.append(f"{key}: the seed does not name its {key} (here {here_text}), so no run can match it")
        else:
            parts.append(f'{key}: "{seed}" in the seed, {here_text} here')
    if all(claim.seed.get(k) is not None for k in differs):
        parts.append("comparable with a run of the seed's " + " and ".join(differs))
    return "; ".join(parts)


def judge_seed(claim: Claim, measured: Any, cond: Conditions) -> SeedJudgment:
    """Judgment 1: the measurement against the seed's figure, where the conditions make it comparable."""
    differs = _differs(claim, claim.depends, cond)
    if not differs:
        ok, expected, how, direction = _judge_band(claim, measured, claim.published, claim.tolerance,
                                                   claim.rel_tolerance)
        why = "portable: comparable on any machine" if claim.portable else \
            f"the conditions it depends on ({', '.join(claim.depends)}) match the seed's"
        return SeedJudgment("consistent" if ok else "contradicted", f"{how} the seed's figure; {why}", "figure",
                            expected, direction)
    quality_differs = _differs(claim, claim.quality_depends, cond)
    if claim.quality is None or claim.quality_band is None or quality_differs:
        detail = _why_not_comparable(claim, differs, cond)
        if claim.quality is not None:
            detail += f"; its quality (that {claim.quality}) depends on {', '.join(quality_differs)}, which differ too"
        return SeedJudgment("not comparable", detail, differs=differs)
    band = Band(*claim.quality_band)
    values = measured if isinstance(measured, tuple) else (measured,)
    ok = all(band.contains(v) for v in values)
    direction = None if ok else ("below" if min(values) < band.low else "above")
    detail = (f"the figure is not comparable ({_why_not_comparable(claim, differs, cond)}); judged its quality "
              f"instead, that {claim.quality}: the measurement lies {'within' if ok else 'OUTSIDE'} {band}")
    return SeedJudgment("consistent" if ok else "contradicted", detail, "quality", band, direction, differs)


def judge_reference(claim: Claim, record: RunRecord, measured: Any, cond: Conditions, registry: Registry | None,
                    records_by_id: Mapping[str, RunRecord]) -> ReferenceJudgment:
    """Judgment 2: the measurement against our own reference pinned for exactly these conditions."""
    if claim.portable:
        return ReferenceJudgment("no reference", "portable: the seed's figure is its gate")
    ref = registry.reference_for(claim.id, cond) if registry is not None else None
    if ref is None:
        return ReferenceJudgment("no reference", "no reference pinned for these conditions "
                                 "(model, hardware, prompts): shown, not gated; pin one with `sdsie claims pin`")
    tol = claim.tolerance if ref.tolerance is None else ref.tolerance
    rel = claim.rel_tolerance if ref.rel_tolerance is None else ref.rel_tolerance
    try:
        ok, expected, how, _ = _judge_band(claim, measured, ref.value, tol, rel)
    except ValueError as err:
        return ReferenceJudgment("invalid", str(err), reference=ref)
    notes = [f"{how} the reference"]
    ref_record, drift = None, None
    if claim.kind == "timing" and ref.record is not None and ref.record != record.record_id:
        ref_record = records_by_id.get(ref.record)
        if ref_record is None:
            return ReferenceJudgment("invalid", f"reference record {ref.record!r} is not among the records",
                                     expected, ref)
        policy = registry.drift if registry is not None else DriftPolicy()
        try:
            drift = drift_test(_samples(ref_record, claim), _samples(record, claim), claim.better or "", policy)
        except ValueError as err:
            return ReferenceJudgment("invalid", f"timing samples: {err}", expected, ref, ref_record)
        notes.append(str(drift))
        ok = drift.direction != "worse"  # against a reference run, the rank test decides timings
    verdict = "stable" if ok else "drifted"
    if drift is not None and drift.direction == "better":
        verdict = "improved"
    return ReferenceJudgment(verdict, "; ".join(notes), expected, ref, ref_record, drift)


def judge_record(claim: Claim, record: RunRecord, registry: Registry | None = None,
                 records_by_id: Mapping[str, RunRecord] | None = None) -> ClaimResult:
    """Judge one record for one claim: against the seed's figure and against our own reference."""
    cond = (registry or Registry({}, [], DriftPolicy())).conditions_of(record)
    base = {"record": record, "conditions": cond}
    problem = "partial record (complete = false): the run stopped early" if not record.complete else None
    measured = None
    if problem is None:
        try:
            measured = _measured(claim, record)
        except ValueError as err:
            problem = str(err)
    if problem is not None:
        return ClaimResult(claim, SeedJudgment("unmeasured", f"the record is invalid: {problem}"),
                           ReferenceJudgment("invalid", problem), **base)
    seed = judge_seed(claim, measured, cond)
    if claim.seed.trials is not None and cond.trials is not None and cond.trials < claim.seed.trials \
            and seed.judged is not None:
        seed = SeedJudgment(seed.verdict, f"{seed.detail}; fewer trials than the seed's "
                            f"({cond.trials} < {claim.seed.trials})", seed.judged, seed.expected, seed.direction,
                            seed.differs)
    reference = judge_reference(claim, record, measured, cond, registry, records_by_id or {})
    return ClaimResult(claim, seed, reference, measured=measured, **base)


def _samples(record: RunRecord, claim: Claim) -> list[float]:
    if claim.samples not in record.samples:
        raise ValueError(f"record {record.record_id} has no raw samples {claim.samples!r}")
    return list(record.samples[claim.samples])


def _newest_per_conditions(records: Iterable[RunRecord], claim_id: str, registry: Registry) -> list[RunRecord]:
    newest: dict[tuple[Any, ...], RunRecord] = {}
    for record in sorted(records, key=lambda r: (r.created, r.record_id)):
        if claim_id in registry.claim_ids_of(record):
            cond = registry.conditions_of(record)
            newest[(cond.model, cond.hardware, cond.prompts)] = record
    return list(newest.values())


def evaluate(registry: Registry, records: Sequence[RunRecord]) -> Evaluation:
    """Judge the newest record per (claim, conditions) both ways; list unmeasured claims."""
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
            results.append(ClaimResult(claim, SeedJudgment("unmeasured", f"not re-measurable: {claim.not_measurable}")))
            if chosen:
                errors.append(f"claim {claim.id} is marked not_measurable but records declare it")
            continue
        if not chosen:
            results.append(ClaimResult(claim, SeedJudgment("unmeasured", _unmeasured_detail(claim, records,
                                                                                            registry))))
            continue
        for record in chosen:
            result = judge_record(claim, record, registry, by_id)
            erratum = registry.errata.get(record.record_id)
            if erratum is not None and claim.id in erratum.measures and result.reference is not None:
                result.reference = ReferenceJudgment(
                    result.reference.verdict, f"{result.reference.detail}; read by registry erratum (record "
                    f"{record.record_id} did not declare it)", result.reference.expected, result.reference.reference,
                    result.reference.reference_record, result.reference.drift)
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
    why = [f"record {r.record_id} declares it but holds no valid value: {registry.errata[r.record_id].note}"
           for r in records if r.record_id in registry.errata and claim.id in registry.errata[r.record_id].unmeasured]
    return "; ".join([*why, f"no record measures it yet; measured by {claim.test}"])


# -- the quotable summary --------------------------------------------------------------------------------

_SEED_ORDER = ("contradicted", "consistent", "not comparable", "unmeasured")  # one verdict per claim, first wins


def tally(evaluation: Evaluation) -> SeedTally:
    """Count each seed claim once against the seed's figure (a contradiction under any conditions wins)."""
    per_claim: dict[str, list[ClaimResult]] = {}
    for r in evaluation.results:
        per_claim.setdefault(r.claim.id, []).append(r)
    counts = dict.fromkeys(SEED_VERDICTS, 0)
    differing: Counter[str] = Counter()
    why: Counter[str] = Counter()
    by_quality = 0
    for results in per_claim.values():
        chosen = min(results, key=lambda r: _SEED_ORDER.index(r.seed.verdict))
        counts[chosen.seed.verdict] += 1
        by_quality += chosen.seed.judged == "quality"
        if chosen.seed.verdict == "not comparable":
            differing.update(set().union(*(r.seed.differs for r in results)))
        elif chosen.seed.verdict == "unmeasured":
            why[_unmeasured_reason(chosen)] += 1
    return SeedTally(len(per_claim), counts, by_quality, dict(differing), dict(why))


def _unmeasured_reason(result: ClaimResult) -> str:
    if not result.claim.measurable:
        return "not re-measurable"
    if result.record is not None:
        return "record invalid"
    if "holds no valid value" in result.seed.detail:
        return "no valid record"
    return "no record yet"


_KEY_WORDS = {"model": "the model", "model_class": "the kind of model", "hardware": "the GPU (the seed names none)",
              "prompts": "the prompt set"}


def summary(evaluation: Evaluation) -> str:
    """One quotable line: of N seed claims, how many are consistent, contradicted, not comparable, unmeasured."""
    t = tally(evaluation)
    c = t.counts
    quality = f", {t.by_quality} of them on their quality only" if t.by_quality else ""
    keys = sorted(t.differing.items(), key=lambda kv: (-kv[1], DEPENDS.index(kv[0])))
    differing = "; ".join(f"{_KEY_WORDS[k]} differs for {n}" if i == 0 else f"{_KEY_WORDS[k]} for {n}"
                          for i, (k, n) in enumerate(keys))
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(t.unmeasured_why.items(), key=lambda kv: -kv[1]))
    return (f"Of {t.total} seed claims, {c['consistent']} {_are(c['consistent'])} consistent with the seed's figure "
            f"and {c['contradicted']} contradicted{quality}; {c['not comparable']} {_are(c['not comparable'])} not "
            f"comparable here{f' ({differing})' if differing else ''}; {c['unmeasured']} {_are(c['unmeasured'])} "
            f"unmeasured{f' ({why})' if why else ''}.")


def _are(n: int) -> str:
    return "is" if n == 1 else "are"
