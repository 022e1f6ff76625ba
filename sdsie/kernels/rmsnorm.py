"""RMSNorm as one Triton kernel, and a module that swaps it into a model in place of HF's.

HF's LlamaRMSNorm launches eight kernels (a cast to fp32, the square, the mean, the epsilon, rsqrt, the scaling, the
cast back, the weight's product). At batch 1 the stand-in pair is bound by its kernel count (the H200 profile,
telemetry/raw/tree_cycle_profile_20261202T0011_h200.json: 792 kernels a graphed plain token, about 2 us each), so one
kernel a norm is less time whatever the arithmetic. The kernel computes HF's formula in the same steps and dtypes: x in
fp32, its mean square, x * rsqrt(mean + eps) cast to x's dtype, then times the weight in the promoted dtype; only the
mean's summation order differs from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from sdsie.kernels.device import kernel_runs_on

__all__ = ["FusedRMSNorm", "fuse_rmsnorm", "rms_norm", "rms_norm_reference"]


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    mean_sq = tl.sum(x * x, axis=0) / N
    h = (x * (1.0 / tl.sqrt(mean_sq + eps))).to(x_ptr.dtype.element_ty)  # HF: hidden.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * h.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm's forward, step for step."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in the dtype of weight * x, one kernel launch (CUDA, or the Triton
    interpreter on a CPU)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {n}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x on {x.device}, weight on {weight.device}")
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps, BLOCK=block,
                                      num_warps=4 if block <= 2048 else 8)
    return out.reshape(x.shape)


class FusedRMSNorm(nn.Module):
    """An RMSNorm module (HF's LlamaRMSNorm and its kin: `weight`, `variance_epsilon`) as one kernel where Triton runs;
    elsewhere (a CPU without the interpreter) HF's formula. Holds the same weight Parameter."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if kernel_runs_on(hidden_states.device):
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return rms_norm_reference(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def fuse_rmsnorm(model: nn.Module) -> int:
    """Swap every RMSNorm submodule of `model` (a class named ...RMSNorm with `weight` and `variance_epsilon`) for
    a FusedRMSNorm over the same weight, in place; returns how many. A model with none is refused."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child).__name__.endswith("RMSNorm") and not isinstance(child, FusedRMSNorm)
             and hasattr(child, "weight") and hasattr(child, "variance_epsilon")]
    if not swaps and not any(isinstance(m, FusedRMSNorm) for m in model.modules()):
        raise ValueError(f"fuse_rmsnorm: {type(model).__name__} has no RMSNorm module (weight, variance_epsilon)")
    for parent, name, child in swaps:
        setattr(parent, name, FusedRMSNorm(child))
    return len(swaps)
