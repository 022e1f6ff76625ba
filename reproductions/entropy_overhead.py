"""Entropy computation cost at vocabulary 128256, with and without one host sync per call.

Reproduces the seed's "31.1 us per call, +32.5%" figure for the `.item()` synchronization the
clutch needs once per cycle. Wall-clock per call over many back-to-back calls (the way a decode
loop experiences it), N interleaved trials, raw per-trial samples kept.
"""

from __future__ import annotations

import statistics
import time

import torch

from sdsie.entropy import entropy

VOCAB = 128256
CLAIM_IDS = ["entropy-sync-overhead", "entropy-sync-us"]


def per_call_us(fn, calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / calls * 1e6


def measure(device: torch.device, trials: int = 15, calls: int = 2000, dtype=torch.bfloat16) -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, VOCAB, generator=gen) * 4).to(dtype).to(device)  # [1, V]
    no_sync = lambda: entropy(logits)  # noqa: E731
    with_sync = lambda: entropy(logits).item()  # noqa: E731
    for fn in (no_sync, with_sync):  # warm-up: allocator, kernels, clocks
        per_call_us(fn, calls // 4, device)
    samples = {"no_sync_us": [], "sync_us": []}
    for _ in range(trials):  # interleaved
        samples["no_sync_us"].append(per_call_us(no_sync, calls, device))
        samples["sync_us"].append(per_call_us(with_sync, calls, device))
    a, b = statistics.median(samples["no_sync_us"]), statistics.median(samples["sync_us"])
    return {
        "samples": samples,
        "metrics": {"no_sync_us": a, "sync_us": b, "sync_cost_us": b - a, "sync_cost_pct": 100.0 * (b / a - 1)},
        "config": {"vocab": VOCAB, "dtype": str(dtype), "trials": trials, "calls_per_trial": calls,
                   "device": str(device)},
    }
