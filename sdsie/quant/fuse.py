"""Fused projections: q/k/v as one linear, gate/up as one linear (fewer, larger GEMVs per decoder layer).

A decode step at batch 1 is a GEMV per linear; three q/k/v GEMVs and two gate/up GEMVs over the same input become one
each, whose wider N also runs nearer the bandwidth limit. Rows are concatenated as they are: an INT4 row keeps its
codes, scales and zero-points (calibration is per row, along K), so the fused layer's weights are exactly the
unfused layers' and its outputs differ from theirs at most by the kernel's summation order for another N.

Two mechanisms, chosen for robustness across transformers versions:

* gate/up: the whole MLP module (`gate_proj`, `up_proj`, `down_proj`, `act_fn`: Llama, Qwen2, Mistral) is replaced
  by `FusedMLP`, which computes down(act(gate(x)) * up(x)) from one `gate_up_proj` (for silu and INT4 weights,
  silu(gate) * up in the projection's epilogue: one kernel fewer a layer).
* q/k/v: the attention's own forward (rotary, cache, attention interface) differs between versions, so it stays; its
  `q_proj`, `k_proj` and `v_proj` become `ProjectionSlice` views of one `FusedProjection` (`qkv_proj`, a child of
  the attention module): the first of the three called on an input computes all of them, the other two take their
  slices of that result. A slice called on another input computes the fused projection again (correct, slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sdsie.int4_format import Int4Weight
from sdsie.kernels import compose_epilogue
from sdsie.quant.gated import GatedLinear
from sdsie.quant.linear import Int4Linear

__all__ = ["FusedMLP", "FusedProjection", "FusionReport", "ProjectionSlice", "concat_linears", "fuse_projections"]

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _cat_optional(tensors: Sequence[torch.Tensor | None], dim: int, what: str) -> torch.Tensor | None:
    present = [t is not None for t in tensors]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"cannot fuse layers where only some have {what}")
    return torch.cat(list(tensors), dim=dim)  # type: ignore[arg-type]


def _concat_int4(layers: Sequence[Int4Linear]) -> Int4Linear:
    first = layers[0]
    for layer in layers[1:]:
        if (layer.in_features, layer.group_size) != (first.in_features, first.group_size):
            raise ValueError(f"cannot fuse INT4 layers of in_features/group_size {first.in_features}/"
                             f"{first.group_size} and {layer.in_features}/{layer.group_size}")
        if layer.scales.dtype != first.scales.dtype or (layer.zeros is None) != (first.zeros is None):
            raise ValueError("cannot fuse INT4 layers with different scale dtypes or symmetry")
    scales = [layer.input_scale for layer in layers]
    if any(s is not None for s in scales) and not all(s is not None and torch.equal(s, scales[0]) for s in scales):
        raise ValueError("cannot fuse INT4 layers with different AWQ input scales: fuse before an AWQ calibration "
                         "or use a min-max scheme")
    weight = Int4Weight(
        torch.cat([layer.qweight for layer in layers], dim=0),  # [sum N, ceil(K/2)]
        torch.cat([layer.scales for layer in layers], dim=1).contiguous(),  # [G, sum N]
        _cat_optional([layer.zeros for layer in layers], 1, "zero-points"),
        first.in_features,
        first.group_size,
    )
    if weight.zeros is not None:
        weight.zeros = weight.zeros.contiguous()
    bias = _cat_optional([layer.bias for layer in layers], 0, "a bias")
    return Int4Linear(weight, bias, scales[0])


def _concat_float(layers: Sequence[nn.Linear]) -> nn.Linear:
    first = layers[0]
    if any(layer.in_features != first.in_features for layer in layers):
        raise ValueError(f"cannot fuse linears of in_features {[layer.in_features for layer in layers]}")
    bias = _cat_optional([layer.bias for layer in layers], 0, "a bias")
    fused = nn.Linear(first.in_features, sum(layer.out_features for layer in layers), bias=bias is not None,
                      device="meta")
    grad = first.weight.requires_grad
    fused.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=grad)
    if bias is not None:
        fused.bias = nn.Parameter(bias.detach(), requires_grad=grad)
    return fused


def concat_linears(layers: Sequence[nn.Module]) -> nn.Module:
    """One layer whose output is the layers' outputs concatenated along the last dim: nn.Linear, Int4Linear, or
    GatedLinear sharing one GearState (both paths concatenated). ValueError for a mix or a mismatch."""
    if not layers:
        raise ValueError("concat_linears needs at least one layer")
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse layers of different kinds: {sorted(k.__name__ for k in kinds)}")
    kind = kinds.pop()
    if kind is Int4Linear:
        return _concat_int4(layers)  # type: ignore[arg-type]
    if kind is nn.Linear:
        return _concat_float(layers)  # type: ignore[arg-type]
    if kind is GatedLinear:
        state = layers[0].state
        if any(layer.state is not state for layer in layers):
            raise ValueError("cannot fuse GatedLinear layers of different GearStates")
        return GatedLinear(_concat_float([layer.full for layer in layers]),
                           _concat_int4([layer.quantized for layer in layers]), state)
    raise ValueError(f"cannot fuse {kind.__name__} layers: nn.Linear, Int4Linear or GatedLinear only")


class FusedProjection(nn.Module):
    """One linear computing several projections of one input; `part(i, x)` is projection i of x.

    The fused output of the latest input is kept until each projection has taken its part, then dropped (a
    prefill's outputs are large)."""

    def __init__(self, linear: nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.linear = linear
        self.sizes = tuple(sizes)
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] | None = None
        self._left = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._parts is None or x is not self._input:
            self._parts = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._left = x, len(self.sizes)
        out = self._parts[index]
        self._left -= 1
        if self._left <= 0:
            self._input = self._parts = None
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class ProjectionSlice(nn.Module):
    """Projection `index` of a FusedProjection, in place of the linear it came from (same in/out features)."""

    def __init__(self, fused: FusedProjection, index: int, in_features: int) -> None:
        super().__init__()
        self._fused = (fused,)  # a tuple: the fused module is a child of the parent, not of each slice
        self.index = index
        self.in_features, self.out_features = in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(self.index, x)

    def extra_repr(self) -> str:
        return f"index={self.index}, in_features={self.in_features}, out_features={self.out_features}"


def is_silu(act: nn.Module) -> bool:
    """Whether `act` computes silu: torch's nn.SiLU, or transformers' SiLUActivation (by class name: its module
    moves between versions)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


class FusedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up computed by one `gate_up_proj`. With silu and an INT4 (or gated)
    projection, silu(gate) * up comes from the projection's own launch (`Int4Linear.silu_mul`)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn: nn.Module, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.intermediate = intermediate
        self._silu = is_silu(act_fn)

    @property
    def silu_in_projection(self) -> bool:
        """Whether silu(gate) * up comes from the projection's launch (asked per call: the projection may be
        replaced after fusing)."""
        return self._silu and isinstance(self.gate_up_proj, (Int4Linear, GatedLinear))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_gain: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x [..., H]; plus `residual` [..., H] where given, and with `out_gain` [H] the next norm's
        stream, [the result, its copy times the gain, its partial sums of squares] ([..., norm_stream_width(H)],
        `int4_matmul`'s; in the down projection's launch where it is an Int4Linear or the INT4 gear)."""
        if self.silu_in_projection:
            hidden = self.gate_up_proj.silu_mul(x)
        else:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
            hidden = self.act_fn(gate) * up
        if residual is None and out_gain is None:
            return self.down_proj(hidden)
        if isinstance(self.down_proj, (Int4Linear, GatedLinear)):
            return self.down_proj(hidden, residual=residual, out_gain=out_gain)
        return compose_epilogue(self.down_proj(hidden), hidden, residual=residual, out_gain=out_gain)


