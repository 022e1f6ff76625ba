"""Calibration schemes (sdsie.quant.calibrate): min-max range, exactness, group-wise and AWQ gains."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdsie.int4_format import Int4Weight, pack_int4
from sdsie.quant.calibrate import CalibratedWeight, QuantConfig, calibrate, layer_report, preset, sqnr_db

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _per_element_scale(w: Int4Weight) -> torch.Tensor:
    """The stored scale that applies to each element, float64 [N, K]."""
    return w.scales.double().repeat_interleave(w.group_size, dim=0)[: w.in_features].T


# --- min-max ------------------------------------------------------------------------------------


@given(
    n=st.integers(1, 6),
    k=st.integers(1, 100),
    g=st.sampled_from([None, 32, 64]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    offset=st.sampled_from([0.0, 2.0, -5.0]),  # rows entirely positive or negative included
    seed=st.integers(0, 2**16),
)
def test_minmax_never_clips(
    n: int, k: int, g: int | None, symmetric: bool, dtype: torch.dtype, magnitude: float, offset: float, seed: int
) -> None:
    w = ((_randn(n, k, seed=seed) + offset) * magnitude).to(dtype)  # [N, K]
    cal = calibrate(w, QuantConfig("minmax", g, symmetric))
    err = (cal.weight.dequantize() - w.double()).abs()  # [N, K]
    half_step = 0.5 * _per_element_scale(cal.weight)
    assert (err <= half_step * (1 + 1e-12)).all(), float((err / half_step).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_minmax_never_clips_with_low_precision_scales_on_many_rows(dtype: torch.dtype) -> None:
    # Enough groups that some land where a scale rounded *down* to dtype would push the top of
    # the range past code 15 (this fails if the stored scale is not rounded up).
    w = _randn(4096, 64, seed=0, dtype=dtype)
    cal = calibrate(w, QuantConfig("minmax", 32)).weight
    err = (cal.dequantize() - w.double()).abs()  # [N, K]
    assert (err <= 0.5 * _per_element_scale(cal) * (1 + 1e-12)).all()


def _representable_codes(n: int, k: int, g: int, symmetric: bool, seed: int) -> torch.Tensor:
    """Random codes [N, K] in which every group contains code 0 and (asymmetric) code 15."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    for start in range(0, k, g):
        width = min(g, k - start)
        for row in range(n):
            pos = torch.randperm(width, generator=gen)[:2] + start
            q[row, pos[0]] = 0
            if not symmetric:
                q[row, pos[1]] = 15
    return q


