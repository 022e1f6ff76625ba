"""Threshold sweep: (theta_low, theta_high, alpha) x prompts x trials through the one engine.

Every configuration runs the same prompts; trials are interleaved (trial -> prompt -> configuration)
so thermal and clock drift spread over all configurations instead of favouring the first. Each run
keeps its tokens, so a reader can check that greedy outputs agree across configurations (lossless)
while throughput, fallback fraction and scout work differ (the gate acts).

Optional baselines run in the same interleaving: "plain" (no scout) and "fixed-K" (scout every
cycle). With a gear, baselines run at full precision (gear.int4 = False), since no clutch drives it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from sdsie.clutch import ClutchConfig, EntropyClutch
from sdsie.decoding.engine import DEFAULT_K, DecodeConfig, Gear, GenerationResult, generate

__all__ = ["RunSummary", "SweepEntry", "SweepResult", "clutch_grid", "sweep"]


@dataclass(frozen=True)
class RunSummary:
    prompt_index: int
    trial: int
    tokens_per_s: float
    decode_tokens_per_s: float
    new_tokens: int
    cycles: int
    fallback_fraction: float
    drafted: int
    accepted: int
    scout_forwards: int
    target_forwards: int
    decisions: str  # one letter per cycle: S speculated, F plain step
    tokens: list[int]

    @classmethod
    def from_result(cls, prompt_index: int, trial: int, result: GenerationResult) -> RunSummary:
        s = result.stats
        return cls(
            prompt_index,
            trial,
            s.tokens_per_s,
            s.decode_tokens_per_s,
            s.new_tokens,
            s.cycles,
            s.fallback_fraction,
            s.drafted,
            s.accepted,
            s.scout_forwards,
            s.target_forwards,
            result.decisions,
            list(result.tokens),
        )


@dataclass
class SweepEntry:
    label: str
    clutch: dict[str, Any] | None  # the ClutchConfig as a dict; None for baselines
    speculative: bool
    runs: list[RunSummary] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Mean over runs of end-to-end tokens/s."""
        return sum(r.tokens_per_s for r in self.runs) / len(self.runs)

    @property
    def scout_forwards(self) -> int:
        return sum(r.scout_forwards for r in self.runs)

    @property
    def fallback_fraction(self) -> float:
        """Pooled over runs: plain/fallback cycles over all cycles."""
        cycles = sum(r.cycles for r in self.runs)
        return sum(r.fallback_fraction * r.cycles for r in self.runs) / cycles if cycles else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Pooled over runs: accepted drafts over drafted tokens (None when nothing was drafted)."""
        drafted = sum(r.drafted for r in self.runs)
        return sum(r.accepted for r in self.runs) / drafted if drafted else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "clutch": self.clutch,
            "speculative": self.speculative,
            "tokens_per_s": self.tokens_per_s,
            "fallback_fraction": self.fallback_fraction,
            "acceptance_rate": self.acceptance_rate,
            "scout_forwards": self.scout_forwards,
            "runs": [asdict(r) for r in self.runs],
        }


@dataclass
class SweepResult:
    entries: list[SweepEntry]
    prompts: int
    trials: int
    decode_config: dict[str, Any]

    def entry(self, label: str) -> SweepEntry:
        for e in self.entries:
            if e.label == label:
                return e
        raise KeyError(f"no sweep entry labelled {label!r}; have {[e.label for e in self.entries]}")

    def outputs_identical(self) -> bool:
        """True when every run of every entry produced the same tokens for its prompt (expected for greedy)."""
        per_prompt: dict[int, list[int]] = {}
        for e in self.entries:
            for r in e.runs:
                if per_prompt.setdefault(r.prompt_index, r.tokens) != r.tokens:
                    return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "trials": self.trials,
            "decode_config": self.decode_config,
            "entries": [e.to_dict() for e in self.entries],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def clutch_grid(
    theta_lows: Sequence[float],
    theta_highs: Sequence[float],
    alphas: Sequence[float],
    k_draft: int = DEFAULT_K,
    drop_invalid: bool = False,
) -> list[ClutchConfig]:
    """The product grid. A combination with theta_low > theta_high raises, unless drop_invalid=True."""
    grid = []
    for low, high, alpha in itertools.product(theta_lows, theta_highs, alphas):
        if low > high and drop_invalid:
            continue
        grid.append(ClutchConfig(theta_low=low, theta_high=high, alpha=alpha, k_draft=k_draft))
    if not grid:
        raise ValueError("clutch_grid: empty grid (no valid theta_low <= theta_high combination)")
    return grid


def sweep(
    target: nn.Module,
    scout: nn.Module,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    clutches: Sequence[ClutchConfig],
    trials: int = 1,
    config: DecodeConfig | None = None,
    gear: Gear | None = None,
    baselines: bool = True,
    warmup: int = 1,
) -> SweepResult:
    """Run every clutch configuration (plus the plain and fixed-K baselines) on every prompt, `trials`
    times, after `warmup` untimed runs per configuration on every prompt (a prompt's first run pays for
    its new shapes: allocator growth, library heuristics; on the H200 a cold first trial ran at less than
    half the speed of later ones)."""
    config = config if config is not None else DecodeConfig()
    if not prompts:
        raise ValueError("sweep needs at least one prompt")
    if not clutches and not baselines:
        raise ValueError("sweep needs at least one clutch configuration or baselines=True")
    if trials < 1 or warmup < 0:
        raise ValueError(f"trials must be >= 1 and warmup >= 0, got trials={trials}, warmup={warmup}")
    k = config.k_draft if config.k_draft is not None else DEFAULT_K
    if any(c.k_draft != k for c in clutches):
        raise ValueError(f"every clutch must draft K={k} (DecodeConfig.k_draft) so configurations compare")
    gated_config = replace(config, k_draft=None)
    plans = _plans(clutches, k, baselines)

    def run_one(plan: _Plan, prompt: Any) -> GenerationResult:
        if plan.clutch is None:
            if gear is not None:
                gear.int4 = False
            fixed = replace(config, k_draft=k)
            return generate(target, prompt, fixed, scout=scout if plan.speculative else None)
        return generate(target, prompt, gated_config, scout=scout, clutch=EntropyClutch(plan.clutch), gear=gear)

    for _ in range(warmup):
        for prompt in prompts:
            for plan in plans:
                run_one(plan, prompt)
    for trial in range(trials):
        for index, prompt in enumerate(prompts):
            for plan in plans:
                plan.entry.runs.append(RunSummary.from_result(index, trial, run_one(plan, prompt)))
    return SweepResult([p.entry for p in plans], len(prompts), trials, _config_dict(config))


@dataclass
class _Plan:
    entry: SweepEntry
    clutch: ClutchConfig | None
    speculative: bool


def _plans(clutches: Sequence[ClutchConfig], k: int, baselines: bool) -> list[_Plan]:
    plans = []
    if baselines:
        plans.append(_Plan(SweepEntry("plain", None, False), None, False))
        plans.append(_Plan(SweepEntry(f"fixed-K{k}", None, True), None, True))
    for c in clutches:
        label = f"gated(theta_low={c.theta_low}, theta_high={c.theta_high}, alpha={c.alpha})"
        plans.append(_Plan(SweepEntry(label, asdict(c), True), c, True))
    labels = [p.entry.label for p in plans]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate clutch configurations in the sweep: {labels}")
    return plans


def _config_dict(config: DecodeConfig) -> dict[str, Any]:
    d = asdict(config)
    d["eos_token_id"] = list(config.eos_ids) if config.eos_token_id is not None else None
    return d
