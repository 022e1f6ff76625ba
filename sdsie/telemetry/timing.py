"""GPU time between CUDA events: the one timer the suites and probes use for a device's share of a call, and the
graphed, L2-cold per-call time that kernel sweeps and `sdsie tune-int4` rank configurations by."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch


def cuda_event_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds between a CUDA event recorded before `calls` consecutive calls of fn and one recorded after them,
    divided by `calls`: the device's time from the first launch to the last kernel's end (host gaps between launches
    included where the host is the slower side). Waits for the end event; needs CUDA."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def l2_busting_copies(device: str, bytes_per_copy: int, lo: int = 2, hi: int = 64) -> int:
    """How many copies of `bytes_per_copy` a rotation needs to cover 4x the L2 (so none is served from
    L2), clamped to [lo, hi]."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(lo, min(hi, math.ceil(4 * l2 / bytes_per_copy)))


def graph_us(make_call: Callable[[int], Callable[[], object]], bytes_per_call: int, device: str,
             reps: int = 20, max_copies: int = 64) -> float:
    """Per-call time with launch overhead removed: one CUDA graph replays calls that cycle over enough
    weight copies (> 4x L2, at most `max_copies`) that none is served from L2; time per call = replay time / calls."""
    calls = [make_call(i) for i in range(l2_busting_copies(device, bytes_per_call, hi=max_copies))]
    for c in calls:  # warm-up outside the capture: compilation, workspaces, semaphores
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = [cuda_event_ms(graph.replay) * 1e3 / len(calls) for _ in range(reps)]  # one replay per pair of events
    return statistics.median(times)
