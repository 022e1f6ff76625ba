"""Where a graphed tree cycle's time goes, on models of the gpu stand-in's shapes (random weights: no build needed).

Answered: telemetry/raw/tree_cycle_profile_20261202T0011_h200.json and tree_cycle_profile_20261202T0237_h200.json
hold the split (792 kernels a graphed plain token, about 2 us each); the findings are in docs/log.md.

    python -m research.standin.tree_cycle_profile --widths 4,3,3 --out $OUT/tree_cycle_profile.json

Record 4f850b1f measured a tree cycle (4,3,3, one CUDA graph per cycle) at 4.15 ms on code, against about 2.7 ms
for its forwards; this splits a cycle into its parts. The engine's own calls are wrapped, unchanged, with CUDA
events and host clocks around each: engine.forward (in a tree cycle the scout's catch-up, in plain decoding the
target's step; the prompt's prefill is counted in too), the tree step (one graph replay), the one host read, and the
rest of the host's work per cycle (wall minus the three); a second, shorter budget gives a run's fixed cost outside
its cycles. Each tree runs four ways (engine_as): as the engine runs it, with the scout's catch-up as its own
forward (`_separate`), and as record 4f850b1f ran it (`_as_4f850b1f`: also per-layer cache tensors, so a compaction
is two kernels a layer), and as the engine runs it with the scout's RMSNorms fused (`_fused_scout`, one Triton kernel
a norm); with --compiled-scout also with a copy of the scout compiled by torch.compile (`_compiled_scout`). Plain
graphed decoding is split the same way per token. A torch.profiler pass over one run counts the kernels each loop
launches and their summed GPU time. Weights do not change the kernels a cycle launches,
only how many nodes it keeps, so the scout here keeps few (the catch-up then feeds 1-2 tokens, as after a rejected
path).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import sdsie.decoding.engine as engine
from sdsie.decoding import DecodeConfig, generate
from sdsie.decoding.model_io import StaticKV, sync_device
from sdsie.decoding.tree import TreeStep, check_widths
from sdsie.kernels.rmsnorm import fuse_rmsnorm
from sdsie.models import compiled_copy
from sdsie.standin import build_model, get_preset

PARTS = ("forward", "tree_step", "to_host")  # engine.forward: a tree cycle's scout catch-up; plain's target step;
# to_host: the host's wait for a cycle's device->host read (engine._wait)


class _HostEvent:
    """torch.cuda.Event's two calls on the host clock: without CUDA (the CPU test) a part's device time is its host
    time."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1e3 * (end.t - self.t)


class Timer:
    """CUDA events (host clocks without CUDA) and host time around the wrapped calls, per part."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.host_s: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        event = torch.cuda.Event if self.device.type == "cuda" else _HostEvent

        def inner(*args, **kwargs):
            start, end = event(enable_timing=True), event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.host_s[name] += time.perf_counter() - t0
            self.events[name].append((start, end))
            return out
        return inner

    def gpu_ms(self, name: str) -> float:
        sync_device(self.device)
        return sum(s.elapsed_time(e) for s, e in self.events[name])


def models(device: str, dtype: torch.dtype):
    cfg = get_preset("gpu")
    tok = SimpleNamespace(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    target, scout = (build_model(shape, cfg, tok).to(device, dtype).eval() for shape in (cfg.target, cfg.scout))
    return target, scout, cfg.vocab_size


@contextlib.contextmanager
def engine_as(separate: bool = False, per_layer: bool = False) -> Iterator[None]:
    """The engine as it ran before its last two tree-cycle changes, for an A/B in one process: separate, the scout's
    catch-up as its own (graphed) forward instead of folded into the tree step (TreeStep.can_catch_up); per_layer, the
    static caches' layers in tensors of their own, so a compaction is two kernels a layer (StaticKV._consolidate).
    Static caches are kept across runs, so they are dropped on the way in and out (the next run makes its own)."""
    can, consolidate = TreeStep.can_catch_up, StaticKV._consolidate
    engine._STATIC.clear()
    if separate:
        TreeStep.can_catch_up = lambda self, n: False
    if per_layer:
        StaticKV._consolidate = lambda self: None
    try:
        yield
    finally:
        TreeStep.can_catch_up, StaticKV._consolidate = can, consolidate
        engine._STATIC.clear()


def split(target, scout, ids: torch.Tensor, config: DecodeConfig, runs: int) -> dict:
    """Median over runs of each part's GPU and host ms per cycle, and the wall ms per cycle."""
    per_run = []
    for _ in range(runs):
        timer = Timer(ids.device)
        originals = engine.forward, TreeStep.__call__, TreeStep.catch_up, engine._wait
        engine.forward = timer.wrap("forward", engine.forward)
        TreeStep.__call__ = timer.wrap("tree_step", TreeStep.__call__)  # a cycle runs one of these two
        TreeStep.catch_up = timer.wrap("tree_step", TreeStep.catch_up)
        engine._wait = timer.wrap("to_host", engine._wait)  # the cycle's wait for its device->host read
        try:
            sync_device(ids.device)
            t0 = time.perf_counter()
            r = generate(target, ids, config, scout=scout if config.tree_widths else None)
            sync_device(ids.device)
            wall = time.perf_counter() - t0
        finally:
            engine.forward, TreeStep.__call__, TreeStep.catch_up, engine._wait = originals
        n = len(r.cycles)
        row = {"cycles": n, "tokens": len(r.tokens), "wall_ms_per_cycle": 1e3 * wall / n,
               "accepted_per_cycle": sum(c.accepted for c in r.cycles) / n,
               "forward_calls": len(timer.events["forward"])}  # the prefill's and every separate catch-up's
        for part in PARTS:
            row[f"{part}_gpu_ms"] = timer.gpu_ms(part) / n
            row[f"{part}_host_ms"] = 1e3 * timer.host_s[part] / n
        row["other_host_ms"] = row["wall_ms_per_cycle"] - sum(row[f"{p}_host_ms"] for p in PARTS)
        per_run.append(row)
    return {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}


