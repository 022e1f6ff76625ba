"""Ground truth for the INT4 kernel: unpack -> dequantize -> matmul in float64."""

from __future__ import annotations

import torch

from sdsie.int4_format import Int4Weight


def int4_matmul_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """y = x @ dequant(W).T computed in float64 on x's device; returns float64 [..., N]."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has K={x.shape[-1]} but the weight has in_features={w.in_features}")
    wd = w.dequantize(torch.float64).to(x.device)  # [N, K]
    return x.to(torch.float64) @ wd.T
