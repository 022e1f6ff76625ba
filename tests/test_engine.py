"""The one engine with entropy gating: proof that every clutch decision changes what runs.

- Speculation: scout forward passes == sum of K over speculate cycles (0 when the clutch never engages),
  counted by hooks on the scout, not by the engine; greedy output identical to the plain loop for any
  thresholds.
- Precision: the gear seen by every target forward follows the clutch cycle by cycle, and with real
  GatedLinear layers the INT4 kernel launches follow the gear.
- The decisions are the clutch's, replayed from independently computed target entropies, with no extra
  forward pass and one host read per cycle.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sdsie.decoding.engine as engine
from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding import DecodeConfig, generate
from sdsie.entropy import entropy
from sdsie.models import perturbed_copy, tiny_llama

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, seed=0)
SCOUT = perturbed_copy(TARGET, noise=0.02, seed=1)
PROMPT = [5, 9, 3, 17]
NEVER = ClutchConfig(theta_low=0.0, theta_high=0.0, alpha=1.0)  # entropy is never < 0 bits
ALWAYS = ClutchConfig(theta_low=100.0, theta_high=100.0, alpha=1.0)  # entropy of 64 tokens is <= 6 bits
MIXED = ClutchConfig(theta_low=1.8, theta_high=2.4, alpha=0.5)  # this target's entropies span ~0.3-3.8 bits



@contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


@dataclass
class FakeGear:
    int4: bool = False


def plain(prompt: list[int], max_new: int) -> list[int]:
    return generate(TARGET, prompt, DecodeConfig(max_new_tokens=max_new)).tokens


def gated(config: ClutchConfig, max_new: int = 40, prompt: list[int] = PROMPT, **kwargs):
    with count_forwards(SCOUT) as scout_calls:
        result = generate(
            TARGET, prompt, DecodeConfig(max_new_tokens=max_new), scout=SCOUT, clutch=EntropyClutch(config), **kwargs
        )
    return result, scout_calls[0]


# ------------------------------------------------------------------------------------------------
# Gated speculation


def test_clutch_that_never_engages_runs_no_scout_and_is_the_plain_loop() -> None:
    result, scout_calls = gated(NEVER)
    reference = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=40))
    assert scout_calls == result.stats.scout_forwards == 0
    assert result.tokens == reference.tokens
    assert result.stats.target_forwards == reference.stats.target_forwards == 40
    assert result.decisions == "F" * 39 and all(c.engaged is False for c in result.cycles)
    assert result.stats.fallback_fraction == 1.0 and result.stats.scout_catchup_tokens == 0


def test_clutch_that_always_engages_is_fixed_k_speculation() -> None:
    result, scout_calls = gated(ALWAYS)
    fixed = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=40, k_draft=5), scout=SCOUT)
    assert result.tokens == fixed.tokens == plain(PROMPT, 40)
    assert [c.k for c in result.cycles] == [c.k for c in fixed.cycles]
    assert scout_calls == result.stats.scout_forwards == fixed.stats.scout_forwards
    assert result.stats.target_forwards == fixed.stats.target_forwards


thresholds = st.tuples(st.floats(0.0, 4.0), st.floats(0.0, 4.0)).map(sorted)


@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    band=thresholds,
    alpha=st.floats(0.05, 1.0),
    k=st.integers(1, 8),
    max_new=st.integers(1, 24),
)
def test_gated_speculation_is_lossless_and_scout_work_follows_decisions(
    prompt: list[int], band: list[float], alpha: float, k: int, max_new: int
) -> None:
    config = ClutchConfig(theta_low=band[0], theta_high=band[1], alpha=alpha, k_draft=k)
    result, scout_calls = gated(config, max_new, prompt)
    assert result.tokens == plain(prompt, max_new)
    s = result.stats
    assert scout_calls == s.scout_forwards == sum(c.k for c in result.cycles if c.speculated)
    assert s.target_forwards == s.cycles + 1  # the clutch never costs a forward pass
    produced = 1
    for c in result.cycles:
        assert c.k == (min(k, max_new - produced - 1) if c.engaged else 0)
        produced += c.emitted


def test_decisions_replay_the_one_clutch_on_independent_target_entropies() -> None:
    result, _ = gated(MIXED, max_new=50)
    with torch.no_grad():
        logits = TARGET(input_ids=torch.tensor([PROMPT + result.tokens])).logits[0]  # [S, V], no cache
    bits = entropy(logits[len(PROMPT) - 1 : -1]).tolist()  # the distribution behind each new token
    replay = EntropyClutch(MIXED)
    replay.update(bits[0])  # the prefill's token
    position = 1
    for cycle in result.cycles:
        assert cycle.engaged == replay.engaged
        for h in bits[position : position + cycle.emitted]:
            replay.update(h)
        position += cycle.emitted
        assert cycle.ema == pytest.approx(replay.ema, abs=1e-4)
    assert {c.engaged for c in result.cycles} == {True, False}  # the setting really is mixed


def test_scout_work_rises_monotonically_with_engagement_across_thresholds() -> None:
    rows = []
    for theta in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0):
        result, scout_calls = gated(ClutchConfig(theta_low=theta, theta_high=theta, alpha=1.0), max_new=40)
        speculate = result.stats.speculate_cycles
        rows.append((speculate, scout_calls, result.stats.target_forwards))
        assert result.tokens == plain(PROMPT, 40)
    engagement = [r[0] for r in rows]
    scout_work = [r[1] for r in rows]
    assert engagement == sorted(engagement) and len(set(engagement)) >= 5  # more engagement as theta rises
    assert scout_work == sorted(scout_work) and len(set(scout_work)) >= 5  # ... and more scout work with it
    # K = 5 drafts per speculate cycle (fewer only where the token budget caps them: exact rule tested above)
    assert all(work <= 5 * spec for spec, work, _ in rows)
    assert scout_work[0] == 0 and engagement[0] == 0
    # the seed's flat-throughput symptom is impossible: target passes fall as speculation takes over
    assert rows[-1][2] < rows[0][2]


def test_one_host_read_per_cycle_and_floats_into_the_clutch(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [0]
    real_wait = engine.HostRead.wait

    def counting_wait(self):
        reads[0] += 1
        return real_wait(self)

    monkeypatch.setattr(engine.HostRead, "wait", counting_wait)
    clutch = EntropyClutch(MIXED)
    real_update = clutch.update
    received = []
    monkeypatch.setattr(clutch, "update", lambda h: received.append(h) or real_update(h))
    result = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30), scout=SCOUT, clutch=clutch)
    assert reads[0] == result.stats.cycles + 1  # the prefill's read, then one per cycle
    assert len(received) == len(result.tokens) and all(type(h) is float for h in received)


# ------------------------------------------------------------------------------------------------
# Precision gating


def gear_seen_by_target(model: torch.nn.Module, gear: FakeGear) -> tuple[list[bool], object]:
    seen: list[bool] = []
    handle = model.register_forward_pre_hook(lambda *_: seen.append(gear.int4))
    return seen, handle


def forwards_launching_ahead(result, max_new: int) -> tuple[list[bool], int]:
    """The gears of the target forwards a run launching ahead makes, from its cycles, and the steps it drops. A
    speculate cycle runs one target forward after its drafts. A plain cycle runs the step launched ahead by the cycle
    before if there is one (else launches it now), then launches the next step in its own gear while the budget
    allows two more tokens; that step is dropped if the next cycle speculates or runs in the other gear, or if the
    run ends."""
    seen, dropped, ahead, produced = [result.prefill_gear_int4], 0, None, 1
    for i, cycle in enumerate(result.cycles):
        if ahead is None:
            seen.append(cycle.gear_int4)  # this cycle's target forward, launched now
        ahead = None
        if cycle.k == 0 and produced + 2 <= max_new:
            ahead = cycle.gear_int4
            seen.append(ahead)
        produced += cycle.emitted
        following = result.cycles[i + 1] if i + 1 < len(result.cycles) else None
        if ahead is not None and (following is None or following.k > 0 or following.gear_int4 != ahead):
            dropped, ahead = dropped + 1, None
    return seen, dropped


@pytest.mark.parametrize("int4_when_engaged", [True, False])
@pytest.mark.parametrize("with_scout, ahead", [(True, "off"), (True, "policy"), (True, "always"), (False, "off"),
                                               (False, "policy"), (False, "always")])
def test_gear_follows_the_clutch_before_every_target_forward(int4_when_engaged: bool, with_scout: bool, ahead: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The gear before every target forward is the one its cycle records. Launching ahead only where the read
    cannot flip the clutch ("policy", the engine's) drops no step; launching ahead at every plain step ("always":
    may_flip forced False) drops the steps a flip overtook, and the forwards' gears follow that sequence exactly."""
    if ahead == "always":
        monkeypatch.setattr(EntropyClutch, "may_flip", lambda self, max_bits: False)
    gear = FakeGear()
    seen, handle = gear_seen_by_target(TARGET, gear)
    config = DecodeConfig(max_new_tokens=40, int4_when_engaged=int4_when_engaged, launch_ahead=ahead != "off")
    try:
        result = generate(
            TARGET, PROMPT, config, scout=SCOUT if with_scout else None, clutch=EntropyClutch(MIXED), gear=gear
        )
    finally:
        handle.remove()
    gears = [c.gear_int4 for c in result.cycles]
    if ahead != "always":  # one forward a cycle, in the gear the read before it left; nothing dropped
        assert seen == [result.prefill_gear_int4] + gears and result.stats.ahead_dropped == 0
        assert result.stats.target_forwards == 1 + len(gears)
    else:  # plain steps launched before the read before them, in the clutch's state; dropped where it flipped
        expected, dropped = forwards_launching_ahead(result, 40)
        assert seen == expected and result.stats.ahead_dropped == dropped > 0
        assert result.stats.target_forwards == 1 + len(gears) + dropped
    assert result.prefill_gear_int4 == (MIXED.initial_engaged == int4_when_engaged)
    assert all(c.gear_int4 == (c.engaged == int4_when_engaged) for c in result.cycles)
    assert set(seen) == {True, False}
    assert result.tokens == plain(PROMPT, 40)  # a fake gear changes no arithmetic: still lossless
    if not with_scout:
        assert result.stats.scout_forwards == 0 and result.decisions == "F" * result.stats.cycles