@given(
    n=st.integers(1, 5),
    k=st.integers(2, 100),
    g=st.sampled_from([None, 32, 64]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_exactly_representable_weights_round_trip_exactly(
    n: int, k: int, g: int | None, symmetric: bool, dtype: torch.dtype, seed: int
) -> None:
    group = k if g is None or g >= k else g
    if k % group == 1:  # a one-column last group cannot hold both code 0 and code 15
        k += 1
    gen = torch.Generator().manual_seed(seed)
    n_groups = -(-k // group)
    # Scales with 4 significant bits times codes of 4 bits: every weight is exact in bf16/fp16/fp32.
    mant = 1 + torch.randint(0, 8, (n_groups, n), generator=gen) / 8
    scales = (mant * 2.0 ** torch.randint(-6, 3, (n_groups, n), generator=gen)).to(dtype)  # [G, N]
    zeros = None if symmetric else torch.randint(0, 16, (n_groups, n), generator=gen).to(dtype)
    codes = _representable_codes(n, k, group, symmetric, seed)
    truth = Int4Weight(pack_int4(codes), scales, zeros, k, group)
    w = truth.dequantize(dtype)  # [N, K]
    assert torch.equal(w.double(), truth.dequantize())  # the construction is exact in dtype

    cal = calibrate(w, QuantConfig("minmax", g, symmetric)).weight
    assert torch.equal(cal.dequantize(dtype), w)
    assert torch.equal(cal.codes(), truth.codes())
    assert torch.equal(cal.scales, scales)


def _outlier_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian weights in which one 32-column group per row is 30x larger."""
    w = _randn(n, k, seed=seed)  # [N, K]
    gen = torch.Generator().manual_seed(seed + 1)
    groups = torch.randint(0, k // 32, (n,), generator=gen)
    for row, grp in enumerate(groups.tolist()):
        w[row, grp * 32 : (grp + 1) * 32] *= 30
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_groupwise_beats_per_channel_on_outlier_groups(seed: int, symmetric: bool) -> None:
    w = _outlier_weights(48, 256, seed)
    per_channel = sqnr_db(w, calibrate(w, QuantConfig("minmax", None, symmetric)).effective_weight())
    for g in (32, 64, 128):
        grouped = sqnr_db(w, calibrate(w, QuantConfig("minmax", g, symmetric)).effective_weight())
        assert grouped >= per_channel + 1.0, (g, grouped, per_channel)  # observed gains 1.3-4 dB


def test_smaller_groups_never_lose_sqnr_on_outliers() -> None:
    w = _outlier_weights(64, 256, seed=7)
    sqnrs = [sqnr_db(w, calibrate(w, QuantConfig("minmax", g)).effective_weight()) for g in (None, 128, 64, 32)]
    assert sqnrs == sorted(sqnrs), sqnrs


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_scales_and_zeros_stored_in_weight_dtype(dtype: torch.dtype, symmetric: bool) -> None:
    w = _randn(8, 64, seed=0, dtype=dtype)
    cal = calibrate(w, QuantConfig("minmax", 32, symmetric)).weight
    assert cal.scales.dtype == dtype
    assert cal.symmetric == symmetric
    if not symmetric:
        assert cal.zeros.dtype == dtype
        assert torch.equal(cal.zeros, cal.zeros.round()) and 0 <= float(cal.zeros.min()) <= float(cal.zeros.max()) <= 15


def test_float64_weights_get_fp32_scales() -> None:
    cal = calibrate(_randn(4, 32, seed=0, dtype=torch.float64)).weight
    assert cal.scales.dtype == torch.float32


def test_group_size_covering_the_row_is_per_channel() -> None:
    w = _randn(4, 48, seed=0)
    wide = calibrate(w, QuantConfig("minmax", 64)).weight
    assert (wide.group_size, wide.n_groups) == (48, 1)
    assert torch.equal(wide.dequantize(), calibrate(w).weight.dequantize())


def test_all_zero_rows_quantize_to_zero() -> None:
    w = torch.zeros(3, 40)
    w[1] = _randn(40, seed=2)
    for symmetric in (False, True):
        deq = calibrate(w, QuantConfig("minmax", 32, symmetric)).weight.dequantize()
        assert torch.isfinite(deq).all()
        assert torch.equal(deq[0], torch.zeros(40, dtype=torch.float64))
        assert torch.equal(deq[2], torch.zeros(40, dtype=torch.float64))


# --- activation-aware ---------------------------------------------------------------------------


def _activations_with_large_channels(t: int, k: int, seed: int) -> torch.Tensor:
    """Activations [T, K] where 4 input channels are 40x larger (as in LLM hidden states)."""
    x = _randn(t, k, seed=seed)
    x[:, [3, 17, 60, 101]] *= 40
    return x


def _output_mse(x: torch.Tensor, w: torch.Tensor, cal: CalibratedWeight) -> float:
    return float((x.double() @ w.double().T - x.double() @ cal.effective_weight().T).pow(2).mean())


@pytest.mark.parametrize(("g", "symmetric"), [(None, False), (32, False), (64, True)])
def test_awq_lowers_output_error_on_large_activation_channels(g: int | None, symmetric: bool) -> None:
    w = _randn(64, 128, seed=1)  # [N, K]
    x_cal = _activations_with_large_channels(64, 128, seed=2)
    x_held_out = _activations_with_large_channels(64, 128, seed=3)
    plain = calibrate(w, QuantConfig("minmax", g, symmetric))
    awq = calibrate(w, QuantConfig("awq", g, symmetric), act_samples=x_cal)
    assert awq.alpha is not None and awq.alpha > 0
    assert awq.input_scale is not None and awq.input_scale.shape == (128,)
    for x in (x_cal, x_held_out):
        assert _output_mse(x, w, awq) < 0.7 * _output_mse(x, w, plain)


@given(seed=st.integers(0, 2**16), g=st.sampled_from([None, 32]), symmetric=st.booleans())
def test_awq_never_worse_than_minmax_on_its_calibration_data(seed: int, g: int | None, symmetric: bool) -> None:
    w = _randn(16, 64, seed=seed)
    x = _randn(8, 64, seed=seed + 1) * (1 + 5 * torch.rand(64, generator=torch.Generator().manual_seed(seed)))
    plain = calibrate(w, QuantConfig("minmax", g, symmetric))
    awq = calibrate(w, QuantConfig("awq", g, symmetric, awq_grid=4), act_samples=x)
    assert _output_mse(x, w, awq) <= _output_mse(x, w, plain)


def test_awq_layer_computes_scaled_input_times_packed_weight() -> None:
    w = _randn(32, 128, seed=4)
    x = _activations_with_large_channels(16, 128, seed=5)
    awq = calibrate(w, QuantConfig("awq", 32), act_samples=x)
    assert awq.input_scale.dtype == w.dtype
    direct = (x.double() * awq.input_scale.double()) @ awq.weight.dequantize().T  # what Int4Linear runs
    torch.testing.assert_close(direct, x.double() @ awq.effective_weight().T, rtol=1e-12, atol=1e-12)
    assert sqnr_db(x @ w.T, direct) > 15.0  # and it approximates the original layer


def test_awq_accepts_activations_with_leading_dims_and_silent_channels() -> None:
    w = _randn(8, 64, seed=6)
    x = _randn(2, 5, 64, seed=7)  # [B, S, K]
    x[..., 10] = 0.0
    awq = calibrate(w, QuantConfig("awq", 32, awq_grid=5), act_samples=x)
    assert torch.isfinite(awq.effective_weight()).all()


# --- SQNR and reports ---------------------------------------------------------------------------


def test_sqnr_db_values() -> None:
    ref = torch.ones(100)
    assert sqnr_db(ref, ref.clone()) == math.inf
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)
    assert sqnr_db(ref, ref * 0.0) == pytest.approx(0.0)
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        sqnr_db(torch.ones(3), torch.ones(4))


def test_layer_report() -> None:
    w = _randn(16, 64, seed=8)
    x = _activations_with_large_channels(8, 64 + 64, seed=9)[:, :64]
    cfg = QuantConfig("awq", 32)
    cal = calibrate(w, cfg, act_samples=x)
    rep = layer_report("mlp.down_proj", w, cal, cfg, act_samples=x)
    assert (rep.name, rep.out_features, rep.in_features, rep.scheme) == ("mlp.down_proj", 16, 64, "awq/g32/asym")
    assert rep.alpha == cal.alpha
    assert rep.weight_sqnr_db == pytest.approx(sqnr_db(w, cal.effective_weight()))
    y_ref, y_q = x.double() @ w.double().T, x.double() @ cal.effective_weight().T
    assert rep.output_sqnr_db == pytest.approx(sqnr_db(y_ref, y_q))
    assert layer_report("l", w, calibrate(w), QuantConfig()).output_sqnr_db is None


def test_the_report_taken_a_few_rows_at_a_time_is_the_whole_ones(monkeypatch) -> None:
    """The float64 copies go REPORT_ELEMENTS at a time (a large LM head's whole copy does not fit beside a model):
    three rows a step here give the SQNRs of one step, and a row slice of the dequantized weight is its rows."""
    calibrate_module = importlib.import_module("sdsie.quant.calibrate")  # sdsie.quant.calibrate is also a function

    w = _randn(16, 64, seed=8)
    x = _activations_with_large_channels(8, 64 + 64, seed=9)[:, :64]
    cal = calibrate(w, QuantConfig("awq", 32), act_samples=x)
    whole = layer_report("l", w, cal, QuantConfig("awq", 32), act_samples=x)
    monkeypatch.setattr(calibrate_module, "REPORT_ELEMENTS", 3 * 64)  # 3 rows of [R, 64] and [8, R]
    pieces = layer_report("l", w, cal, QuantConfig("awq", 32), act_samples=x)
    assert pieces.weight_sqnr_db == pytest.approx(whole.weight_sqnr_db, rel=1e-12)
    assert pieces.output_sqnr_db == pytest.approx(whole.output_sqnr_db, rel=1e-12)
    assert torch.equal(cal.effective_weight(rows=slice(5, 11)), cal.effective_weight()[5:11])
    with pytest.raises(ValueError, match="contiguous slice"):
        cal.weight.dequantize(rows=slice(0, 16, 2))


# --- configuration and bad input ----------------------------------------------------------------


def test_presets() -> None:
    assert preset("per-channel") == QuantConfig("minmax", None)
    assert preset("group", group_size=64) == QuantConfig("minmax", 64)
    assert preset("awq", symmetric=True) == QuantConfig("awq", 128, True)
    with pytest.raises(ValueError, match="unknown calibration preset"):
        preset("gptq")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scheme": "gptq"}, "unknown calibration scheme"),
        ({"group_size": 0}, "group_size must be a positive int"),
        ({"group_size": 32.0}, "group_size must be a positive int"),
        ({"awq_grid": 0}, "awq_grid must be a positive int"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize(
    ("weight", "cfg", "act", "match"),
    [
        (torch.ones(4), QuantConfig(), None, r"float weight \[N, K\]"),
        (torch.ones(2, 2, 2), QuantConfig(), None, r"float weight \[N, K\]"),
        (torch.ones(4, 4, dtype=torch.int32), QuantConfig(), None, r"float weight \[N, K\]"),
        (torch.ones(0, 4), QuantConfig(), None, "non-empty"),
        (torch.tensor([[1.0, math.nan]]), QuantConfig(), None, "NaN or Inf"),
        (torch.tensor([[1.0, math.inf]]), QuantConfig(), None, "NaN or Inf"),
        (torch.ones(4, 64), QuantConfig(group_size=24), None, "group_size 24 is not supported"),
        (torch.ones(4, 64), QuantConfig("awq"), None, "needs act_samples"),
        (torch.ones(4, 64), QuantConfig(), torch.ones(3, 64), "only used by the 'awq' scheme"),
        (torch.ones(4, 64), QuantConfig("awq"), torch.ones(3, 32), r"act_samples must be float \[..., K=64\]"),
        (torch.ones(4, 64), QuantConfig("awq"), torch.ones(3, 64, dtype=torch.int64), "act_samples must be float"),
        (torch.ones(4, 64), QuantConfig("awq"), torch.ones(0, 64), "no rows"),
        (torch.ones(4, 64), QuantConfig("awq"), torch.full((2, 64), math.nan), "NaN or Inf"),
    ],
)
def test_calibrate_rejects_bad_input(weight: torch.Tensor, cfg: QuantConfig, act, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        calibrate(weight, cfg, act_samples=act)
