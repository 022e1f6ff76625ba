"""GPU reproduction of the entropy-gated speculation claims on the stand-in pair.

test_gated_tuned and test_gated_production read the decode-suite record that
`reproductions.decode_repro.gpu_decode_record` runs once per process (shared with
test_speculative_gpu.py); test_threshold_grid runs the seed's 6 x 3 threshold grid and writes its own
record. A test fails when its suite cannot run or the record cannot be judged for the claims the test
serves; whether the numbers hold is the claims gate's verdict (`sdsie claims check`).
"""

from __future__ import annotations

import pytest

from reproductions.decode_repro import (
    DECODE_TESTS,
    GRID_TESTS,
    assert_serves,
    gpu_decode_record,
    gpu_setup,
    grid_record,
    node_claims,
)
from sdsie.telemetry.records import write_record

NODE = "reproductions/test_gated_gpu.py::{}"
FAMILIES = ("code", "poem", "physics")


@pytest.mark.gpu
@pytest.mark.benchmark
def test_gated_tuned():
    rec = gpu_decode_record()
    kinds = ["throughput", "fallback"] + (["energy"] if rec.config.get("idle_power_w") is not None else [])
    required = [f"gated-tuned-{f}-{k}" for f in FAMILIES for k in kinds]  # acceptance: only if it speculated
    assert_serves(rec, DECODE_TESTS, NODE.format("test_gated_tuned"), required)
    runs = rec.conditions["trials"] * len(rec.environment["prompts"])
    tuned = [k for k in rec.config["decisions"] if k.startswith("gated_tuned|")]
    assert len(tuned) == runs, f"decision sequences recorded for {len(tuned)} of {runs} tuned runs"


@pytest.mark.gpu
@pytest.mark.benchmark
def test_gated_production():
    rec = gpu_decode_record()
    required = ["gated-production-poem-throughput", "gated-production-physics-throughput"]
    assert_serves(rec, DECODE_TESTS, NODE.format("test_gated_production"), required)


@pytest.mark.gpu
@pytest.mark.benchmark
def test_threshold_grid():
    rec = grid_record(gpu_setup())
    print("record:", write_record(rec, "telemetry"))
    node = NODE.format("test_threshold_grid")
    assert_serves(rec, GRID_TESTS, node, node_claims(node))


# -- CPU: the decode suite's derived numbers and claim declaration ----------------------------------------


def _run(variant: str, family: str, tokens_per_s: float, speculate_cycles: int, trial: int = 0):
    from reproductions.decode_repro import Run

    return Run(variant, family, trial, [0] * 10, 10 / tokens_per_s, None, {"speculate_cycles": speculate_cycles})


def test_zero_engagement_deficit_spans_the_cells_that_never_speculated():
    from reproductions.decode_repro import zero_engagement_deficit

    runs = [_run("gated_tuned", "code", 90.0, 0, t) for t in range(2)]
    runs += [_run("gated_production", "code", 95.0, 0), _run("gated_tuned", "verse", 50.0, 0),
             _run("gated_tuned", "verse", 50.0, 1, trial=1)]  # speculated once: not a zero-engagement cell
    m = {"gated_tuned.code.speedup": 0.90, "gated_production.code.speedup": 0.95, "gated_tuned.poem.speedup": 0.5}
    got = zero_engagement_deficit(runs, m)
    assert got["zero_engagement_deficit_pct_min"] == pytest.approx(5.0)
    assert got["zero_engagement_deficit_pct_max"] == pytest.approx(10.0)
    assert got["zero_engagement_cells"] == 2.0
    assert zero_engagement_deficit([_run("gated_tuned", "code", 90.0, 3)], m) == {}


def test_records_declare_only_claims_whose_inputs_they_hold(capsys):
    from reproductions.decode_repro import DECODE_ALSO, declared_claims

    metrics = {"speedup_max": 0.9, "decisions_identical_across_trials": 1.0, "tuned.code.fallback_pct": 100.0}
    ids = declared_claims(DECODE_TESTS, metrics, {}, DECODE_ALSO)
    assert ids == ["spec-k5-speedup", "gated-tuned-code-fallback", "gated-decisions-bit-identical"]
    out = capsys.readouterr().out
    assert "not measured by this run: gated-tuned-code-acceptance (lacks metric 'tuned.code.acceptance_pct')" in out
