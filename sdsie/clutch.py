"""The entropy clutch: a Schmitt trigger over an exponential moving average of entropy.

There is exactly one clutch in this code base. Speculation and precision both take their
decision from an instance of `EntropyClutch`; nothing else thresholds entropy.

Convention (documented once, here):

    ema_0 = H_0                                  (no `initial_ema`: the first entropy seeds the EMA)
    ema_t = alpha * H_t + (1 - alpha) * ema_{t-1}
    with `initial_ema` given it is the EMA before the first step: ema_0 = alpha * H_0 + (1 - alpha) * initial_ema

    engaged  once ema_t <  theta_low             (predictable text: speculate, cheap gear allowed)
    released once ema_t >  theta_high            (uncertain text: fall back)
    otherwise the previous state holds            (the hysteresis band)

alpha = 1 makes the EMA equal the latest entropy. theta_low == theta_high is allowed and
degenerates to a single static threshold (no hysteresis band).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PRODUCTION", "SEED_CLUTCHES", "TUNED", "ClutchConfig", "EntropyClutch"]


def _check_threshold(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a real number of bits, got {value!r}")
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0 bits, got {value!r}")


@dataclass(frozen=True)
class ClutchConfig:
    """Thresholds in bits; alpha in (0, 1]; `k_draft` is the draft length 'engaged' maps to."""

    theta_low: float = 0.15
    theta_high: float = 0.70
    alpha: float = 0.65
    k_draft: int = 5
    initial_engaged: bool = False
    initial_ema: float | None = None

    def __post_init__(self) -> None:
        _check_threshold("theta_low", self.theta_low)
        _check_threshold("theta_high", self.theta_high)
        if self.theta_low > self.theta_high:
            raise ValueError(
                f"theta_low ({self.theta_low}) must not exceed theta_high ({self.theta_high})"
            )
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not (0.0 < self.alpha <= 1.0):
            raise ValueError(f"alpha must lie in (0, 1], got {self.alpha!r}")
        if not isinstance(self.k_draft, int) or isinstance(self.k_draft, bool) or self.k_draft < 1:
            raise ValueError(f"k_draft must be an integer >= 1, got {self.k_draft!r}")
        if not isinstance(self.initial_engaged, bool):
            raise ValueError(f"initial_engaged must be a bool, got {self.initial_engaged!r}")
        if self.initial_ema is not None:
            _check_threshold("initial_ema", self.initial_ema)


# The seed's two published settings, by name.
PRODUCTION = ClutchConfig(theta_low=0.55, theta_high=1.25, alpha=0.35)
TUNED = ClutchConfig(theta_low=0.15, theta_high=0.70, alpha=0.65)
SEED_CLUTCHES = {"production": PRODUCTION, "tuned": TUNED}  # by the names records and reports give them


class EntropyClutch:
    """Schmitt trigger over an EMA of per-step entropy (bits).

    `update(h)` takes a Python float or a 0-d tensor (one host read per call: the caller's one
    synchronization for the cycle) and returns the new state, True = engaged.
    """

    def __init__(self, config: ClutchConfig | None = None) -> None:
        self.config = config if config is not None else ClutchConfig()
        self.reset()

    def reset(self) -> None:
        self.engaged: bool = self.config.initial_engaged
        self.ema: float | None = self.config.initial_ema
        self.steps: int = 0
        self.flips: int = 0

    @property
    def k(self) -> int:
        """Draft length for the current state: k_draft when engaged, 0 when not."""
        return self.config.k_draft if self.engaged else 0

    def update(self, h: float | torch.Tensor) -> bool:
        value = _as_float(h)
        a = self.config.alpha
        self.ema = value if self.ema is None else a * value + (1.0 - a) * self.ema
        new_state = self.engaged
        if self.ema < self.config.theta_low:
            new_state = True
        elif self.ema > self.config.theta_high:
            new_state = False
        self.flips += int(new_state != self.engaged)
        self.engaged = new_state
        self.steps += 1
        return self.engaged

    def may_flip(self, max_bits: float) -> bool:
        """Whether the next `update`, with an entropy anywhere in [0, max_bits], could change `engaged`. The EMA grows
        with the entropy, so the two ends decide: engaged, the largest entropy is the one that may release it;
        released, zero bits is the one that may engage it. Same arithmetic as `update`."""
        a = self.config.alpha
        h = max_bits if self.engaged else 0.0
        ema = h if self.ema is None else a * h + (1.0 - a) * self.ema
        return ema > self.config.theta_high if self.engaged else ema < self.config.theta_low

    def __repr__(self) -> str:
        return f"EntropyClutch(engaged={self.engaged}, ema={self.ema}, steps={self.steps}, {self.config})"


def _as_float(h: float | torch.Tensor) -> float:
    if isinstance(h, torch.Tensor):
        if h.numel() != 1 or h.dim() != 0:
            raise ValueError(f"clutch entropy must be a 0-d tensor or float, got shape {tuple(h.shape)}")
        if h.dtype == torch.bool or h.is_complex():
            raise ValueError(f"clutch entropy tensor must have a real dtype, got dtype {h.dtype}")
        value = float(h.item())
    elif isinstance(h, (int, float)) and not isinstance(h, bool):
        value = float(h)
    else:
        raise ValueError(f"clutch entropy must be a float or 0-d tensor, got {type(h).__name__}")
    if math.isnan(value):
        raise ValueError("clutch received a NaN entropy (all-masked or NaN logits?); refusing to decide on it")
    if math.isinf(value) or value < 0:
        raise ValueError(f"clutch entropy must be finite and >= 0 bits, got {value}")
    return value
