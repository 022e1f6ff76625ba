"""`Int4Linear` (a linear layer through the one INT4 kernel) and `quantize_model`.

Target selection, shared with `gate_model`: `targets` are dotted-name suffixes of `nn.Linear`
modules (``"mlp.down_proj"`` matches ``model.layers.3.mlp.down_proj``); `layers` optionally keeps
only modules under ``layers.{i}.`` for the given indices. A pattern matching no `nn.Linear`, or a
layer index matching none of the pattern's modules, is a ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sdsie import kernels
from sdsie.int4_format import Int4Weight
from sdsie.quant.calibrate import CalibratedWeight, LayerReport, QuantConfig, calibrate, layer_report

__all__ = [
    "Int4Linear",
    "QuantReport",
    "calibrate_targets",
    "capture_linear_inputs",
    "layer_index",
    "quantize_model",
    "replace_module",
    "select_linears",
]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class Int4Linear(nn.Module):
    """y = (x * input_scale) @ dequant(W).T + bias, computed by `sdsie.kernels.int4_matmul`.

    Weights stay packed (buffers `qweight`, `scales`, `zeros`); `input_scale` [K] is the AWQ
    per-input-channel multiplier (absent for min-max calibrations). `norm_eps` (set by
    `sdsie.quant.fuse_norms`): the layer applies the decoder's RMS norm before it itself, its input being
    the residual stream h, its copy times the norm's gain g and h's partial sums of squares side by side,
    [h, h * g, row_squares(h)] ([..., norm_stream_width(K)], which the projection before writes):
    y = rsqrt(mean(h^2) + norm_eps) * ((h * g) @ W.T), the mean from those sums.
    """

    norm_eps: float | None = None

    def __init__(
        self, weight: Int4Weight, bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        n, k = weight.out_features, weight.in_features
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape [N] = [{n}], got {tuple(bias.shape)}")
        if input_scale is not None and tuple(input_scale.shape) != (k,):
            raise ValueError(f"input_scale must have shape [K] = [{k}], got {tuple(input_scale.shape)}")
        self.in_features, self.out_features, self.group_size = k, n, weight.group_size
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._packed = weight
        kernels.register_weight(weight)

    @classmethod
    def from_calibrated(cls, calibrated: CalibratedWeight, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(calibrated.weight, bias, calibrated.input_scale)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: QuantConfig | None = None, act_samples: torch.Tensor | None = None
    ) -> Int4Linear:
        """Calibrate `linear.weight` (see `sdsie.quant.calibrate.calibrate`) and keep its bias."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"Int4Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        return cls.from_calibrated(calibrate(linear.weight, config, act_samples), linear.bias)

    @property
    def int4_weight(self) -> Int4Weight:
        """The packed weight the kernel reads (views of this module's buffers)."""
        return self._packed

    def _apply(self, fn, recurse: bool = True):  # keep the packed view in step with .to()/.cuda()
        super()._apply(fn, recurse)
        self._packed = Int4Weight(self.qweight, self.scales, self.zeros, self.in_features, self.group_size)
        kernels.register_weight(self._packed)
        return self

    def effective_weight(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The [N, K] matrix this layer effectively multiplies by (input scaling folded in)."""
        return CalibratedWeight(self._packed, self.input_scale).effective_weight(dtype)

    def split_stream(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(the GEMV's operand, the norm's stream, its partial sums of squares): with `norm_eps`, x is the stream
        [h, h * g, row_squares(h)] ([..., norm_stream_width(K)]) -> (h * g, h, the squares); else (x, None, None)."""
        if self.norm_eps is None:
            return x, None, None
        k = self.in_features
        if x.shape[-1] != kernels.norm_stream_width(k):
            raise ValueError(f"Int4Linear with norm_eps reads the stream [h, h * gain, h's partial sums of squares], "
                             f"[..., {kernels.norm_stream_width(k)}]; got {tuple(x.shape)}")
        return x[..., k:2 * k], x[..., :k], x[..., 2 * k:]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_gain: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (the stream, [..., norm_stream_width(K)], with `norm_eps`) -> [..., N] in x's dtype;
        `residual` [..., N] is added to the output; `out_gain` [N]: the output is the next norm's stream
        [..., norm_stream_width(N)] (`int4_matmul`'s). Both in the kernel's epilogue where it takes the call and the
        layer has no bias."""
        x, h, sq = self.split_stream(x)
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        fused = self.bias is None
        r, g = (residual, out_gain) if fused else (None, None)
        if torch.compiler.is_compiling():  # one opaque node for dynamo; eager calls skip the dispatcher
            if self._composed(x, h, residual, out_gain):  # the bare product; the epilogue traced beside it
                y = torch.ops.sdsie.int4_mm(x, self.qweight, self.scales, self.zeros, self.group_size)
                return kernels.compose_epilogue(y, x, self.norm_eps, residual, h, out_gain, bias=self.bias,
                                                norm_squares=sq)
            y = torch.ops.sdsie.int4_mm(x, self.qweight, self.scales, self.zeros, self.group_size, self.norm_eps, h,
                                        r, g, sq)
        elif self.norm_eps is None and r is None and g is None:  # the launcher's plain form: the common call, and
            y = kernels.int4_matmul(x, self._packed)  # what code that swaps the launcher (tests' counters) expects
        else:
            y = kernels.int4_matmul(x, self._packed, norm_eps=self.norm_eps, norm_source=h, residual=r, out_gain=g,
                                    norm_squares=sq)
        if fused:
            return y
        return kernels.compose_epilogue(y, x, bias=self.bias, residual=residual, out_gain=out_gain)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output halves (a fused [gate; up] projection): [..., N/2], in one launch
        where `int4_silu_mul` takes the call."""
        if self.bias is not None:
            return kernels.silu_mul_halves(self(x))
        x, h, sq = self.split_stream(x)
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        if torch.compiler.is_compiling():
            if self._composed(x, h, gate_up=True):
                y = torch.ops.sdsie.int4_mm(x, self.qweight, self.scales, self.zeros, self.group_size)
                return kernels.silu_mul_halves(kernels.compose_epilogue(y, x, self.norm_eps, norm_source=h,
                                                                        norm_squares=sq))
            return torch.ops.sdsie.int4_silu_mul(x, self.qweight, self.scales, self.zeros, self.group_size,
                                                 self.norm_eps, h, sq)
        if self.norm_eps is None:
            return kernels.int4_silu_mul(x, self._packed)
        return kernels.int4_silu_mul(x, self._packed, norm_eps=self.norm_eps, norm_source=h, norm_squares=sq)

    def _composed(self, x: torch.Tensor, h: torch.Tensor | None, residual: torch.Tensor | None = None,
                  out_gain: torch.Tensor | None = None, gate_up: bool = False) -> bool:
        """Whether a compiled graph takes this call's epilogue (norm, bias, residual, gain; silu * up) from torch
        ops beside the op's bare product: where no kernel can take it (more rows than `epilogue_max_m`, e.g. a
        prompt's). Traced, inductor fuses those ops into a few kernels; inside the opaque op they would run eagerly,
        about ten launches a layer (an eager 32-token Llama-3.1-8B prefill launches 1,547 small kernels beside its
        GEMVs and attention, docs/log.md 2026-12-06 12:10). Under a dynamic length the row count is symbolic and this
        guards on it."""
        if h is None and residual is None and out_gain is None and not gate_up:
            return False
        rows = x.numel() // x.shape[-1]
        return rows > kernels.epilogue_max_m(gate_up, h is not None)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.group_size >= self.in_features else f"group_size={self.group_size}"
        sym = "symmetric" if self.zeros is None else "asymmetric"
        awq = ", input_scale" if self.input_scale is not None else ""
        norm = "" if self.norm_eps is None else f", norm_eps={self.norm_eps}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, {sym}{awq}{norm}"


# --- target selection ---------------------------------------------------------------------------


def layer_index(name: str) -> int | None:
    """The decoder-layer index i of a module named like '...layers.{i}....', else None."""
    match = _LAYER_INDEX.search(name)
    return None if match is None else int(match.group(1))


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def select_linears(model: nn.Module, targets: str | Sequence[str], layers: Sequence[int] | None = None) -> list[str]:
    """Names of the `nn.Linear` modules chosen by suffix patterns and (optionally) layer indices."""
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"targets must be one or more non-empty name patterns, got {targets!r}")
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    chosen: list[str] = []
    for pattern in patterns:
        hits = [name for name in linears if _matches(name, pattern)]
        if not hits:
            examples = sorted({name.split(".")[-1] for name in linears})[:8]
            raise ValueError(f"target {pattern!r} matches no nn.Linear in the model (linear names end in {examples})")
        chosen += [name for name in hits if name not in chosen]
    if layers is None:
        return chosen
    wanted = list(layers)
    if not wanted or not all(isinstance(i, int) and i >= 0 for i in wanted):
        raise ValueError(f"layers must be a non-empty list of non-negative ints, got {layers!r}")
    found = {layer_index(name) for name in chosen}
    missing = sorted(set(wanted) - found)
    if missing:
        raise ValueError(f"layer indices {missing} match none of the targeted modules {patterns}")
    return [name for name in chosen if layer_index(name) in set(wanted)]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@torch.no_grad()
def capture_linear_inputs(model: nn.Module, names: Sequence[str], inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run `model(inputs)` once and return each named linear's input activations, [T, K]."""
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def hook_for(name: str):
        return lambda _mod, args: captured[name].append(args[0].detach().reshape(-1, args[0].shape[-1]))

    handles = [model.get_submodule(name).register_forward_pre_hook(hook_for(name)) for name in names]
    try:
        model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(chunks) for name, chunks in captured.items()}


# --- whole-model quantization -------------------------------------------------------------------


@dataclass
class QuantReport:
    """What `quantize_model` / `gate_model` replaced, with each layer's quantization error."""

    config: QuantConfig
    layers: list[LayerReport]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def table(self) -> str:
        """A Markdown table: one row per layer with weight (and output) SQNR in dB."""
        rows = ["| layer | N x K | weight SQNR (dB) | output SQNR (dB) | AWQ alpha |", "|---|---|---|---|---|"]
        for r in self.layers:
            out = "-" if r.output_sqnr_db is None else f"{r.output_sqnr_db:.2f}"
            alpha = "-" if r.alpha is None else f"{r.alpha:.2f}"
            rows.append(f"| {r.name} | {r.out_features} x {r.in_features} | {r.weight_sqnr_db:.2f} | {out} | {alpha} |")
        return "\n".join(rows)


def calibrate_targets(
    model: nn.Module,
    targets: str | Sequence[str],
    config: QuantConfig | None = None,
    layers: Sequence[int] | None = None,
    calibration_inputs: torch.Tensor | None = None,
) -> tuple[dict[str, tuple[nn.Linear, CalibratedWeight]], QuantReport]:
    """Calibrate the chosen linears (the model is not changed).

    `calibration_inputs` (e.g. input_ids [B, S]) are run through the model once to capture each
    target's inputs: required by "awq", and used by every scheme to report output SQNR.
    """
    chosen: dict[str, tuple[nn.Linear, CalibratedWeight]] = {}
    reports: list[LayerReport] = []
    cfg = config or QuantConfig()
    for name, linear, cal, rep in _calibrated(model, targets, cfg, layers, calibration_inputs):
        chosen[name] = (linear, cal)
        reports.append(rep)
    return chosen, QuantReport(cfg, reports)


def _calibrated(
    model: nn.Module,
    targets: str | Sequence[str],
    cfg: QuantConfig,
    layers: Sequence[int] | None,
    calibration_inputs: torch.Tensor | None,
) -> Iterator[tuple[str, nn.Linear, CalibratedWeight, LayerReport]]:
    """(name, layer, calibration, report) of each chosen linear in turn, its inputs captured for all before the
    first: a caller may replace each layer before the next is calibrated."""
    names = select_linears(model, targets, layers)
    if cfg.scheme == "awq" and calibration_inputs is None:
        raise ValueError("the 'awq' scheme needs calibration_inputs (e.g. input_ids) to capture layer activations")
    acts = {} if calibration_inputs is None else capture_linear_inputs(model, names, calibration_inputs)
    for name in names:
        linear = model.get_submodule(name)
        x = acts.pop(name, None)
        cal = calibrate(linear.weight, cfg, x if cfg.scheme == "awq" else None)
        yield name, linear, cal, layer_report(name, linear.weight, cal, cfg, x)


def quantize_model(
    model: nn.Module,
    targets: str | Sequence[str],
    config: QuantConfig | None = None,
    layers: Sequence[int] | None = None,
    calibration_inputs: torch.Tensor | None = None,
) -> QuantReport:
    """Replace the chosen `nn.Linear` modules by `Int4Linear` in place; returns the per-layer report.

    Each layer is replaced as soon as it is calibrated, so its original weight can be freed before the next is
    calibrated: the memory held stays near the original model's, not the model's plus every layer's INT4 copy."""
    cfg = config or QuantConfig()
    reports: list[LayerReport] = []
    for name, linear, cal, rep in _calibrated(model, targets, cfg, layers, calibration_inputs):
        replace_module(model, name, Int4Linear.from_calibrated(cal, linear.bias))
        reports.append(rep)
    return QuantReport(cfg, reports)
