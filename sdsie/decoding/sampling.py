"""Token selection: greedy, temperature, top-k, top-p, with a seeded generator.

The one place where logits become tokens. Scout drafting, target verification and the plain
loop all call these functions, so greedy and sampled decoding use one definition of each.

Sampling is sync-free: a categorical draw is `argmax(probs / E)` with `E ~ Exp(1)` i.i.d.
(the exponential-race form of the Gumbel-max trick, as in gpt-fast), so nothing is read back
to the host. The probabilities need not be normalized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GREEDY", "SamplingConfig", "logits_to_probs", "make_generator", "sample", "select_token"]


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax); top_k / top_p of None mean no truncation."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be None or lie in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingConfig()


def make_generator(config: SamplingConfig, device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from `config.seed` (a fresh random seed when it is None)."""
    generator = torch.Generator(device=device)
    if config.seed is None:
        generator.seed()
    else:
        generator.manual_seed(config.seed)
    return generator


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p. logits: [..., V] -> probs: [..., V] in fp32."""
    if config.greedy:
        raise ValueError("logits_to_probs: greedy decoding (temperature 0) has no sampling distribution")
    x = logits.float() / config.temperature  # [..., V]
    if config.top_k is not None and config.top_k < x.shape[-1]:
        kth = torch.topk(x, config.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        x = _top_p_mask(x, config.top_p)
    return torch.softmax(x, dim=-1)


def _top_p_mask(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [..., V]
    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p  # the top token has mass_before 0 and is never dropped
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One categorical draw per row without a host sync. probs: [..., V] (unnormalized ok) -> [...] int64."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=generator)  # [..., V]
    return (probs.float() / noise).argmax(dim=-1)


def select_token(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [..., V] -> (token [...] int64, probs [..., V] fp32, or None when greedy)."""
    if config.greedy:
        return logits.argmax(dim=-1), None
    if generator is None:
        raise ValueError("select_token: sampling needs a torch.Generator (see make_generator)")
    probs = logits_to_probs(logits, config)
    return sample(probs, generator), probs