@pytest.mark.parametrize("pinned", [NEVER, ALWAYS], ids=["released", "engaged"])
def test_a_clutch_that_cannot_flip_launches_every_step_ahead_as_the_plain_loop_does(pinned: ClutchConfig,
                                                                                      monkeypatch) -> None:
    """Pinned by its thresholds (no entropy of a 64-token vocabulary crosses them), the clutch cannot flip at any
    read, so a gear-only run launches each step before the previous read, as the plain loop does: forward, forward,
    read, forward, read, ..., read."""
    events: list[str] = []
    real_forward, real_wait = engine.forward, engine.HostRead.wait
    monkeypatch.setattr(engine, "forward", lambda *a, **kw: events.append("F") or real_forward(*a, **kw))
    monkeypatch.setattr(engine.HostRead, "wait", lambda self: events.append("R") or real_wait(self))
    result = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=6), clutch=EntropyClutch(pinned), gear=FakeGear())
    assert "".join(events) == "FR" + "FFR" + "FR" * 3 + "R"
    assert (result.stats.ahead_launched, result.stats.ahead_dropped) == (result.stats.cycles - 1, 0)
    assert result.tokens == plain(PROMPT, 6)


@given(low=st.floats(0, 8), band=st.floats(0, 4), alpha=st.floats(0.01, 1.0), engaged=st.booleans(),
       ema=st.one_of(st.none(), st.floats(0, 10)), max_bits=st.floats(0, 8))
