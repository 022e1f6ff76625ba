"""Decoding: one engine for the plain loop, fixed-K speculation, and entropy-gated speculation and precision."""

from sdsie.decoding.compiled import DecodeCompiled, inductor_options, prompt_compile_kwargs
from sdsie.decoding.engine import (
    CycleRecord,
    DecodeConfig,
    DecodeStats,
    Gear,
    GenerationResult,
    generate,
    run_attention,
    warm_up_runs,
)
from sdsie.decoding.near_tie import Mismatch, NearTieReport, compare_logits, decode_logits, near_tie_report
from sdsie.decoding.sampling import GREEDY, SamplingConfig, logits_to_probs, make_generator, sample, select_token
from sdsie.decoding.sweeps import RunSummary, SweepEntry, SweepResult, clutch_grid, sweep
from sdsie.decoding.verify import greedy_verify, rejection_verify

__all__ = [
    "GREEDY",
    "Mismatch",
    "NearTieReport",
    "RunSummary",
    "SweepEntry",
    "SweepResult",
    "clutch_grid",
    "compare_logits",
    "decode_logits",
    "near_tie_report",
    "sweep",
    "CycleRecord",
    "DecodeCompiled",
    "DecodeConfig",
    "DecodeStats",
    "Gear",
    "GenerationResult",
    "SamplingConfig",
    "generate",
    "greedy_verify",
    "inductor_options",
    "prompt_compile_kwargs",
    "logits_to_probs",
    "make_generator",
    "rejection_verify",
    "warm_up_runs",
    "run_attention",
    "sample",
    "select_token",
]
