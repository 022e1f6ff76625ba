"""Calibration: float weights [N, K] -> packed INT4 (`Int4Weight`), and the quantization error.

Schemes (`QuantConfig.scheme`):

* ``"minmax"``: min-max range per group of `group_size` input columns, or per output channel
  when `group_size` is None (the seed's method; no dataset needed). Asymmetric uses
  step = (hi - lo) / 15 with an integer zero-point; symmetric (zero-point fixed at 8, codes
  -8..7) uses step = max(-lo / 8, hi / 7). The range always includes 0 (so an integer zero-point
  in [0, 15] exists) and the stored scale is rounded *up* to its storage dtype, so min-max never
  clips: every weight dequantizes within half a step of itself.
* ``"awq"``: activation-aware scaling (AWQ, Lin et al. 2023, arXiv:2306.00978). Per input
  channel s_k = mean|x_k| ** a, normalised so sqrt(max(s) * min(s)) = 1; W * s is quantized
  with the min-max scheme above, and the layer computes (x / s) @ dequant(W * s).T, which equals
  x @ W.T up to quantization error. The exponent a is picked from {0, 1/grid, ..., 1} to
  minimise the output MSE on the calibration activations; a = 0 is plain min-max, so AWQ is
  never worse than min-max on those activations.

How the AWQ input scaling is applied: `CalibratedWeight.input_scale` (= 1 / s, shape [K], in the
weight's dtype) is a per-input-channel multiplier that `Int4Linear` applies to x before the
INT4 matmul. It is the simplest correct choice: folding 1/s into the previous op (an RMSNorm
weight, or the up-projection for down_proj) would save one elementwise multiply but ties the
calibration to the model's graph and would also change the full-precision gear of a
`GatedLinear`, which must stay exactly the original layer.

Scales (and zero-points) are stored in the weight's dtype (bf16 for a bf16 model); float64
weights get fp32 scales. Computation is float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sdsie.int4_format import SYMMETRIC_ZERO, Int4Weight, pack_int4

__all__ = [
    "QuantConfig",
    "CalibratedWeight",
    "LayerReport",
    "SCHEMES",
    "calibrate",
    "preset",
    "sqnr_db",
    "layer_report",
]

SCHEMES = ("minmax", "awq")
PRESETS = ("per-channel", "group", "awq")
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class QuantConfig:
    """How to calibrate one linear layer's weights."""

    scheme: str = "minmax"  # "minmax" | "awq"
    group_size: int | None = None  # None: one scale per output channel (group = the whole row)
    symmetric: bool = False  # symmetric: zero-point fixed at 8; asymmetric: integer zero-point per group
    awq_grid: int = 20  # AWQ: exponents a in {0, 1/awq_grid, ..., 1}

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown calibration scheme {self.scheme!r}; expected one of {SCHEMES}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"group_size must be a positive int or None (per channel), got {self.group_size!r}")
        if not isinstance(self.awq_grid, int) or self.awq_grid < 1:
            raise ValueError(f"awq_grid must be a positive int, got {self.awq_grid!r}")

    def describe(self) -> str:
        groups = "per-channel" if self.group_size is None else f"g{self.group_size}"
        return f"{self.scheme}/{groups}/{'sym' if self.symmetric else 'asym'}"


def preset(name: str, group_size: int = 128, symmetric: bool = False) -> QuantConfig:
    """The three schemes the fidelity sweep compares: 'per-channel', 'group' (min-max) and 'awq'."""
    if name == "per-channel":
        return QuantConfig("minmax", None, symmetric)
    if name == "group":
        return QuantConfig("minmax", group_size, symmetric)
    if name == "awq":
        return QuantConfig("awq", group_size, symmetric)
    raise ValueError(f"unknown calibration preset {name!r}; expected one of {PRESETS}")


@dataclass
class CalibratedWeight:
    """Packed weights plus the per-input-channel multiplier the layer applies to x (AWQ only).

    The layer computes y = (x * input_scale) @ dequant(weight).T; `input_scale` None means 1.
    """

    weight: Int4Weight
    input_scale: torch.Tensor | None  # [K], weight dtype, or None
    alpha: float | None = None  # the AWQ exponent chosen (None for min-max)

    def effective_weight(self, dtype: torch.dtype = torch.float64, rows: slice = slice(None)) -> torch.Tensor:
        """The [N, K] matrix the quantized layer effectively multiplies by: y = x @ W_eff.T (`rows`: a contiguous
        slice of its rows)."""
        w = self.weight.dequantize(dtype, rows)  # [R, K]
        return w if self.input_scale is None else w * self.input_scale.to(dtype)[None, :]


