"""Claims registry: the committed file's schema and content, and both judgments of the gate (vs the seed's figure,
vs our own reference)."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdsie.claims import (
    DriftPolicy,
    Registry,
    RegistryError,
    drift_test,
    evaluate,
    judge_record,
    load_registry,
    missing_inputs,
    missing_tests,
    summary,
    tally,
)
from sdsie.telemetry.records import RunRecord, load_records, newest_record, write_record

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "reproductions" / "claims.toml"
H200 = "NVIDIA H200"
SEED_PROMPTS = "a" * 64  # sha256 of a prompt set holding the seed's own prompts (a stand-in digest)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(REGISTRY)


# -- the committed registry ----------------------------------------------------------------------------

# (claim id, seed's figure) for the figures of the seed README; the registry must carry each one.
REQUIRED = {
    "kernel-bandwidth-reduction": (71.9, 73.4),
    "kernel-latency": -4.0,
    "kernel-power": 88.0,
    "entropy-sync-us": 31.1,
    "entropy-sync-overhead": 32.5,
    "spec-k5-speedup": 1.82,
    "spec-k5-acceptance": 85.4,
    "spec-k5-fidelity": 100.0,
    "spec-k5-energy-reduction": (32.6, 60.3),
    "gated-tuned-code-throughput": 38.8,
    "gated-tuned-code-energy": 45.2,
    "gated-tuned-code-fallback": 17.0,
    "gated-tuned-code-acceptance": 91.8,
    "gated-tuned-poem-throughput": -3.0,
    "gated-tuned-physics-throughput": -0.5,
    "gated-tuned-poem-energy": 3.6,
    "gated-tuned-physics-energy": 10.5,
    "grid-production-poem": -10.5,
    "grid-best-poem": -5.6,
    "grid-production-physics": -13.1,
    "grid-best-physics": -4.7,
    "grid-production-code": 31.1,
    "grid-best-code": 34.8,
    "gated-decisions-bit-identical": True,
    "gear-fidelity-1l-physics": 35.6,
    "gear-fidelity-all-code": 9.2,
    "gear-code-int4-usage": 95.6,
    "gear-code-power": 2.7,
    "e2e-throughput": 50.13,
}
CORRECTED = {"kernel-latency": -63.1, "kernel-latency-us": 28.60, "kernel-bandwidth-reduction": 75.0,
             "e2e-throughput": 50.52, "spec-k5-energy-reduction": 46.7}
PORTABLE = {"kernel-bandwidth-reduction", "entropy-closed-form", "clutch-hysteresis", "spec-lossless-greedy",
            "gated-decisions-bit-identical"}


def test_registry_carries_every_seed_figure(registry: Registry) -> None:
    for cid, published in REQUIRED.items():
        assert cid in registry.claims, cid
        assert registry.claims[cid].published == published, cid
    for cid, original in CORRECTED.items():
        assert registry.claims[cid].status == "corrected", cid
        assert registry.claims[cid].original == pytest.approx(original), cid
    assert {c.id for c in registry.claims.values() if c.portable} == PORTABLE


def test_registry_holds_the_full_fidelity_and_gear_tables(registry: Registry) -> None:
    fidelity = [c for c in registry.claims if c.startswith("gear-fidelity-")]
    divergence = [c for c in registry.claims if c.startswith("gear-divergence-")]
    gear = [c for c in registry.claims if re.match(r"gear-(poem|physics|code)-", c)]
    assert len(fidelity) == len(divergence) == 12  # 4 layer counts x 3 prompts
    assert len(gear) == 9  # 3 prompts x (usage, throughput, power)


def _numbers(text: str) -> set[float]:
    text = text.replace("\u2212", "-").replace("\u2013", "-")
    return {float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)}


def test_every_figure_is_in_the_seeds_own_words(registry: Registry) -> None:
    """Each claim quotes the seed README; every published and original number must be in that quote."""
    for claim in registry.claims.values():
        numbers = _numbers(claim.quote)
        for value in (claim.published, claim.original):
            if value is None or isinstance(value, bool):
                continue
            for v in value if isinstance(value, tuple) else (value,):
                if math.isinf(v) or v == 0.0:  # open bounds of a qualitative band ("still slower than baseline")
                    continue
                assert abs(v) in numbers, f"{claim.id}: {v} is not in its quote {claim.quote!r}"


def test_registry_ranges_are_two_sided(registry: Registry) -> None:
    band = registry.claims["kernel-bandwidth-reduction"].band()
    assert band.low == pytest.approx(71.85) and band.high == pytest.approx(73.45)
    assert not band.contains(71.84) and band.contains(71.86) and band.contains(73.44) and not band.contains(73.46)


def test_every_claim_names_an_existing_test_node(registry: Registry) -> None:
    assert missing_tests(registry, ROOT) == []


def test_areas_give_defaults_and_notes_are_stated_once(registry: Registry) -> None:
    text = REGISTRY.read_text(encoding="utf-8")
    notes = re.findall(r'^note = (".*")$', text, re.MULTILINE)
    assert len(notes) == len(set(notes))
    divergence = [c for c in registry.claims.values() if c.id.startswith("gear-divergence-")]
    assert all("250 means no divergence" in c.note for c in divergence)
    assert all(c.test == "reproductions/test_resolution_gear_gpu.py::test_fidelity_by_gated_layers" for c in divergence)


# -- registry schema -------------------------------------------------------------------------------------

SEEDS = """
schema_version = 2
[seed.s]
model = "m"
hardware = "h"
[seed.instruct]
model = "Llama-8B-Instruct"
model_class = "instruction-tuned"
prompts = "seed"
[models]
"SmolLM2-135M-Instruct" = "instruction-tuned"
"stand-in" = "stand-in"
[prompts]
seed = "SEED_PROMPTS"
""".replace("SEED_PROMPTS", SEED_PROMPTS)

CLAIM = """
[[claim]]
id = "x"
statement = "s"
quote = "from 1.0 to 2.0"
published = [1.0, 2.0]
unit = "%"
status = "validated"
seed = "s"
trials = 3
depends = ["model", "hardware"]
metric = "x_pct"
tolerance = 0.1
test = "reproductions/test_claims_cpu.py::test_x"
"""
GOOD = SEEDS + CLAIM


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "claims.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('status = "validated"', 'status = "sure"', "status must be one of"),
        ("published = [1.0, 2.0]", "published = [2.0, 1.0]", "low <= high"),
        ("published = [1.0, 2.0]", 'published = "big"', "must be a number"),
        ("trials = 3", "trials = 0", "trials must be an int >= 1"),
        ('test = "reproductions/test_claims_cpu.py::test_x"', 'test = "tests/x.py"', "test must be a node id"),
        ('metric = "x_pct"', "", "give a metric"),
        ("tolerance = 0.1", "tolerance = -1.0", "tolerances must be >= 0"),
        ("tolerance = 0.1", "tolerence = 0.1", "unknown keys \\['tolerence'\\]"),
        ('unit = "%"', 'unit = "%"\nkind = "timing"', "timing claim needs samples"),
        ('unit = "%"', 'unit = "%"\nkind = "span"', "span claim needs"),
        ("schema_version = 2", "schema_version = 1", "schema_version must be 2"),
        ('id = "x"', 'id = "Bad Id"', "id must match"),
        ('metric = "x_pct"', 'metric = "__import__(x)"', "does not parse|may use only"),
        ('metric = "x_pct"', 'metric = "x_pct ** 2"', "may use only numbers"),
        ('seed = "s"', 'seed = "nope"', "seed must name a \\[seed.<name>\\] table"),
        ('depends = ["model", "hardware"]', 'depends = ["gpu"]', "depends must be a list of"),
        ('depends = ["model", "hardware"]', "", "give depends"),
        ('depends = ["model", "hardware"]', 'depends = ["model"]\nportable = true', "give depends"),
        ('quote = "from 1.0 to 2.0"', "", "quote must be a non-empty string"),
        ('unit = "%"', 'unit = "%"\nquality = "q"', "a quality needs"),
        ('unit = "%"', 'unit = "%"\nquality = "q"\nquality_band = [0.0, inf]\nquality_depends = ["model", "hardware"]',
         "quality_depends must be fewer"),
    ],
)
def test_schema_violations_name_the_file_and_entry(tmp_path: Path, old: str, new: str, message: str) -> None:
    path = _write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(RegistryError, match=message) as info:
        load_registry(path)
    assert str(path) in str(info.value)


def test_duplicate_ids_and_orphan_references_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="duplicate claim id 'x'"):
        load_registry(_write(tmp_path, GOOD + CLAIM))
    orphan = GOOD + '[[reference]]\nmodel = "m2"\nhardware = "h2"\nnote = "n"\n[reference.values]\nnope = 1.0\n'
    with pytest.raises(RegistryError, match="no claim with id 'nope'"):
        load_registry(_write(tmp_path, orphan))
    with pytest.raises(RegistryError, match="invalid TOML"):
        load_registry(_write(tmp_path, "[[claim]\n"))


def test_area_defaults_apply_to_its_claims(tmp_path: Path) -> None:
    area = SEEDS + (
        '[[area]]\nname = "A"\nnote = "Shared sentence."\nseed = "s"\ndepends = ["hardware"]\ntolerance = 0.5\n'
        'test = "reproductions/test_claims_cpu.py::test_x"\n'
        '[[area.claim]]\nid = "a"\nstatement = "s"\nquote = "1.0"\npublished = 1.0\nunit = ""\nstatus = "open"\n'
        'metric = "a"\nnote = "Own sentence."\n'
        '[[area.claim]]\nid = "b"\nstatement = "s"\nquote = "2.0"\npublished = 2.0\nunit = ""\nstatus = "open"\n'
        'metric = "b"\ntolerance = 0.0\n')
    reg = load_registry(_write(tmp_path, area))
    a, b = reg.claims["a"], reg.claims["b"]
    assert (a.area, a.tolerance, a.depends, a.note) == ("A", 0.5, ("hardware",), "Shared sentence. Own sentence.")
    assert (b.tolerance, b.note) == (0.0, "Shared sentence.")


# -- judging against the seed's figure ---------------------------------------------------------------------


def record(claim_ids: list[str], metrics: dict, *, model: str = "m", hardware: str = "h", trials: int = 3,
           samples: dict | None = None, created: str = "2026-01-01T00:00:00+00:00", complete: bool = True,
           prompts: str | None = None) -> RunRecord:
    return RunRecord(claim_ids=claim_ids, suite="t", config={}, samples=samples or {"n": [1.0]}, metrics=metrics,
                     environment={} if prompts is None else {"prompts_hash": prompts},
                     conditions={"model": model, "hardware": hardware, "trials": trials},
                     created=created, complete=complete)


def _registry(tmp_path: Path, extra: str = "") -> Registry:
    return load_registry(_write(tmp_path, GOOD + extra))


@pytest.mark.parametrize(("value", "verdict", "direction"), [
    (0.89, "contradicted", "below"), (0.91, "consistent", None), (1.5, "consistent", None),
    (2.09, "consistent", None), (2.11, "contradicted", "above")])
def test_seed_band_is_two_sided_with_tolerance(tmp_path: Path, value: float, verdict: str, direction: str) -> None:
    reg = _registry(tmp_path)
    result = evaluate(reg, [record(["x"], {"x_pct": value})]).results[0]
    assert (result.seed.verdict, result.seed.judged, result.seed.direction) == (verdict, "figure", direction)
    assert not result.failed  # a non-portable seed claim contradicted is a finding, not a regression
    assert result.reference.verdict == "no reference"
    if verdict == "contradicted":
        assert "OUTSIDE band [0.9, 2.1] of the seed's figure" in result.summary()


@pytest.fixture(scope="module")
def good_registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    return load_registry(_write(tmp_path_factory.mktemp("good"), GOOD))


@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_a_value_outside_the_seeds_band_is_never_consistent(good_registry: Registry, value: float) -> None:
    reg = good_registry
    for model, hardware in (("m", "h"), ("other", "h"), ("m", H200)):
        res = judge_record(reg.claims["x"], record(["x"], {"x_pct": value}, model=model, hardware=hardware), reg)
        inside = reg.claims["x"].band().contains(value)
        assert (res.seed.verdict == "consistent") == (inside and (model, hardware) == ("m", "h"))


def test_portable_claims_hold_the_seeds_band_everywhere_and_gate_it(tmp_path: Path) -> None:
    text = GOOD.replace('depends = ["model", "hardware"]', "portable = true")
    reg = load_registry(_write(tmp_path, text))
    bad = evaluate(reg, [record(["x"], {"x_pct": 9.0}, model="tiny", hardware="cpu")])
    res = bad.results[0]
    assert (res.seed.verdict, res.seed.direction, res.reference.verdict) == ("contradicted", "above", "no reference")
    assert res.failed and bad.failed()
    good = evaluate(reg, [record(["x"], {"x_pct": 1.5}, model="tiny", hardware="cpu")]).results[0]
    assert good.seed.verdict == "consistent" and "portable" in good.seed.detail and not good.failed


def test_other_conditions_are_not_comparable_and_say_what_differs(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    res = evaluate(reg, [record(["x"], {"x_pct": 50.0}, model="stand-in", hardware=H200)]).results[0]
    assert res.seed.verdict == "not comparable" and res.seed.differs == ("model", "hardware")
    assert '"m" in the seed, "stand-in" here' in res.seed.detail
    assert "comparable with a run of the seed's model and hardware" in res.seed.detail
    assert not res.failed


def test_a_condition_the_seed_does_not_state_is_never_matched(tmp_path: Path) -> None:
    claim = CLAIM.replace('seed = "s"', 'seed = "instruct"').replace('depends = ["model", "hardware"]',
                                                                     'depends = ["hardware"]')
    reg = load_registry(_write(tmp_path, SEEDS + claim))
    res = evaluate(reg, [record(["x"], {"x_pct": 1.5}, model="Llama-8B-Instruct", hardware=H200)]).results[0]
    assert res.seed.verdict == "not comparable" and "does not name its hardware" in res.seed.detail


INSTRUCT = CLAIM.replace('seed = "s"', 'seed = "instruct"').replace(
    'depends = ["model", "hardware"]', 'depends = ["model_class", "prompts"]')


def test_a_run_matching_the_seeds_conditions_is_judged_against_the_seeds_figure(tmp_path: Path) -> None:
    """A real instruction-tuned model with the seed's prompts: the figure depends on the model's class and the
    prompts, both the seed's, so it is judged against the seed's figure (and still against its own reference)."""
    ref = ('[[reference]]\nmodel = "SmolLM2-135M-Instruct"\nhardware = "NVIDIA H200"\nprompts = "seed"\n'
           'note = "n"\n[reference.values]\nx = 50.0\n')
    reg = load_registry(_write(tmp_path, SEEDS + INSTRUCT + ref))
    real = dict(model="SmolLM2-135M-Instruct", hardware=H200, prompts=SEED_PROMPTS)
    res = evaluate(reg, [record(["x"], {"x_pct": 50.0}, **real)]).results[0]
    assert (res.seed.verdict, res.seed.judged, res.seed.direction) == ("contradicted", "figure", "above")
    assert res.reference.verdict == "stable" and not res.failed
    assert res.conditions.model_class == "instruction-tuned" and res.conditions.prompts == "seed"
    ok = evaluate(reg, [record(["x"], {"x_pct": 1.5}, **real)]).results[0]
    assert ok.seed.verdict == "consistent" and ok.reference.verdict == "drifted" and ok.failed
    other_prompts = evaluate(reg, [record(["x"], {"x_pct": 1.5}, **{**real, "prompts": "b" * 64})]).results[0]
    assert other_prompts.seed.verdict == "not comparable" and other_prompts.seed.differs == ("prompts",)
    assert other_prompts.reference.verdict == "no reference"  # other prompts: never our H200 reference either
    standin = evaluate(reg, [record(["x"], {"x_pct": 1.5}, model="stand-in", hardware=H200,
                                    prompts=SEED_PROMPTS)]).results[0]
    assert standin.seed.verdict == "not comparable" and standin.seed.differs == ("model_class",)


def test_a_quality_is_judged_when_only_the_figure_is_not_comparable(tmp_path: Path) -> None:
    quality = INSTRUCT.replace('depends = ["model_class", "prompts"]',
                               'depends = ["model", "hardware", "prompts"]\nquality = "it is positive"\n'
                               'quality_band = [0.0, inf]\nquality_depends = ["model_class", "prompts"]')
    reg = load_registry(_write(tmp_path, SEEDS + quality))
    real = dict(model="SmolLM2-135M-Instruct", hardware=H200, prompts=SEED_PROMPTS)
    res = evaluate(reg, [record(["x"], {"x_pct": 40.0}, **real)]).results[0]
    assert (res.seed.verdict, res.seed.judged) == ("consistent", "quality")
    assert "judged its quality instead, that it is positive" in res.seed.detail
    neg = evaluate(reg, [record(["x"], {"x_pct": -4.0}, **real)]).results[0]
    assert (neg.seed.verdict, neg.seed.judged, neg.seed.direction) == ("contradicted", "quality", "below")
    standin = evaluate(reg, [record(["x"], {"x_pct": 40.0}, model="stand-in", hardware=H200,
                                    prompts=SEED_PROMPTS)]).results[0]
    assert standin.seed.verdict == "not comparable" and "its quality (that it is positive)" in standin.seed.detail


# -- judging against our own reference ----------------------------------------------------------------------

REFERENCE = '[[reference]]\nmodel = "standin"\nhardware = "H200"\nnote = "n"\n[reference.values]\nx = 50.0\n' \
            '[reference.tolerance]\nx = 5.0\n'


def test_a_reference_serves_only_records_of_its_own_conditions(tmp_path: Path) -> None:
    reg = _registry(tmp_path, REFERENCE)
    on_h200 = evaluate(reg, [record(["x"], {"x_pct": 53.0}, model="standin", hardware="H200")]).results[0]
    assert on_h200.reference.verdict == "stable" and on_h200.seed.verdict == "not comparable"
    assert on_h200.conditions.describe() == "standin / H200 / N=3"
    drifted = evaluate(reg, [record(["x"], {"x_pct": 56.0}, model="standin", hardware="H200")])
    assert drifted.results[0].reference.verdict == "drifted" and drifted.failed()
    for changed in (dict(model="standin", hardware="A100"), dict(model="other", hardware="H200"),
                    dict(model="standin", hardware="H200", prompts="c" * 64)):
        far = evaluate(reg, [record(["x"], {"x_pct": 500.0}, **changed)])  # far outside the H200 band
        assert far.results[0].reference.verdict == "no reference" and not far.failed(), changed
        assert far.failed(strict=True)
    both = evaluate(reg, [on_h200.record, record(["x"], {"x_pct": 1.5})])
    assert sorted(r.seed.verdict for r in both.results) == ["consistent", "not comparable"]


def test_partial_and_malformed_records_fail(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    partial = evaluate(reg, [record(["x"], {"x_pct": 1.5}, complete=False)])
    res = partial.results[0]
    assert (res.seed.verdict, res.reference.verdict) == ("unmeasured", "invalid")
    assert "partial record" in res.seed.detail
    assert partial.failed()
    no_metric = evaluate(reg, [record(["x"], {"other": 1.5})]).results[0]
    assert no_metric.reference.verdict == "invalid" and "lacks metric 'x_pct'" in no_metric.reference.detail
    assert evaluate(reg, [record(["x"], {"x_pct": True})]).results[0].reference.verdict == "invalid"
    unknown = evaluate(reg, [record(["x", "typo"], {"x_pct": 1.5})])
    assert unknown.failed() and "unknown claim ids ['typo']" in unknown.errors[0]


def test_unmeasured_is_listed_not_failing_unless_strict(tmp_path: Path) -> None:
    evaluation = evaluate(_registry(tmp_path), [])
    assert [(r.seed.verdict, r.reference) for r in evaluation.results] == [("unmeasured", None)]
    assert not evaluation.failed() and evaluation.failed(strict=True)


def test_newest_record_per_conditions_is_judged(tmp_path: Path) -> None:
    reg = _registry(tmp_path, REFERENCE)
    old_bad = record(["x"], {"x_pct": 90.0}, model="standin", hardware="H200", created="2026-01-01T00:00:00+00:00")
    new_good = record(["x"], {"x_pct": 51.0}, model="standin", hardware="H200", created="2026-02-01T00:00:00+00:00")
    assert not evaluate(reg, [new_good, old_bad]).failed()
    old_good = record(["x"], {"x_pct": 51.0}, model="standin", hardware="H200", created="2026-01-01T00:00:00+00:00")
    new_bad = record(["x"], {"x_pct": 90.0}, model="standin", hardware="H200", created="2026-02-01T00:00:00+00:00")
    assert evaluate(reg, [old_good, new_bad]).failed()


def test_span_checks_each_end(tmp_path: Path) -> None:
    text = GOOD.replace('unit = "%"', 'unit = "%"\nkind = "span"\nmetric_high = "x_max"')
    reg = load_registry(_write(tmp_path, text))
    ok = evaluate(reg, [record(["x"], {"x_pct": 1.05, "x_max": 1.95})]).results[0]
    assert ok.seed.verdict == "consistent" and ok.measured == (1.05, 1.95)
    narrow = evaluate(reg, [record(["x"], {"x_pct": 1.5, "x_max": 1.6})]).results[0]
    assert narrow.seed.verdict == "contradicted"  # a single value inside the range is not the published spread


def test_metric_expressions_derive_a_value_from_record_metrics(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, GOOD.replace('metric = "x_pct"', 'metric = "100 * (1 / speedup - 1)"')))
    faster = evaluate(reg, [record(["x"], {"speedup": 100 / 101.5})]).results[0]
    assert faster.measured == pytest.approx(1.5) and faster.seed.verdict == "consistent"
    assert evaluate(reg, [record(["x"], {"speedup": 0.5})]).results[0].seed.verdict == "contradicted"  # +100%
    missing = evaluate(reg, [record(["x"], {"other": 1.0})]).results[0]
    assert missing.reference.verdict == "invalid" and "lacks metric 'speedup'" in missing.reference.detail
    zero = evaluate(reg, [record(["x"], {"speedup": 0.0})]).results[0]
    assert zero.reference.verdict == "invalid" and "divides by zero" in zero.reference.detail


def test_exact_bool_claims(tmp_path: Path) -> None:
    text = GOOD.replace("published = [1.0, 2.0]", 'published = true\nkind = "exact"')
    reg = load_registry(_write(tmp_path, text))

    def seed(value: object) -> str:
        return evaluate(reg, [record(["x"], {"x_pct": value})]).results[0].seed.verdict

    assert seed(True) == "consistent" and seed(False) == "contradicted"
    assert seed(1.0) == "consistent" and seed(0.0) == "contradicted"  # 1 / 0 as bools
    assert evaluate(reg, [record(["x"], {"x_pct": 0.5})]).results[0].reference.verdict == "invalid"


# -- timing drift -----------------------------------------------------------------------------------------

TIMING = """
[[claim]]
id = "lat"
statement = "latency"
quote = "76.49"
published = 76.49
unit = "us"
status = "corrected"
kind = "timing"
samples = "lat_us"
better = "lower"
rel_tolerance = 0.1
seed = "s"
depends = ["hardware"]
metric = "lat_us_median"
test = "reproductions/test_kernel_int4.py::test_kernel_latency"
[[reference]]
model = "standin"
hardware = "H200"
record = "ref-run"
note = "n"
[reference.values]
lat = 100.0
[reference.rel_tolerance]
lat = 0.5
"""


def timing_record(center: float, n: int = 15, seed: int = 0, rid: str | None = None,
                  created: str = "2026-02-01T00:00:00+00:00") -> RunRecord:
    rng = random.Random(seed)
    samples = [center + rng.gauss(0, 0.01 * center) for _ in range(n)]
    rec = record(["lat"], {"lat_us_median": sorted(samples)[n // 2]}, model="standin", hardware="H200",
                 samples={"lat_us": samples}, created=created)
    if rid is not None:
        rec.record_id = rid
    return rec


@pytest.mark.parametrize(("center", "verdict"), [(100.0, "stable"), (104.0, "stable"),
                                                 (130.0, "drifted"), (70.0, "improved")])
def test_timing_drift_is_rank_test_plus_effect_size(tmp_path: Path, center: float, verdict: str) -> None:
    reg = load_registry(_write(tmp_path, SEEDS + TIMING))
    ref = timing_record(100.0, rid="ref-run", created="2026-01-01T00:00:00+00:00")
    evaluation = evaluate(reg, [ref, timing_record(center, seed=1)])
    result = evaluation.results[0]
    assert result.reference.verdict == verdict, result.reference.detail
    assert result.reference.reference_record is ref and result.reference.drift is not None
    assert evaluation.failed() is (verdict == "drifted")  # beyond the effect size: the gate fails
    if center == 104.0:  # significant, but below the 1.10 factor: not drift
        assert result.reference.drift.p_value < 0.002 and result.reference.drift.direction == "same"


def test_timing_with_too_few_samples_is_invalid(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, SEEDS + TIMING))
    ref = timing_record(100.0, rid="ref-run", created="2026-01-01T00:00:00+00:00")
    result = evaluate(reg, [ref, timing_record(130.0, n=5, seed=1)]).results[0]
    assert result.reference.verdict == "invalid" and "needs >= 9 samples" in result.reference.detail


def test_missing_reference_record_is_invalid(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, SEEDS + TIMING))
    result = evaluate(reg, [timing_record(100.0, seed=1)]).results[0]
    assert result.reference.verdict == "invalid"
    assert "reference record 'ref-run' is not among the records" in result.reference.detail


def test_drift_test_direction_for_higher_is_better() -> None:
    policy = DriftPolicy()
    ref = [100.0 + i * 0.1 for i in range(12)]
    slower = [80.0 + i * 0.1 for i in range(12)]
    assert drift_test(ref, slower, "higher", policy).direction == "worse"
    assert drift_test(ref, slower, "lower", policy).direction == "better"
    assert drift_test(ref, ref, "lower", policy).direction == "same"


def test_judge_record_alone_judges_a_portable_claim(registry: Registry) -> None:
    claim = registry.claims["kernel-bandwidth-reduction"]
    good = judge_record(claim, record([claim.id], {claim.metric: 73.4375}, model="any", hardware="cpu"))
    assert good.seed.verdict == "consistent" and not good.failed
    bad = judge_record(claim, record([claim.id], {claim.metric: 75.0}, model="any", hardware="cpu"))
    assert bad.seed.verdict == "contradicted" and bad.failed


def test_not_measurable_claim_with_records_is_an_error(registry: Registry) -> None:
    rec = record(["clutch-sweep-flat-throughput"], {"x": 1.0})
    evaluation = evaluate(registry, [rec])
    assert any("not_measurable" in e for e in evaluation.errors) and evaluation.failed()


# -- sample medians, errata ------------------------------------------------------------------------------


def test_sample_median_metric_reads_raw_samples(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, GOOD.replace('metric = "x_pct"', 'metric = "median:x|m1"')))
    res = evaluate(reg, [record(["x"], {}, samples={"x|m1": [9.0, 1.5, 1.2]})]).results[0]
    assert (res.seed.verdict, res.measured) == ("consistent", 1.5)
    missing = evaluate(reg, [record(["x"], {}, samples={"other": [1.5]})]).results[0]
    assert missing.reference.verdict == "invalid" and "lacks samples 'x|m1'" in missing.reference.detail
    with pytest.raises(RegistryError, match="names no samples key"):
        load_registry(_write(tmp_path, GOOD.replace('metric = "x_pct"', 'metric = "median:"')))


def test_missing_inputs_names_what_a_record_lacks(tmp_path: Path) -> None:
    text = GOOD.replace('metric = "x_pct"', 'metric = "100 * (a / b - 1)"')
    claim = load_registry(_write(tmp_path, text)).claims["x"]
    assert missing_inputs(claim, {"a": 1.0, "b": 2.0}, {}) == []
    assert missing_inputs(claim, {"a": 1.0}, {}) == ["metric 'b'"]
    claim = load_registry(_write(tmp_path, GOOD.replace('metric = "x_pct"', 'metric = "median:s"'))).claims["x"]
    assert missing_inputs(claim, {}, {"s": [1.0]}) == [] and missing_inputs(claim, {}, {}) == ["samples 's'"]


TWO = GOOD + CLAIM.replace('id = "x"', 'id = "y"').replace("x_pct", "y_pct")


def _erratum(body: str) -> str:
    return TWO + f'[[erratum]]\nrecord = "rec-1"\nnote = "0/0 here"\n{body}\n'


def test_erratum_corrects_one_records_declaration(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, _erratum('measures = ["y"]\nunmeasured = ["x"]')))
    rec = record(["x"], {"y_pct": 1.5})
    rec.record_id = "rec-1"
    results = {r.claim.id: r for r in evaluate(reg, [rec]).results}
    assert results["y"].seed.verdict == "consistent" and "read by registry erratum" in results["y"].reference.detail
    assert results["x"].seed.verdict == "unmeasured" and "0/0 here" in results["x"].seed.detail
    other = record(["x"], {"y_pct": 1.5})  # another record: its own declaration stands, it lacks x_pct
    assert evaluate(reg, [other]).results[0].reference.verdict == "invalid"


def test_erratum_that_does_not_match_its_record_fails_the_gate(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, _erratum('measures = ["x"]\nunmeasured = ["y"]')))
    rec = record(["x"], {"x_pct": 1.5})
    rec.record_id = "rec-1"
    evaluation = evaluate(reg, [rec])
    assert evaluation.failed()
    assert any("claim x is already declared" in e for e in evaluation.errors)
    assert any("unmeasured claim y is not declared" in e for e in evaluation.errors)


@pytest.mark.parametrize(("body", "message"), [
    ('measures = ["nope"]', "no claim with id 'nope'"),
    ('measures = ["x"]\nunmeasured = ["x"]', "both measured and unmeasured"),
    ("", "corrects nothing"),
    ('unmeasured = { "x" = "why" }', "unmeasured must be a list of claim ids"),
    ('measures = ["x"]\nrecords = 1', "unknown keys"),
])
def test_erratum_schema(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(RegistryError, match=message):
        load_registry(_write(tmp_path, _erratum(body)))


# -- the quotable summary ----------------------------------------------------------------------------------


def test_summary_counts_each_seed_claim_once(tmp_path: Path) -> None:
    reg = _registry(tmp_path, CLAIM.replace('id = "x"', 'id = "y"').replace("x_pct", "y_pct")
                    + CLAIM.replace('id = "x"', 'id = "z"').replace("x_pct", "z_pct"))
    records = [record(["x"], {"x_pct": 1.5}), record(["x"], {"x_pct": 9.0}, model="standin", hardware="H200"),
               record(["y"], {"y_pct": 1.5}, model="standin", hardware="H200")]
    t = tally(evaluate(reg, records))
    assert (t.total, t.counts) == (3, {"consistent": 1, "contradicted": 0, "not comparable": 1, "unmeasured": 1})
    assert t.differing == {"model": 1, "hardware": 1} and t.unmeasured_why == {"no record yet": 1}
    line = summary(evaluate(reg, records))
    assert line.startswith("Of 3 seed claims, 1 is consistent with the seed's figure and 0 contradicted; "
                           "1 is not comparable here (the model differs for 1; the GPU")
    assert line.endswith("1 is unmeasured (1 no record yet).")


# -- the committed records against the committed registry --------------------------------------------------

TELEMETRY = ROOT / "telemetry"


@pytest.fixture(scope="module")
def committed() -> list[RunRecord]:
    records = load_records(TELEMETRY)
    if not records:
        pytest.skip("no committed records under telemetry/")
    return records


@pytest.fixture(scope="module")
def committed_evaluation(registry: Registry, committed: list[RunRecord]):
    return evaluate(registry, committed)


def test_gate_passes_on_the_committed_records(committed_evaluation) -> None:
    evaluation = committed_evaluation
    assert not evaluation.failed(), [r.summary() for r in evaluation.results if r.failed] + evaluation.errors
    for res in evaluation.results:
        if res.record is not None and not res.claim.portable:
            assert res.reference.verdict in ("stable", "improved"), res.summary()  # every run here has its own
            assert res.seed.verdict == "not comparable", res.summary()  # stand-in / H200 / unnamed seed GPU


@pytest.mark.parametrize("cid", ["gated-tuned-code-throughput", "gated-tuned-code-fallback", "spec-k5-acceptance"])
def test_stand_in_figures_read_not_comparable_vs_the_seed_and_stable_vs_our_reference(committed_evaluation,
                                                                                       cid: str) -> None:
    results = [r for r in committed_evaluation.results if r.claim.id == cid and r.record is not None]
    assert results
    for res in results:
        assert res.seed.verdict == "not comparable" and "model" in res.seed.differs
        assert res.reference.verdict == "stable"


def test_the_summary_of_the_committed_records_never_says_reproduced(committed_evaluation) -> None:
    line = summary(committed_evaluation)
    t = tally(committed_evaluation)
    assert sum(t.counts.values()) == t.total == 72 and t.counts["consistent"] == len(PORTABLE)
    assert f"Of {t.total} seed claims" in line and "reproduced" not in line.lower()


def test_errata_and_references_name_committed_records(registry: Registry, committed: list[RunRecord]) -> None:
    ids = {r.record_id for r in committed}
    assert set(registry.errata) <= ids
    assert {ref.record for ref in registry.references if ref.record} <= ids


def _newest(records: list[RunRecord], suite: str, claim: str | None = None) -> RunRecord:
    """The record the gate judges for a suite (references are pinned from the newest); with `claim`, the newest
    that declares it (a `--variants` decode run declares only what its variants measure)."""
    found = newest_record(records, suite, lambda r: claim is None or claim in r.claim_ids)
    assert found is not None, f"no {suite} record declares {claim}"
    return found


def _planted(original: RunRecord, **changes) -> RunRecord:
    data = original.to_dict()
    data.pop("digest")
    data.update(record_id=original.record_id[:-8] + "deadbeef", created="2027-01-01T00:00:00+00:00", **changes)
    return RunRecord(**data)


def _gate(registry: Registry, committed: list[RunRecord], planted: RunRecord, tmp_path: Path) -> tuple[bool, dict]:
    """(gate failed, results judged on the planted record), the planted record newest of its conditions."""
    write_record(planted, tmp_path)  # through the writer and the loader, as the gate reads it
    evaluation = evaluate(registry, [*committed, *load_records(tmp_path)])
    return evaluation.failed(), {r.claim.id: r for r in evaluation.results
                                 if r.record is not None and r.record.record_id == planted.record_id}


def test_gate_fails_on_a_planted_slower_kernel_record(registry: Registry, committed: list[RunRecord],
                                                      tmp_path: Path) -> None:
    kernel = _newest(committed, "kernel_int4")
    ids = [*kernel.claim_ids, "kernel-latency-us"]  # as the record should have declared
    failed, _ = _gate(registry, committed, _planted(kernel, claim_ids=ids), tmp_path / "same")
    assert not failed  # control: a re-run with the same samples passes
    slower = {k: [1.3 * x for x in v] if k.endswith("|int4") else v for k, v in kernel.samples.items()}
    failed, results = _gate(registry, committed, _planted(kernel, samples=slower, claim_ids=ids), tmp_path)
    assert failed
    for cid in ("kernel-latency", "kernel-latency-us"):
        ref = results[cid].reference
        assert ref.verdict == "drifted", results[cid].summary()
        assert "Mann-Whitney" in ref.detail and ref.drift.direction == "worse"
    assert results["kernel-bandwidth-reduction"].seed.verdict == "consistent"  # byte counts did not change


def test_gate_fails_on_a_planted_slower_decode_record(registry: Registry, committed: list[RunRecord],
                                                      tmp_path: Path) -> None:
    decode = _newest(committed, "decode_standin", claim="spec-k5-speedup")
    erratum = registry.errata.get(decode.record_id)
    ids = [c for c in decode.claim_ids if erratum is None or c not in erratum.unmeasured]
    assert "spec-k5-fidelity" in ids  # the newest decode record measured this engine's identity
    failed, _ = _gate(registry, committed, _planted(decode, claim_ids=ids), tmp_path / "same")
    assert not failed  # control
    metrics = {**decode.metrics, "speedup_max": 0.3, "fixed_k5.code.speedup": 0.3,
               "fidelity_pct": decode.metrics["fidelity_pct"] - 2.0}
    failed, results = _gate(registry, committed, _planted(decode, metrics=metrics, claim_ids=ids), tmp_path)
    assert failed
    speedup = results["spec-k5-speedup"].reference
    assert speedup.verdict == "drifted" and "OUTSIDE band" in speedup.detail
    assert results["spec-k5-fidelity"].reference.verdict == "drifted"
    assert results["e2e-throughput"].reference.verdict == "stable"


def test_the_real_pair_runs_under_the_seeds_prompts_and_model_class():
    """The real pair's record names its prompt file's digest in its config: the registry reads it as the seed's own
    prompt set, so claims whose quality depends on model class and prompts are judged against the seed there."""
    root = Path(__file__).resolve().parents[1]
    registry = load_registry(root / "reproductions" / "claims.toml")
    (rec,) = [r for r in load_records(root / "telemetry") if r.record_id.endswith("2879d290")]
    cond = registry.conditions_of(rec)
    assert (cond.prompts, cond.model_class, cond.hardware) == ("seed", "instruction-tuned chat model", "cpu")
    assert "gear-fidelity-1l-poem" in registry.claim_ids_of(rec)