def test_may_flip_is_whether_some_entropy_up_to_max_bits_flips_the_next_update(low, band, alpha, engaged, ema,
                                                                                max_bits) -> None:
    """Against brute force over entropies in [0, max_bits], both ends included: the EMA grows with the entropy."""
    config = ClutchConfig(theta_low=low, theta_high=low + band, alpha=alpha)
    grid = [max_bits * i / 64 for i in range(65)]

    def flips(h: float) -> bool:
        c = EntropyClutch(config)
        c.engaged, c.ema = engaged, ema
        return c.update(h) != engaged

    c = EntropyClutch(config)
    c.engaged, c.ema = engaged, ema
    assert c.may_flip(max_bits) == any(flips(h) for h in grid)


def test_int4_kernel_launches_track_the_gear_cycle_by_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    import sdsie.kernels
    from sdsie.quant.gated import gate_model

    model = copy.deepcopy(TARGET)
    gear = gate_model(model, ["q_proj", "down_proj"], layers=[0])  # 2 gated linears
    launches = [0]
    real_kernel = sdsie.kernels.int4_matmul

    def counting_kernel(x: torch.Tensor, w: object) -> torch.Tensor:
        launches[0] += 1
        return real_kernel(x, w)

    monkeypatch.setattr(sdsie.kernels, "int4_matmul", counting_kernel)
    per_cycle: list[tuple[int, int, int]] = []
    snapshot = lambda _record: per_cycle.append((launches[0], gear.int4_calls, gear.full_calls))  # noqa: E731
    result = generate(
        model,
        PROMPT,
        DecodeConfig(max_new_tokens=16, launch_ahead=False),  # each target forward its cycle's (no step ahead)
        scout=SCOUT,
        clutch=EntropyClutch(MIXED),
        gear=gear,
        on_cycle=snapshot,
    )
    before = (2, 2, 0) if result.prefill_gear_int4 else (0, 0, 2)
    for cycle, after in zip(result.cycles, per_cycle, strict=True):
        delta = tuple(a - b for a, b in zip(after, before, strict=True))
        assert delta == ((2, 2, 0) if cycle.gear_int4 else (0, 0, 2))  # one target forward, 2 gated layers
        before = after
    assert {c.gear_int4 for c in result.cycles} == {True, False}


