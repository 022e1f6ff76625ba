"""Precision gating: `GatedLinear` layers that switch between the original weights and INT4.

One `GearState` per model is shared by all its `GatedLinear` layers; its `int4` flag is read at
every forward, so flipping it between two forwards changes which path the second one runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sdsie.kernels import compose_epilogue, silu_mul_halves
from sdsie.quant.calibrate import QuantConfig
from sdsie.quant.linear import Int4Linear, QuantReport, calibrate_targets, replace_module

__all__ = ["GearState", "GatedLinear", "build_gated_layers", "gate_model"]


@dataclass
class GearState:
    """The model-wide precision gear and how often each path ran (counted per layer call)."""

    int4: bool = False  # True: gated layers run the INT4 kernel; False: the original layer
    int4_calls: int = 0
    full_calls: int = 0
    report: QuantReport | None = field(default=None, repr=False)  # what gate_model gated

    def reset_counters(self) -> None:
        self.int4_calls = 0
        self.full_calls = 0


class GatedLinear(nn.Module):
    """Holds the original `nn.Linear` and its `Int4Linear` copy; `state.int4` picks one per call."""

    def __init__(self, full: nn.Linear, quantized: Int4Linear, state: GearState) -> None:
        super().__init__()
        if (full.in_features, full.out_features) != (quantized.in_features, quantized.out_features):
            raise ValueError(
                f"GatedLinear: full layer is {full.out_features}x{full.in_features} "
                f"but the INT4 layer is {quantized.out_features}x{quantized.in_features}"
            )
        self.full = full
        self.quantized = quantized
        self.state = state
        self.in_features, self.out_features = full.in_features, full.out_features

    @property
    def norm_eps(self) -> float | None:
        """The decoder norm both gears apply before themselves (set by `sdsie.quant.fuse_norms`; their input is then
        the stream [h, h * g, row_squares(h)], as `Int4Linear.norm_eps` says)."""
        return self.quantized.norm_eps

    @norm_eps.setter
    def norm_eps(self, value: float | None) -> None:
        self.quantized.norm_eps = value

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_gain: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., K] (the norm's stream with norm_eps) -> [..., N] (the next norm's stream with out_gain); residual
        # [..., N] (`Int4Linear.forward`)
        if torch.compiler.is_compiling():
            # The counters are Python ints dynamo would guard on: counted while tracing, a compiled step would be
            # compiled again at every call (and, past dynamo's limit, silently run eagerly). Compiled calls, like
            # graph replays, go uncounted; the gear still acts (kernel_calls counts the INT4 launches).
            if self.state.int4:
                return self.quantized(x, residual, out_gain)
            return self._full(x, residual, out_gain)
        if self.state.int4:
            self.state.int4_calls += 1
            return self.quantized(x, residual, out_gain)
        self.state.full_calls += 1
        return self._full(x, residual, out_gain)

    def _full(self, x: torch.Tensor, residual: torch.Tensor | None, out_gain: torch.Tensor | None) -> torch.Tensor:
        """The original layer, with the INT4 layer's epilogue in torch where a norm, residual or gain is asked: the
        norm scales the product, then the bias, the residual and the gained copy follow, in the INT4 layer's order."""
        if self.norm_eps is None and residual is None and out_gain is None:
            return self.full(x)
        x, h, sq = self.quantized.split_stream(x)  # the product's operand, the norm's stream and its squares
        return compose_epilogue(nn.functional.linear(x, self.full.weight), x, self.norm_eps, residual, h, out_gain,
                                bias=self.full.bias, norm_squares=sq)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output halves (a fused [gate; up] projection): the INT4 gear through
        `Int4Linear.silu_mul`, the full one through torch; counted as `forward` counts."""
        if self.state.int4:
            if not torch.compiler.is_compiling():
                self.state.int4_calls += 1
            return self.quantized.silu_mul(x)
        return silu_mul_halves(self(x))


def build_gated_layers(
    model: nn.Module,
    targets: str | Sequence[str],
    config: QuantConfig | None = None,
    layers: Sequence[int] | None = None,
    calibration_inputs: torch.Tensor | None = None,
) -> tuple[GearState, dict[str, GatedLinear]]:
    """Calibrate the chosen linears and wrap each in a `GatedLinear` sharing one new `GearState`.

    The model is not changed: install a layer with `replace_module(model, name, gated[name])`.
    """
    chosen, report = calibrate_targets(model, targets, config, layers, calibration_inputs)
    state = GearState(report=report)
    gated = {
        name: GatedLinear(linear, Int4Linear.from_calibrated(cal, linear.bias), state)
        for name, (linear, cal) in chosen.items()
    }
    return state, gated


def gate_model(
    model: nn.Module,
    targets: str | Sequence[str],
    config: QuantConfig | None = None,
    layers: Sequence[int] | None = None,
    calibration_inputs: torch.Tensor | None = None,
) -> GearState:
    """Replace the chosen linears by `GatedLinear` sharing one new `GearState` (gear starts full).

    Target selection and calibration as in `sdsie.quant.linear.quantize_model`; the returned
    state's `report` lists the gated layers and their quantization error.
    """
    if any(isinstance(mod, GatedLinear) for mod in model.modules()):
        raise ValueError("model already has GatedLinear layers: one GearState per model, gate it once")
    state, gated = build_gated_layers(model, targets, config, layers, calibration_inputs)
    for name, module in gated.items():
        replace_module(model, name, module)
    return state
