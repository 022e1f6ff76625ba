"""`sdsie::int4_mm` (and `sdsie::int4_silu_mul`): the INT4 launchers as torch.library custom ops, so torch.compile
traces INT4 layers.

Dynamo cannot trace the launcher itself (its plans and Triton's compiled-kernel calls are host Python); as an opaque
op with a fake implementation (the output's shape and dtype only) it becomes one node of the compiled graph, and
inductor fuses the small kernels around it. The op takes the packed weight's tensors, not the `Int4Weight` object
the launcher keeps its launch plans on, so the real implementation looks that object up by the tensors' storages:
a layer registers its weight (`register_weight`), and a compiled call then reuses the plans of eager calls. An
unregistered weight (e.g. opcheck's copies) is wrapped anew: correct, without the kept plans.

Eager layers call `int4_matmul` directly (`torch.compiler.is_compiling()` picks): the dispatcher would add host
time in front of every launch at batch 1.
"""

from __future__ import annotations

import weakref

import torch

from sdsie.int4_format import Int4Weight
from sdsie.kernels.int4_gemm import int4_matmul, int4_silu_mul, norm_stream_width

__all__ = ["int4_mm", "int4_silu_mul_op", "register_weight", "weight_for"]

_WEIGHTS: weakref.WeakValueDictionary[tuple, Int4Weight] = weakref.WeakValueDictionary()


def _key(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, in_features: int,
         group_size: int) -> tuple:
    return (qweight.device, qweight.data_ptr(), tuple(qweight.shape), qweight.stride(), scales.data_ptr(),
            scales.dtype, 0 if zeros is None else zeros.data_ptr(), in_features, group_size)


def register_weight(w: Int4Weight) -> None:
    """Make `w` (and its launch plans) the one the op finds for its tensors, while `w` lives."""
    _WEIGHTS[_key(w.qweight, w.scales, w.zeros, w.in_features, w.group_size)] = w


def weight_for(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, in_features: int,
               group_size: int) -> Int4Weight:
    """The registered Int4Weight over these tensors, else a new one (validated as any Int4Weight)."""
    key = _key(qweight, scales, zeros, in_features, group_size)
    w = _WEIGHTS.get(key)
    if w is not None and _key(w.qweight, w.scales, w.zeros, w.in_features, w.group_size) == key:
        return w
    return Int4Weight(qweight, scales, zeros, in_features, group_size)


@torch.library.custom_op("sdsie::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            group_size: int, norm_eps: float | None = None, norm_source: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, out_gain: torch.Tensor | None = None,
            norm_squares: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T for x [..., K] and the packed weight's tensors (`sdsie.int4_format`); [..., N] in x's
    dtype ([..., norm_stream_width(N)] with `out_gain`); `norm_eps`, `norm_source`, `residual`, `out_gain` and
    `norm_squares` as `int4_matmul`'s."""
    return int4_matmul(x, weight_for(qweight, scales, zeros, x.shape[-1], group_size), norm_eps=norm_eps,
                       norm_source=norm_source, residual=residual, out_gain=out_gain, norm_squares=norm_squares)


@int4_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
      group_size: int, norm_eps: float | None = None, norm_source: torch.Tensor | None = None,
      residual: torch.Tensor | None = None, out_gain: torch.Tensor | None = None,
      norm_squares: torch.Tensor | None = None) -> torch.Tensor:
    n = qweight.shape[0]
    return x.new_empty((*x.shape[:-1], n if out_gain is None else norm_stream_width(n)))


@torch.library.custom_op("sdsie::int4_silu_mul", mutates_args=())
def int4_silu_mul_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int, norm_eps: float | None = None, norm_source: torch.Tensor | None = None,
                     norm_squares: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused [gate; up] weight's output halves (`int4_silu_mul`): [..., N/2] in x's dtype."""
    return int4_silu_mul(x, weight_for(qweight, scales, zeros, x.shape[-1], group_size), norm_eps=norm_eps,
                         norm_source=norm_source, norm_squares=norm_squares)


@int4_silu_mul_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
      group_size: int, norm_eps: float | None = None, norm_source: torch.Tensor | None = None,
      norm_squares: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[0] // 2))
