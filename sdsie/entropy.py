"""Shannon entropy of logits: the one signal both gates read.

One definition (`entropy`), computed on the logits' own device in fp32, with no host synchronization:
the caller decides when (and whether) to bring the value to the host. `argmax_entropy` gives a greedy decoder's
token beside it, in one pass of a Triton kernel on CUDA (sdsie.kernels.logit_stats: two kernels where torch
takes nine) and from `argmax` and `entropy` elsewhere.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Unit = Literal["bits", "nats"]

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def entropy(logits: torch.Tensor, unit: Unit = "bits") -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension.

    logits: [..., V] in fp16, bf16, fp32 or fp64. Returns [...] in fp32 (fp64 stays fp64).
    `-inf` entries are masked vocabulary (probability 0, contributing 0). A row whose entries are
    all `-inf` has no distribution and yields NaN; the clutch refuses NaN with a clear error.

    With e = exp(x - max(x)) and s = sum(e), H = log(s) - sum(e log e) / s. Both terms are >= 0
    (log s = -log p_max; e <= 1), so nothing cancels, and exp() never overflows, whatever the logits' size.
    Not log_softmax: torch's CPU kernel accumulates its normalizer sequentially in fp32 (~5e-4 relative error
    at V = 128256, ~0.004 bits of entropy); torch.sum is a cascade sum. Eight kernels, no temporaries kept.
    """
    if logits.dtype not in _SUPPORTED:
        raise ValueError(f"entropy: unsupported logits dtype {logits.dtype}; expected one of {_SUPPORTED}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"entropy: logits need a non-empty last (vocabulary) dimension, got {tuple(logits.shape)}")
    if unit not in ("bits", "nats"):
        raise ValueError(f"entropy: unit must be 'bits' or 'nats', got {unit!r}")
    x = logits if logits.dtype == torch.float64 else logits.float()
    # An all -inf row has max -inf, so e, s and H are NaN there: no distribution, no entropy.
    e = (x - x.amax(dim=-1, keepdim=True)).exp()  # [..., V] in [0, 1]; 1 at the max
    s = e.sum(dim=-1)  # [...], >= 1
    elog = torch.xlogy(e, e).sum(dim=-1)  # [...] = sum e log e <= 0; xlogy(0, 0) = 0 for masked entries
    if unit == "bits":
        return torch.addcdiv(s.log2(), elog, s, value=-1.0 / math.log(2.0))  # log2 s - elog / (s ln 2)
    return torch.addcdiv(s.log(), elog, s, value=-1.0)


def argmax_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits.argmax(-1), entropy(logits) in bits) for logits [..., V]: on CUDA in fp16, bf16 or fp32 by
    `sdsie.kernels.logit_stats` (the same values up to fp32 summation order), elsewhere by torch."""
    if logits.is_cuda and logits.dtype != torch.float64:
        from sdsie.kernels.logit_stats import logit_stats

        return logit_stats(logits)
    return logits.argmax(dim=-1), entropy(logits)
