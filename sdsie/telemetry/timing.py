"""GPU time between CUDA events: the one timer the suites and probes use for a device's share of a call."""

from __future__ import annotations

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