GATED = copy.deepcopy(TARGET)
GATED_GEAR = None  # gate_model's GearState for GATED, made on first use


def _reference_int4(x: torch.Tensor, w: object, *args: object, **kwargs: object) -> torch.Tensor:
    from sdsie.kernels import int4_matmul_reference

    return int4_matmul_reference(x, w).to(x.dtype)


@given(theta=st.sampled_from([(1.8, 2.4), (1.0, 1.5), (2.5, 3.0)]), alpha=st.sampled_from([0.3, 0.5, 1.0]),
       max_new=st.integers(2, 24), eos=st.sampled_from([None, 3, 11]),
       scout_gear=st.sampled_from([(True, True), (True, False), (False, True)]), always=st.booleans())
def test_launching_ahead_with_real_gated_layers_decodes_what_launching_after_the_read_does(theta, alpha, max_new,
                                                                                            eos, scout_gear,
                                                                                            always) -> None:
    """The gears compute differently (INT4 weights against fp32), so a step kept in the wrong gear (or kept where
    the clutch resumed speculation) would change the logits or the cycles: the same tokens, entropies, decisions,
    gears and stop with and without launch-ahead, and a forward more per dropped step. `always` launches a step
    ahead at every plain step (may_flip forced False), so flips drop steps: the drop, not the engine's caution, is
    what keeps the output. The INT4 layers run the kernel's float64 reference (the kernel has its own tests; the
    interpreter would take seconds a step)."""
    import sdsie.kernels
    from sdsie.quant.gated import gate_model

    global GATED_GEAR
    if GATED_GEAR is None:
        GATED_GEAR = gate_model(GATED, ["down_proj", "lm_head"])
    with_scout, with_gear = scout_gear
    GATED_GEAR.int4 = False  # a run without the gear decodes at full precision
    clutch = ClutchConfig(theta_low=theta[0], theta_high=theta[1], alpha=alpha)
    runs = {}
    saved, saved_may_flip = sdsie.kernels.int4_matmul, EntropyClutch.may_flip
    sdsie.kernels.int4_matmul = _reference_int4
    if always:
        EntropyClutch.may_flip = lambda self, max_bits: False
    try:
        for ahead in (False, True):
            config = DecodeConfig(max_new_tokens=max_new, eos_token_id=eos, launch_ahead=ahead)
            runs[ahead] = generate(GATED, PROMPT, config, scout=SCOUT if with_scout else None,
                                   clutch=EntropyClutch(clutch), gear=GATED_GEAR if with_gear else None)
    finally:
        sdsie.kernels.int4_matmul, EntropyClutch.may_flip = saved, saved_may_flip
    after, ahead = runs[False], runs[True]
    assert ahead.tokens == after.tokens and ahead.stop_reason == after.stop_reason
    assert [(c.k, c.accepted, c.gear_int4, c.entropy, c.ema) for c in ahead.cycles] == [
        (c.k, c.accepted, c.gear_int4, c.entropy, c.ema) for c in after.cycles]
    assert ahead.stats.target_forwards == after.stats.target_forwards + ahead.stats.ahead_dropped