def fixed_ms(long: dict, short: dict) -> float:
    """A run's cost outside its cycles (the prefill, the scout's first catch-up over the prompt, setup), from two
    budgets' splits: wall = fixed + cycles x per-cycle, solved for fixed. With a scout that keeps little, as here,
    every cycle costs the same, so two points give the line."""
    (c1, w1), (c2, w2) = ((r["cycles"], r["cycles"] * r["wall_ms_per_cycle"]) for r in (short, long))
    if c2 == c1:
        raise ValueError(f"fixed_ms needs two cycle counts, got {c1} twice")
    return (w1 * c2 - w2 * c1) / (c2 - c1)


def kernels(target, scout, ids: torch.Tensor, config: DecodeConfig) -> dict:
    """Kernel launches and their summed GPU time per cycle over one run (torch.profiler), and the ten largest; none
    for a run off CUDA."""
    from torch.profiler import ProfilerActivity, profile

    if ids.device.type != "cuda":
        return {"kernels_per_cycle": None}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = generate(target, ids, config, scout=scout if config.tree_widths else None)
        sync_device(ids.device)
    n = len(r.cycles)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in evs:
        by_name[e.name].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    return {"kernels_per_cycle": len(evs) / n, "kernel_gpu_ms_per_cycle": sum(map(sum, by_name.values())) / n / 1e3,
            "top": [{"name": k[:120], "calls_per_cycle": len(v) / n, "us_per_cycle": sum(v) / n} for k, v in top]}


def select(loops: dict[str, Any], only: list[str] | None) -> dict[str, Any]:
    """The loops named in `only` (all without it), in their order; a name that is not a loop is an error."""
    if only is None:
        return loops
    unknown = [name for name in only if name not in loops]
    if unknown:
        raise SystemExit(f"--only: no loop named {', '.join(unknown)}; the loops are {', '.join(loops)}")
    return {name: loop for name, loop in loops.items() if name in only}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", nargs="+", default=["4,3,3"], help="one or more trees, e.g. 4,3,3 6,4,4")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no graphs, no kernel counts)")
    p.add_argument("--compiled-scout", action="store_true",
                   help="also time each tree with a copy of the scout compiled by torch.compile (inductor; its kernels "
                        "captured in the tree step's graph): `<tree>_compiled_scout`")
    p.add_argument("--only", nargs="+", metavar="LOOP", help="time only these loops (names as in the JSON)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tree_cycle_profile needs a CUDA GPU (or --device cpu for a dry run)")
    trees = [check_widths(tuple(int(w) for w in text.split(","))) for text in a.widths]
    target, scout, vocab = models(a.device, torch.bfloat16)
    ids = torch.randint(3, vocab, (48,), generator=torch.Generator().manual_seed(0)).to(a.device)
    base = dict(max_new_tokens=a.tokens, kv_cache="static", cuda_graphs=a.device == "cuda")
    fused = copy.deepcopy(scout)  # the scout with one kernel a norm (decode_repro's tree_graphs_fused_scout)
    fuse_rmsnorm(fused)
    compiled = compiled_copy(scout) if a.compiled_scout else None
    loops = {"plain_graphs": (DecodeConfig(**base), {}, scout)}
    for w in trees:  # each tree as the engine runs it, with the catch-up separate, as record 4f850b1f ran it, and with
        # the fused scout (and the compiled one)
        name, cfg = f"tree_graphs_{'x'.join(map(str, w))}", DecodeConfig(**base, tree_widths=w)
        loops |= {name: (cfg, {}, scout), f"{name}_separate": (cfg, {"separate": True}, scout),
                  f"{name}_as_4f850b1f": (cfg, {"separate": True, "per_layer": True}, scout),
                  f"{name}_fused_scout": (cfg, {}, fused)}
        if compiled is not None:
            loops[f"{name}_compiled_scout"] = (cfg, {}, compiled)
    loops = select(loops, a.only)
    out: dict = {"trees": [list(w) for w in trees], "tokens": a.tokens, "runs": a.runs,
                 "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None, "torch": torch.__version__}
    for name, (cfg, switches, drafter) in loops.items():
        with engine_as(**switches):
            generate(target, ids, cfg, scout=drafter if cfg.tree_widths else None)  # capture and warm
            row = split(target, drafter, ids, cfg, a.runs)
            short = split(target, drafter, ids, dataclasses.replace(cfg, max_new_tokens=max(2, a.tokens // 4)), a.runs)
            out[name] = row | {"fixed_ms_per_run": fixed_ms(row, short)} | kernels(target, drafter, ids, cfg)
        print(name, json.dumps({k: v for k, v in out[name].items() if k != "top"}), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
