"""Server counters and their Prometheus text exposition (GET /metrics).

Ratios (tokens/s, acceptance, engaged-cycle share, INT4 share, J/token) are derived from the counters at
scrape time and left out while undefined: no gauge reads 0 for "nothing measured yet". Energy lines appear
only where a meter exists, and count only requests whose window gave a reading.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

__all__ = ["Metrics", "RequestStats"]

OUTCOMES = ("ok", "cancelled", "bad_request", "unauthorized", "queue_full", "failed")


@dataclass
class RequestStats:
    """What one finished generation adds to the totals."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    engaged_cycles: int = 0
    speculate_cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    dropped_forwards: int = 0  # of target_forwards: steps launched ahead of a read and dropped (DecodeStats)
    int4_target_forwards: int = 0  # of the kept ones (the prefill's and the cycles')
    energy_j: float | None = None


@dataclass
class _Totals(RequestStats):
    """RequestStats summed over finished generations; energy over those with a reading only."""

    energy_j: float = 0.0
    energy_tokens: int = 0
    energy_requests: int = 0
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))


class Metrics:
    """Thread-safe totals: the worker adds finished generations, the app counts refusals."""

    def __init__(self, gear: bool = False, energy: bool = False) -> None:
        self.gear, self.energy = gear, energy
        self._lock = threading.Lock()
        self._t = _Totals()

    def count(self, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._lock:
            self._t.requests[outcome] += 1

    def add(self, stats: RequestStats, outcome: str = "ok") -> None:
        with self._lock:
            self._t.requests[outcome] += 1
            for f in fields(RequestStats):
                if f.name != "energy_j":
                    setattr(self._t, f.name, getattr(self._t, f.name) + getattr(stats, f.name))
            if stats.energy_j is not None:
                self._t.energy_j += stats.energy_j
                self._t.energy_tokens += stats.completion_tokens
                self._t.energy_requests += 1

    def requests(self, outcome: str) -> int:
        with self._lock:
            return self._t.requests[outcome]

    def render(self, queued: int, busy: bool) -> str:
        with self._lock:
            t = _Totals(**{f.name: getattr(self._t, f.name) for f in fields(_Totals) if f.name != "requests"},
                        requests=dict(self._t.requests))
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float | None, labels: str = "") -> None:
            if value is None:
                return
            if not any(line.startswith(f"# TYPE sdsie_{name} ") for line in out):
                out.extend([f"# HELP sdsie_{name} {help_}", f"# TYPE sdsie_{name} {kind}"])
            out.append(f"sdsie_{name}{labels} {_fmt(value)}")

        for outcome in OUTCOMES:
            metric("requests_total", "counter", "Requests answered, by outcome.", t.requests[outcome],
                   f'{{outcome="{outcome}"}}')
        metric("queue_depth", "gauge", "Requests waiting behind the running one.", queued)
        metric("busy", "gauge", "1 while a generation runs.", int(busy))
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", t.prompt_tokens)
        metric("completion_tokens_total", "counter", "Tokens generated.", t.completion_tokens)
        metric("generation_seconds_total", "counter", "Engine time spent generating.", t.seconds)
        metric("tokens_per_second", "gauge", "Tokens generated per second of engine time.",
               _ratio(t.completion_tokens, t.seconds))
        metric("cycles_total", "counter", "Decode cycles.", t.cycles)
        metric("engaged_cycles_total", "counter", "Decode cycles the clutch engaged.", t.engaged_cycles)
        metric("engaged_cycle_share", "gauge", "Share of decode cycles engaged.", _ratio(t.engaged_cycles, t.cycles))
        metric("speculate_cycles_total", "counter", "Decode cycles that drafted with the scout.", t.speculate_cycles)
        metric("drafted_tokens_total", "counter", "Draft tokens proposed by the scout.", t.drafted)
        metric("accepted_tokens_total", "counter", "Draft tokens the target accepted.", t.accepted)
        metric("acceptance_rate", "gauge", "Accepted over drafted tokens.", _ratio(t.accepted, t.drafted))
        metric("target_forwards_total", "counter",
               "Target forward passes (prefill, cycles, and steps launched ahead then dropped).", t.target_forwards)
        metric("dropped_forwards_total", "counter",
               "Target steps launched ahead of a read and dropped: the run ended, or the clutch flipped.",
               t.dropped_forwards)
        if self.gear:
            metric("int4_target_forwards_total", "counter", "Kept target forwards in the INT4 gear.",
                   t.int4_target_forwards)
            metric("int4_forward_share", "gauge", "Share of kept target forwards in the INT4 gear.",
                   _ratio(t.int4_target_forwards, t.target_forwards - t.dropped_forwards))
        if self.energy and t.energy_requests:  # no reading yet: no energy line, never 0 J
            metric("energy_joules_total", "counter", "GPU energy of requests with a reading (NVML).", t.energy_j)
            metric("energy_measured_requests_total", "counter", "Requests with an energy reading.", t.energy_requests)
            metric("joules_per_token", "gauge", "GPU energy per generated token, over requests with a reading.",
                   _ratio(t.energy_j, t.energy_tokens))
        return "\n".join(out) + "\n"


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _fmt(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
