"""Properties of the one entropy clutch (sdsie.clutch): a Schmitt trigger over an EMA of entropy.

The reference below is written independently of the implementation: a region classifier and a transition
table. Only the EMA recursion is shared (it is the documented convention), evaluated in the same order so
that the floats, and therefore the decisions at a threshold, agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdsie.clutch import PRODUCTION, TUNED, ClutchConfig, EntropyClutch

# --- the reference state machine ------------------------------------------------------------------------

LOW, BAND, HIGH = "low", "band", "high"
NEXT_STATE = {  # (region of the EMA, previous state) -> new state; True = engaged
    (LOW, False): True,
    (LOW, True): True,
    (BAND, False): False,
    (BAND, True): True,
    (HIGH, False): False,
    (HIGH, True): False,
}


def region(ema: float, theta_low: float, theta_high: float) -> str:
    if ema < theta_low:
        return LOW
    return HIGH if ema > theta_high else BAND


@dataclass
class Step:
    ema: float
    region: str
    engaged: bool


def reference_run(cfg: ClutchConfig, entropies: list[float]) -> list[Step]:
    """ema_0 = H_0 (or blends into initial_ema), ema_t = alpha * H_t + (1 - alpha) * ema_{t-1}."""
    steps: list[Step] = []
    ema, engaged = cfg.initial_ema, cfg.initial_engaged
    for h in entropies:
        ema = h if ema is None else cfg.alpha * h + (1.0 - cfg.alpha) * ema
        where = region(ema, cfg.theta_low, cfg.theta_high)
        engaged = NEXT_STATE[(where, engaged)]
        steps.append(Step(ema, where, engaged))
    return steps


def static_gate(entropies: list[float], threshold: float) -> list[bool]:
    """A single fixed threshold on the raw entropy, no memory: the negative control."""
    return [h < threshold for h in entropies]


def count_flips(states: list[bool], initial: bool) -> int:
    return sum(a != b for a, b in zip([initial, *states], states, strict=False))


# --- strategies -----------------------------------------------------------------------------------------

bits = st.floats(0.0, 20.0)
# Mostly alphas that let the EMA move within a few steps, sometimes any alpha in (0, 1] (tiny ones included).
alphas = st.one_of(st.floats(0.05, 1.0), st.just(1.0), st.floats(0.0, 1.0, exclude_min=True))


@st.composite
def configs(draw: st.DrawFn, alpha: st.SearchStrategy[float] = alphas) -> ClutchConfig:
    low = draw(st.floats(0.0, 12.0))
    width = draw(st.one_of(st.floats(0.05, 6.0), st.floats(0.05, 6.0), st.just(0.0)))  # 0: no band at all
    return ClutchConfig(
        theta_low=low,
        theta_high=low + width,
        alpha=draw(alpha),
        k_draft=draw(st.integers(1, 16)),
        initial_engaged=draw(st.booleans()),
        initial_ema=draw(st.one_of(st.none(), bits)),
    )


@st.composite
def config_and_entropies(draw: st.DrawFn, alpha: st.SearchStrategy[float] = alphas) -> tuple[ClutchConfig, list[float]]:
    """A config and a sequence of runs below, inside and above its band (and anywhere, and exactly on a
    threshold), so the EMA crosses in both directions and dwells in the band in both states."""
    cfg = draw(configs(alpha))
    lo, hi = cfg.theta_low, cfg.theta_high
    regions = [
        st.floats(0.0, lo),
        st.floats(lo, hi),
        st.floats(hi, hi + 3.0),
        bits,
        st.sampled_from([lo, hi]),
    ]
    runs = draw(
        st.lists(
            st.sampled_from(regions).flatmap(lambda r: st.lists(r, min_size=1, max_size=15)), min_size=1, max_size=10
        )
    )
    return cfg, [h for run_ in runs for h in run_]


def run(cfg: ClutchConfig, entropies: list[float]) -> tuple[EntropyClutch, list[bool], list[float]]:
    clutch = EntropyClutch(cfg)
    states, emas = [], []
    for h in entropies:
        states.append(clutch.update(h))
        emas.append(clutch.ema)
    return clutch, states, emas


# --- hysteresis -----------------------------------------------------------------------------------------


@given(config_and_entropies())
def test_state_changes_only_at_a_crossing_in_the_right_direction(case: tuple[ClutchConfig, list[float]]) -> None:
    cfg, entropies = case
    _, states, emas = run(cfg, entropies)
    previous = [cfg.initial_engaged, *states[:-1]]
    for before, after, ema in zip(previous, states, emas, strict=True):
        if after and not before:
            assert ema < cfg.theta_low, f"engaged at ema={ema} >= theta_low={cfg.theta_low}"
        if before and not after:
            assert ema > cfg.theta_high, f"released at ema={ema} <= theta_high={cfg.theta_high}"
        # ... and a crossing always acts: outside the band the state is the band's side.
        if ema < cfg.theta_low:
            assert after
        if ema > cfg.theta_high:
            assert not after


@given(config_and_entropies())
def test_inside_the_band_the_state_never_changes(case: tuple[ClutchConfig, list[float]]) -> None:
    cfg, entropies = case
    _, states, emas = run(cfg, entropies)
    previous = [cfg.initial_engaged, *states[:-1]]
    for before, after, ema in zip(previous, states, emas, strict=True):
        if cfg.theta_low <= ema <= cfg.theta_high:
            assert after == before


@given(config_and_entropies(alpha=st.just(1.0)))
def test_alpha_one_makes_the_ema_the_input(case: tuple[ClutchConfig, list[float]]) -> None:
    cfg, entropies = case
    _, _, emas = run(cfg, entropies)
    assert emas == entropies


@given(config_and_entropies())
def test_ema_follows_the_documented_convention(case: tuple[ClutchConfig, list[float]]) -> None:
    cfg, entropies = case
    _, _, emas = run(cfg, entropies)
    a = cfg.alpha
    first = entropies[0] if cfg.initial_ema is None else a * entropies[0] + (1 - a) * cfg.initial_ema
    assert emas[0] == first
    for t in range(1, len(entropies)):
        assert emas[t] == a * entropies[t] + (1 - a) * emas[t - 1]
    # Unrolled: ema_T = sum_t a (1 - a)^(T - t) H_t + (1 - a)^T ema_0 (float64 up to rounding).
    t_last = len(entropies) - 1
    unrolled = (1 - a) ** t_last * first + sum(a * (1 - a) ** (t_last - t) * entropies[t] for t in range(1, t_last + 1))
    assert emas[-1] == pytest.approx(unrolled, rel=1e-9, abs=1e-9)


@given(
    low=st.floats(0.05, 10.0),
    width=st.floats(0.05, 5.0),
    alpha=alphas,
    initial_engaged=st.booleans(),
    n=st.integers(20, 200),
)
def test_in_band_oscillation_flips_a_static_gate_every_step_and_the_clutch_never(
    low: float, width: float, alpha: float, initial_engaged: bool, n: int
) -> None:
    high = low + width
    mid = (low + high) / 2
    oscillation = [mid + (0.4 if t % 2 else -0.4) * width for t in range(n)]  # strictly inside the band
    cfg = ClutchConfig(theta_low=low, theta_high=high, alpha=alpha, initial_engaged=initial_engaged)
    clutch, states, emas = run(cfg, oscillation)
    assert all(low <= ema <= high for ema in emas)  # a convex mix of in-band values stays in band
    assert clutch.flips == 0 and states == [initial_engaged] * n
    static = static_gate(oscillation, mid)
    assert count_flips(static, initial_engaged) >= n - 1  # the negative control chatters on every step
    # The same clutch with its band collapsed to one threshold chatters too: the band is what holds it.
    collapsed = ClutchConfig(theta_low=mid, theta_high=mid, alpha=1.0, initial_engaged=initial_engaged)
    single, _, _ = run(collapsed, oscillation)
    assert single.flips >= n - 1


def test_remembers_which_side_it_came_from() -> None:
    cfg = ClutchConfig(theta_low=1.0, theta_high=2.0, alpha=1.0)
    _, from_low, _ = run(cfg, [0.5, 1.5, 1.5, 1.9])
    _, from_high, _ = run(cfg, [2.5, 1.5, 1.5, 1.1])
    assert from_low == [True] * 4
    assert from_high == [False] * 4


def test_thresholds_are_strict() -> None:
    cfg = ClutchConfig(theta_low=1.0, theta_high=2.0, alpha=1.0)
    _, states, _ = run(cfg, [1.0, 0.999, 2.0, 2.001])  # equal to a threshold is inside the band
    assert states == [False, True, True, False]


# --- agreement with the reference -----------------------------------------------------------------------


@given(config_and_entropies())
def test_agrees_step_by_step_with_the_reference(case: tuple[ClutchConfig, list[float]]) -> None:
    cfg, entropies = case
    clutch = EntropyClutch(cfg)
    expected = reference_run(cfg, entropies)
    for t, (h, ref) in enumerate(zip(entropies, expected, strict=True)):
        assert clutch.update(h) == ref.engaged, f"step {t}: h={h}, ema={ref.ema} ({ref.region})"
        assert clutch.engaged == ref.engaged
        assert clutch.ema == ref.ema
        assert clutch.steps == t + 1
        assert clutch.k == (cfg.k_draft if ref.engaged else 0)
    assert clutch.flips == count_flips([s.engaged for s in expected], cfg.initial_engaged)


@given(config_and_entropies())
def test_reset_restores_the_initial_state(case: tuple[ClutchConfig, list[float]]) -> None:
    cfg, entropies = case
    clutch, first, _ = run(cfg, entropies)
    clutch.reset()
    assert (clutch.engaged, clutch.ema, clutch.steps, clutch.flips) == (cfg.initial_engaged, cfg.initial_ema, 0, 0)
    assert [clutch.update(h) for h in entropies] == first


# --- configuration --------------------------------------------------------------------------------------


@pytest.mark.parametrize("initial_engaged", [False, True])
def test_initial_state_is_configurable_and_held_in_band(initial_engaged: bool) -> None:
    cfg = ClutchConfig(theta_low=1.0, theta_high=2.0, alpha=0.5, k_draft=7, initial_engaged=initial_engaged)
    clutch = EntropyClutch(cfg)
    assert clutch.engaged is initial_engaged and clutch.ema is None and clutch.k == (7 if initial_engaged else 0)
    assert clutch.update(1.5) is initial_engaged


def test_default_is_disengaged() -> None:
    assert EntropyClutch().engaged is False and EntropyClutch().k == 0


def test_initial_ema_is_the_value_before_the_first_step() -> None:
    clutch = EntropyClutch(ClutchConfig(theta_low=1.0, theta_high=2.0, alpha=0.25, initial_ema=0.0))
    assert clutch.update(3.0) is True  # 0.25 * 3 + 0.75 * 0 = 0.75 < theta_low
    assert clutch.ema == 0.75


def test_published_settings_are_the_seeds() -> None:
    # The seed README: production defaults theta 0.55/1.25, alpha 0.35; tuned 0.15/0.70, alpha 0.65; K = 5.
    assert (PRODUCTION.theta_low, PRODUCTION.theta_high, PRODUCTION.alpha, PRODUCTION.k_draft) == (0.55, 1.25, 0.35, 5)
    assert (TUNED.theta_low, TUNED.theta_high, TUNED.alpha, TUNED.k_draft) == (0.15, 0.70, 0.65, 5)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"theta_low": 2.0, "theta_high": 1.0}, "theta_low"),
        ({"theta_low": math.nan}, "theta_low"),
        ({"theta_low": -0.1}, "theta_low"),
        ({"theta_low": math.inf, "theta_high": math.inf}, "theta_low"),
        ({"theta_low": True}, "theta_low"),
        ({"theta_low": "0.1"}, "theta_low"),
        ({"theta_high": math.nan}, "theta_high"),
        ({"theta_high": -1.0}, "theta_high"),
        ({"theta_high": math.inf}, "theta_high"),
        ({"theta_high": None}, "theta_high"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -0.5}, "alpha"),
        ({"alpha": 1.0001}, "alpha"),
        ({"alpha": math.nan}, "alpha"),
        ({"alpha": math.inf}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"alpha": "0.5"}, "alpha"),
        ({"k_draft": 0}, "k_draft"),
        ({"k_draft": -3}, "k_draft"),
        ({"k_draft": 2.5}, "k_draft"),
        ({"k_draft": True}, "k_draft"),
        ({"initial_ema": math.nan}, "initial_ema"),
        ({"initial_ema": -1.0}, "initial_ema"),
        ({"initial_ema": math.inf}, "initial_ema"),
        ({"initial_engaged": 1}, "initial_engaged"),
        ({"initial_engaged": "yes"}, "initial_engaged"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_invalid_configuration_names_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ClutchConfig(**kwargs)  # type: ignore[arg-type]


@given(low=bits, width=st.floats(0.0, 5.0), alpha=alphas)
def test_valid_configurations_are_accepted(low: float, width: float, alpha: float) -> None:
    cfg = ClutchConfig(theta_low=low, theta_high=low + width, alpha=alpha)
    assert cfg.theta_low <= cfg.theta_high


# --- inputs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@given(case=config_and_entropies())
def test_zero_dim_tensors_decide_like_their_float_value(
    dtype: torch.dtype, case: tuple[ClutchConfig, list[float]]
) -> None:
    cfg, entropies = case
    tensors = [torch.tensor(h, dtype=dtype) for h in entropies]  # [] each
    _, from_tensors, _ = run(cfg, tensors)  # type: ignore[arg-type]
    _, from_floats, _ = run(cfg, [float(t) for t in tensors])
    assert from_tensors == from_floats


def test_python_ints_are_accepted() -> None:
    assert EntropyClutch(ClutchConfig(theta_low=1.0, theta_high=2.0, alpha=1.0)).update(0) is True


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (math.nan, "NaN"),
        (torch.tensor(math.nan), "NaN"),
        (torch.tensor(math.nan, dtype=torch.bfloat16), "NaN"),
        (-0.5, ">= 0"),
        (torch.tensor(-1e-3), ">= 0"),
        (math.inf, "finite"),
        (torch.tensor([0.5]), "0-d"),
        (torch.tensor([0.5, 0.7]), "0-d"),
        (torch.zeros(1, 1), "0-d"),
        (torch.zeros(0), "0-d"),
        (True, "float"),
        (torch.tensor(True), "dtype"),
        ("0.5", "float"),
        (None, "float"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else None,
)
def test_invalid_entropy_is_refused_and_changes_nothing(value: object, match: str) -> None:
    clutch = EntropyClutch(ClutchConfig(theta_low=1.0, theta_high=2.0, alpha=0.5))
    clutch.update(0.5)
    before = (clutch.engaged, clutch.ema, clutch.steps, clutch.flips)
    with pytest.raises(ValueError, match=match):
        clutch.update(value)  # type: ignore[arg-type]
    assert (clutch.engaged, clutch.ema, clutch.steps, clutch.flips) == before