@dataclass
class FusionReport:
    """What fuse_projections fused: the attention and MLP modules' names."""

    qkv: list[str]
    gate_up: list[str]


def _has(module: nn.Module, names: Sequence[str]) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in names)


def fuse_projections(model: nn.Module, qkv: bool = True, gate_up: bool = True) -> FusionReport:
    """Fuse, in place, each attention's q/k/v and each MLP's gate/up into one linear (see the module docstring).

    Modules with `q_proj`, `k_proj`, `v_proj` (attention) and with `gate_proj`, `up_proj`, `down_proj`, `act_fn`
    (MLP) are fused; their layers must be of one kind (nn.Linear, Int4Linear, or GatedLinear of one gear). A model
    with neither is a ValueError."""
    report = FusionReport([], [])
    for name, module in list(model.named_modules()):
        if qkv and _has(module, QKV) and not isinstance(module.q_proj, ProjectionSlice):
            layers = [getattr(module, p) for p in QKV]
            fused = FusedProjection(concat_linears(layers), [layer.out_features for layer in layers])
            module.qkv_proj = fused
            for index, (p, layer) in enumerate(zip(QKV, layers, strict=True)):
                setattr(module, p, ProjectionSlice(fused, index, layer.in_features))
            report.qkv.append(name)
        if gate_up and name and _has(module, (*GATE_UP, "down_proj", "act_fn")):
            gate, up = module.gate_proj, module.up_proj
            if gate.out_features != up.out_features:
                raise ValueError(f"{name}: gate_proj and up_proj differ in out_features")
            mlp = FusedMLP(concat_linears([gate, up]), module.down_proj, module.act_fn, gate.out_features)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, mlp)
            report.gate_up.append(name)
    if not report.qkv and not report.gate_up:
        raise ValueError(f"{type(model).__name__} has no unfused q_proj/k_proj/v_proj or gate_proj/up_proj/down_proj "
                         "modules to fuse")
    return report