# --- min-max ------------------------------------------------------------------------------------


def _round_up_to(step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest `dtype` values >= step (float64 input), so a stored scale never shrinks the range."""
    s = step.to(dtype)
    too_small = s.to(torch.float64) < step
    s = torch.where(too_small, torch.nextafter(s, torch.full_like(s, math.inf)), s)
    if not torch.isfinite(s).all():
        raise ValueError(f"a quantization scale overflows {dtype}: weights too large for {dtype} scales")
    return s


def _grouped(w: torch.Tensor, g: int) -> torch.Tensor:
    """[N, K] -> [N, G, g], zero-padding a partial last group (0 is always inside the range)."""
    n, k = w.shape
    n_groups = -(-k // g)
    padded = torch.nn.functional.pad(w, (0, n_groups * g - k))
    return padded.reshape(n, n_groups, g)


def _minmax(w: torch.Tensor, g: int, symmetric: bool, scale_dtype: torch.dtype) -> Int4Weight:
    """Min-max INT4 quantization of float64 w [N, K] with groups of g columns."""
    n, k = w.shape
    wg = _grouped(w, g)  # [N, G, g]
    lo = wg.amin(dim=-1).clamp(max=0.0)  # [N, G]
    hi = wg.amax(dim=-1).clamp(min=0.0)  # [N, G]
    step = torch.maximum(-lo / 8, hi / 7) if symmetric else (hi - lo) / 15
    step = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero group: any scale works
    scales = _round_up_to(step, scale_dtype)  # [N, G]
    s = scales.to(torch.float64)
    zeros = torch.full_like(s, SYMMETRIC_ZERO) if symmetric else torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + zeros[..., None], 0, 15)  # [N, G, g]
    codes = q.reshape(n, -1)[:, :k].to(torch.uint8)  # [N, K]
    z = None if symmetric else zeros.T.to(scale_dtype).contiguous()
    return Int4Weight(pack_int4(codes), scales.T.contiguous(), z, k, g)


# --- activation-aware ---------------------------------------------------------------------------


def _awq_channel_scales(act_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_k = mean|x_k| ** alpha, normalised so sqrt(max * min) = 1 (float64 [K])."""
    s = act_mean_abs.pow(alpha)
    return s / torch.sqrt(s.max() * s.min())


def _scaled_minmax(w: torch.Tensor, s: torch.Tensor, g: int, symmetric: bool, dtype: torch.dtype) -> CalibratedWeight:
    """Quantize W * s; the stored multiplier 1 / s (rounded to dtype) is what W is divided by."""
    multiplier = (1.0 / s).to(dtype)  # [K]
    packed = _minmax(w / multiplier.to(torch.float64)[None, :], g, symmetric, dtype)
    return CalibratedWeight(packed, multiplier)


def _awq(w: torch.Tensor, x: torch.Tensor, cfg: QuantConfig, g: int, dtype: torch.dtype) -> CalibratedWeight:
    """Grid search over the AWQ exponent; w: float64 [N, K], x: float64 [T, K]."""
    mean_abs = x.abs().mean(dim=0)  # [K]
    floor = max(float(mean_abs.max()) * 1e-6, torch.finfo(torch.float64).tiny)
    mean_abs = mean_abs.clamp(min=floor)  # a silent channel must not give s = 0
    y_ref = x @ w.T  # [T, N]
    best, best_err = None, math.inf
    for i in range(cfg.awq_grid + 1):
        alpha = i / cfg.awq_grid
        cand = _scaled_minmax(w, _awq_channel_scales(mean_abs, alpha), g, cfg.symmetric, dtype)
        err = float((x @ cand.effective_weight().T - y_ref).pow(2).mean())
        if err < best_err:
            best, best_err = CalibratedWeight(cand.weight, cand.input_scale, alpha), err
    if best.alpha == 0.0:  # s = 1 exactly: plain min-max, no multiplier needed
        best = CalibratedWeight(best.weight, None, 0.0)
    return best


# --- entry point --------------------------------------------------------------------------------


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        desc = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight)
        raise ValueError(f"calibrate expects a float weight [N, K], got {desc}")
    if weight.numel() == 0:
        raise ValueError(f"calibrate expects a non-empty weight, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("calibrate: the weight contains NaN or Inf")


def _flat_activations(act: torch.Tensor, k: int) -> torch.Tensor:
    """[..., K] calibration activations -> float64 [T, K], validated."""
    if not isinstance(act, torch.Tensor) or not act.is_floating_point() or act.dim() < 1 or act.shape[-1] != k:
        desc = f"{act.dtype} {tuple(act.shape)}" if isinstance(act, torch.Tensor) else type(act)
        raise ValueError(f"act_samples must be float [..., K={k}], got {desc}")
    x = act.detach().reshape(-1, k).to(torch.float64)
    if x.shape[0] == 0:
        raise ValueError("act_samples holds no rows")
    if not torch.isfinite(x).all():
        raise ValueError("act_samples contain NaN or Inf")
    return x


def _group_for(cfg: QuantConfig, k: int) -> int:
    """The stored group size: K for per-channel, or when the configured group covers the whole row."""
    return k if cfg.group_size is None or cfg.group_size >= k else cfg.group_size


def calibrate(
    weight: torch.Tensor, config: QuantConfig | None = None, act_samples: torch.Tensor | None = None
) -> CalibratedWeight:
    """Quantize a linear layer's weight [N, K] (y = x @ W.T) to INT4 with the configured scheme.

    `act_samples` [..., K] (inputs x to the layer) are required by "awq" and rejected otherwise.
    """
    cfg = config or QuantConfig()
    _check_weight(weight)
    k = weight.shape[1]
    g = _group_for(cfg, k)
    dtype = weight.dtype if weight.dtype in _SCALE_DTYPES else torch.float32
    w = weight.detach().to(torch.float64)
    if cfg.scheme == "minmax":
        if act_samples is not None:
            raise ValueError("act_samples are only used by the 'awq' scheme; min-max needs no data")
        return CalibratedWeight(_minmax(w, g, cfg.symmetric, dtype), None)
    if act_samples is None:
        raise ValueError("the 'awq' scheme needs act_samples: calibration inputs [..., K] to this layer")
    return _awq(w, _flat_activations(act_samples, k).to(w.device), cfg, g, dtype)


# --- error report -------------------------------------------------------------------------------


def _energies(reference: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(|ref|^2, |ref - approx|^2) in float64."""
    ref = reference.detach().to(torch.float64)
    noise = (ref - approx.detach().to(device=ref.device, dtype=torch.float64)).pow(2).sum()
    return float(ref.pow(2).sum()), float(noise)


def _db(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(|ref|^2 / |ref - approx|^2) in dB (inf if exact)."""
    if reference.shape != approx.shape:
        raise ValueError(f"sqnr_db: shapes differ, {tuple(reference.shape)} vs {tuple(approx.shape)}")
    return _db(*_energies(reference, approx))


REPORT_ELEMENTS = 1 << 24  # float64 elements a report's copies take at a time (128 MiB each)


@dataclass(frozen=True)
class LayerReport:
    """Quantization error of one layer."""

    name: str
    out_features: int
    in_features: int
    scheme: str  # QuantConfig.describe()
    weight_sqnr_db: float  # W vs the effective quantized weight
    output_sqnr_db: float | None  # x @ W.T vs the quantized layer on calibration inputs (if given)
    alpha: float | None  # AWQ exponent (None for min-max)


def layer_report(
    name: str,
    weight: torch.Tensor,
    calibrated: CalibratedWeight,
    config: QuantConfig,
    act_samples: torch.Tensor | None = None,
) -> LayerReport:
    """Per-layer SQNR of a calibration (output SQNR only when activations are given). The float64 copies are taken
    REPORT_ELEMENTS at a time, rows of the weight (and columns of the outputs) at once: a whole one is 3.91 GiB for
    Llama-3.1-8B's LM head, whose allocation ran an H100 out of memory beside a second 8B model
    (telemetry/raw/serve_int4_oom_llama_h100.txt)."""
    n, k = weight.shape
    x = None if act_samples is None else _flat_activations(act_samples, k).to(weight.device, torch.float64)  # [T, K]
    w_sums, out_sums = [0.0, 0.0], [0.0, 0.0]  # (signal, noise) of the weight and of the outputs
    step = max(1, REPORT_ELEMENTS // max(k, 0 if x is None else x.shape[0]))  # rows R: [R, K] and [T, R] copies
    for r0 in range(0, n, step):
        w = weight[r0:r0 + step].detach().to(torch.float64)  # [R, K]
        w_eff = calibrated.effective_weight(rows=slice(r0, r0 + step))  # [R, K]
        w_sums = [a + b for a, b in zip(w_sums, _energies(w, w_eff), strict=True)]
        if x is not None:
            out_sums = [a + b for a, b in zip(out_sums, _energies(x @ w.T, x @ w_eff.T), strict=True)]
    out_sqnr = None if x is None else _db(*out_sums)
    return LayerReport(name, n, k, config.describe(), _db(*w_sums), out_sqnr, calibrated.alpha)
