"""The threshold sweep API: grid, interleaving, JSON results, and outputs that show the gate acting."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

import sdsie.decoding.sweeps as sweep_module
from sdsie.clutch import PRODUCTION, TUNED, ClutchConfig
from sdsie.decoding import DecodeConfig, SweepResult, clutch_grid, sweep
from sdsie.models import perturbed_copy, tiny_llama

TARGET = tiny_llama(vocab_size=64, seed=0)
SCOUT = perturbed_copy(TARGET, noise=0.02, seed=1)
PROMPTS = [[5, 9, 3, 17], [40, 2, 2]]
NEVER = ClutchConfig(theta_low=0.0, theta_high=0.0, alpha=1.0)
MIXED = ClutchConfig(theta_low=1.8, theta_high=2.4, alpha=0.5)
ALWAYS = ClutchConfig(theta_low=100.0, theta_high=100.0, alpha=1.0)
CONFIG = DecodeConfig(max_new_tokens=20)



@pytest.fixture(scope="module")
def result() -> SweepResult:
    return sweep(TARGET, SCOUT, PROMPTS, [NEVER, MIXED, ALWAYS], trials=2, config=CONFIG, warmup=0)


def test_entries_and_runs(result: SweepResult) -> None:
    labels = [e.label for e in result.entries]
    assert labels[:2] == ["plain", "fixed-K5"] and len(labels) == 5
    assert all(len(e.runs) == len(PROMPTS) * 2 for e in result.entries)
    assert all(
        sorted((r.prompt_index, r.trial) for r in e.runs) == [(0, 0), (0, 1), (1, 0), (1, 1)] for e in result.entries
    )
    for e in result.entries:
        for r in e.runs:
            assert len(r.decisions) == r.cycles and r.new_tokens == len(r.tokens) == 20
            assert r.fallback_fraction == pytest.approx(r.decisions.count("F") / r.cycles)
            assert r.tokens_per_s > 0


def test_greedy_outputs_agree_while_scout_work_differs(result: SweepResult) -> None:
    assert result.outputs_identical()
    never, mixed, always = result.entries[2:]
    assert never.scout_forwards == 0 and never.fallback_fraction == 1.0 and never.acceptance_rate is None
    assert always.scout_forwards == result.entry("fixed-K5").scout_forwards > mixed.scout_forwards > 0
    assert 0.0 < mixed.fallback_fraction < 1.0
    assert always.fallback_fraction == result.entry("fixed-K5").fallback_fraction
    assert result.entry("plain").scout_forwards == 0
    runs = [r for e in result.entries for r in e.runs]
    assert {r.decisions for r in runs if r.prompt_index == 0} != {runs[0].decisions}  # not one flat sequence


def test_acceptance_is_pooled_over_drafted_tokens(result: SweepResult) -> None:
    mixed = result.entries[3]
    assert mixed.acceptance_rate == sum(r.accepted for r in mixed.runs) / sum(r.drafted for r in mixed.runs)


def test_result_is_json_serialisable(result: SweepResult) -> None:
    data = json.loads(result.to_json())
    assert data["prompts"] == 2 and data["trials"] == 2
    assert data["decode_config"]["max_new_tokens"] == 20
    gated = data["entries"][3]
    assert gated["clutch"]["theta_low"] == 1.8 and gated["clutch"]["alpha"] == 0.5
    assert gated["runs"][0]["decisions"] == result.entries[3].runs[0].decisions
    assert gated["tokens_per_s"] == pytest.approx(result.entries[3].tokens_per_s)


def test_runs_are_interleaved_trial_then_prompt_then_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    order = []
    real = sweep_module.generate

    def recording(target, prompt, config, scout=None, clutch=None, gear=None):
        order.append((list(prompt), None if clutch is None else clutch.config.theta_low, scout is not None))
        return real(target, prompt, config, scout=scout, clutch=clutch, gear=gear)

    monkeypatch.setattr(sweep_module, "generate", recording)
    sweep(TARGET, SCOUT, PROMPTS, [NEVER, MIXED], trials=2, config=DecodeConfig(max_new_tokens=3), warmup=1)
    plan = [(None, False), (None, True), (0.0, True), (1.8, True)]
    warmups = [(prompt, *p) for prompt in PROMPTS for p in plan]  # every prompt warmed up, untimed
    timed = [(prompt, *p) for _trial in range(2) for prompt in PROMPTS for p in plan]
    assert order == warmups + timed


@dataclass
class FakeGear:
    int4: bool = True


def test_baselines_run_at_full_precision_with_a_gear() -> None:
    gear = FakeGear(int4=True)
    seen: list[bool] = []
    handle = TARGET.register_forward_pre_hook(lambda *_: seen.append(gear.int4))
    try:
        out = sweep(TARGET, SCOUT, PROMPTS[:1], [], config=DecodeConfig(max_new_tokens=4), gear=gear, warmup=0)
    finally:
        handle.remove()
    assert [e.label for e in out.entries] == ["plain", "fixed-K5"]
    assert seen and not any(seen)


def test_gated_runs_drive_the_gear() -> None:
    gear = FakeGear(int4=False)
    seen: list[bool] = []
    handle = TARGET.register_forward_pre_hook(lambda *_: seen.append(gear.int4))
    try:
        sweep(TARGET, SCOUT, PROMPTS[:1], [MIXED], config=CONFIG, gear=gear, baselines=False, warmup=0)
    finally:
        handle.remove()
    assert set(seen) == {True, False}


def test_clutch_grid() -> None:
    grid = clutch_grid([0.15, 0.55], [0.70, 1.25], [0.35, 0.65], k_draft=4)
    assert len(grid) == 8 and all(c.k_draft == 4 for c in grid)
    assert ClutchConfig(0.55, 1.25, 0.35, k_draft=4) in grid
    with pytest.raises(ValueError, match="theta_low"):
        clutch_grid([0.15, 0.9], [0.70], [0.5])
    assert len(clutch_grid([0.15, 0.9], [0.70], [0.5], drop_invalid=True)) == 1
    with pytest.raises(ValueError, match="empty grid"):
        clutch_grid([0.9], [0.7], [0.5], drop_invalid=True)


def test_seed_settings_run_by_name() -> None:
    out = sweep(
        TARGET,
        SCOUT,
        PROMPTS[:1],
        [PRODUCTION, TUNED],
        config=DecodeConfig(max_new_tokens=6),
        baselines=False,
        warmup=0,
    )
    assert [e.clutch["theta_low"] for e in out.entries] == [0.55, 0.15]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompts": []}, "at least one prompt"),
        ({"trials": 0}, "trials"),
        ({"clutches": [], "baselines": False}, "at least one clutch"),
        ({"clutches": [ClutchConfig(k_draft=3)]}, "K=5"),
        ({"clutches": [MIXED, MIXED]}, "duplicate"),
    ],
)
def test_bad_sweeps_are_refused(kwargs: dict, match: str) -> None:
    args = {"prompts": PROMPTS, "clutches": [MIXED], "config": CONFIG, **kwargs}
    with pytest.raises(ValueError, match=match):
        sweep(TARGET, SCOUT, **args)
