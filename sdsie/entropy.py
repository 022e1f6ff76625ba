"""Shannon entropy of logits: the one signal both gates read.

One function, computed on the logits' own device in fp32, with no host synchronization:
the caller decides when (and whether) to bring the value to the host.
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

    H = -sum_i p_i log p_i, computed from log_softmax so very large logits cannot overflow.
    """
    if logits.dtype not in _SUPPORTED:
        raise ValueError(f"entropy: unsupported logits dtype {logits.dtype}; expected one of {_SUPPORTED}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"entropy: logits need a non-empty last (vocabulary) dimension, got {tuple(logits.shape)}")
    if unit not in ("bits", "nats"):
        raise ValueError(f"entropy: unit must be 'bits' or 'nats', got {unit!r}")
    x = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(x, dim=-1)  # [..., V]
    p = logp.exp()
    # 0 * log 0 = 0: masked (-inf) entries would otherwise give 0 * -inf = NaN.
    plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=x.dtype, device=x.device))
    h = -plogp.sum(dim=-1)  # [...]
    # All-masked rows: log_softmax is NaN there already, and p > 0 is False, so restore the NaN.
    h = torch.where(torch.isnan(logp[..., 0]), logp[..., 0], h)
    if unit == "bits":
        h = h / math.log(2.0)
    return h.clamp_min(0.0)