# ------------------------------------------------------------------------------------------------
# State and bad setups


def test_clutch_state_is_reset_per_run() -> None:
    clutch = EntropyClutch(MIXED)
    first = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30), scout=SCOUT, clutch=clutch)
    second = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=30), scout=SCOUT, clutch=clutch)
    assert first.decisions == second.decisions and clutch.steps == len(second.tokens)
    assert clutch.ema == pytest.approx(second.cycles[-1].ema)


def test_seeded_gated_sampling_is_reproducible() -> None:
    from sdsie.decoding import SamplingConfig

    config = DecodeConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0, top_k=8, seed=3))
    runs = [generate(TARGET, PROMPT, config, scout=SCOUT, clutch=EntropyClutch(MIXED)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].decisions == runs[1].decisions


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gear": FakeGear()}, "gear needs a clutch"),
        ({"clutch": EntropyClutch(MIXED)}, "gate nothing"),
        ({"clutch": EntropyClutch(MIXED), "gear": object()}, "bool attribute 'int4'"),
        ({"scout": SCOUT, "clutch": EntropyClutch(MIXED), "config": DecodeConfig(k_draft=3)}, "K is ambiguous"),
        ({"scout": tiny_llama(vocab_size=32), "clutch": EntropyClutch(MIXED)}, "vocabulary mismatch"),
    ],
)
def test_bad_setups_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(TARGET, PROMPT, **kwargs)


def test_the_adaptive_schedule_carries_its_draft_length_over_fallback_stretches() -> None:
    """Gated and adaptive: lossless, and each speculate cycle drafts what the previous speculate cycle left, however
    many plain steps lie between them."""
    config = DecodeConfig(max_new_tokens=48, k_schedule="adaptive")
    plain = generate(TARGET, PROMPT, DecodeConfig(max_new_tokens=48)).tokens
    result = generate(TARGET, PROMPT, config, scout=SCOUT, clutch=EntropyClutch(MIXED))
    assert result.tokens == plain
    spec = [c for c in result.cycles if c.speculated]
    assert "SF" in result.decisions and "FS" in result.decisions  # speculation resumes after fallback stretches
    expected, produced = MIXED.k_draft, 1
    for c in result.cycles:
        if c.speculated:
            assert c.k == min(expected, 48 - produced - 1)
            expected = engine.next_draft_length(expected, c.k, c.accepted, MIXED.k_draft)
        produced += c.emitted
    assert len({c.k for c in spec}) > 1  # the schedule moved
